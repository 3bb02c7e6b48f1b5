"""Watching the study's live run: its progress, stall and divergence checks, and the budget it spends.

The live run (brief `run.live: true`, launch key `live`) is always the study's own: `start_live`
starts it, the report stops it. It is billed like any run (researcher/budget.py): it is one of
`budget.max_runs`, the steps it has logged count toward `max_total_steps`, and the time it ran (not
a downtime in which it was gone) toward `wall_clock` and `gpu_hours`. `LiveWatch.check` refreshes
it (is it alive, its last logged step, when that step last moved) and says whether the study must
stop it, for one of:
- `divergence: ...`: a NaN or infinite value in the objective or `monitor.divergence_metrics`;
- `stalled: ...`: no new trainer step for `monitor.stall_s` (from its start until its first step);
- `budget: ...`: the steps, wall-clock or GPU-hours of the brief are spent (the runs budget is not
  a reason: keeping a run going starts no run).
Because the study launched it, the study stops it then (`stalled` for a stall, else `stopped`,
the reason in the launch intent first; the launcher closes a still-RUNNING MLflow run as KILLED):
a diverged or hung run has nothing left to judge, and its compute is the budget's. Collapse,
plateau and `launch.run_timeout` do not apply: a live run is long on purpose, and what its reward
does after a swap is the A/B's to judge. Nodes call `check` whenever they look at the budget and
while an A/B waits for its steps; `in_review` watches it while the study waits for a person (hours or
days, in which it keeps training). This module does not swap, judge or drain (researcher/study/nodes/live.py
does).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from mlflow.tracking import MlflowClient

from researcher.evidence import analysis
from researcher.brief.schema import Brief
from researcher.budget import Spent
from researcher.runs.launcher import Emit, Launcher
from researcher.records import Launch

# What a stopped or ended live run did, in words for a verdict's reason ("the live run stalled: ...").
ENDED = {"stalled": "stalled", "stopped": "was stopped", "finished": "finished", "failed": "failed"}


def progressed(live: Launch, last_step: int, now: float) -> Launch:
    """The live run with its last logged step; `progress_at` moves only when the step does."""
    if last_step <= live.steps_done:
        return live
    return live.model_copy(update={"steps_done": last_step, "progress_at": now})


def trouble(live: Launch, histories: Mapping[str, analysis.History], spent: Spent, brief: Brief,
            now: float) -> str | None:
    """Why the study must stop its live run (divergence, stall, budget), or None while it may go on."""
    return (analysis.divergence(dict(histories))
            or analysis.overdue(live, None, brief.monitor.stall_s, now)
            or spent.compute_exhausted(brief))


def ended(live: Launch) -> str:
    """A live run that no longer runs, as the reason an A/B into it ended: 'the live run stalled: ...'."""
    what = ENDED.get(live.status, live.status)
    detail = live.reason.removeprefix(f"{analysis.STALLED}: ")  # "stalled: stalled: ..." says it twice
    return f"the live run {what}" + (f": {detail}" if detail else "")


class LiveWatch:
    def __init__(self, launcher: Launcher, client: MlflowClient, brief: Brief, emit: Emit) -> None:
        self.launcher, self.client, self.brief, self.emit = launcher, client, brief, emit

    def check(self, live: Launch, state: Mapping[str, Any]) -> Launch:
        """The live run refreshed, and stopped (with the reason) if it diverged, stalled or spent the
        budget; `state` is the study's, for what the other runs spent."""
        if live.status != "running":
            return live
        live = self.launcher.poll(live, self.client)  # gone: it ended at its last sign of life
        if live.status != "running":
            return live
        now = time.time()
        histories: dict[str, analysis.History] = {}
        if live.run_id:
            run = analysis.read_run(self.client, live.run_id,
                                    [self.brief.objective.metric, *self.brief.monitor.divergence_metrics])
            live, histories = progressed(live, run.last_step, now), run.histories
        spent = Spent.of({**state, "live": live.model_dump()}, now=now, gpus=self.brief.launch.gpus)
        reason = trouble(live, histories, spent, self.brief, now)
        if reason is None:
            return live
        self.emit("live.stopping", key=live.key, reason=reason)
        status = "stalled" if reason.startswith(analysis.STALLED) else "stopped"
        live = self.launcher.stop(live, reason, self.client, status)
        self.emit("live.ended", key=live.key, status=live.status, reason=live.reason)
        return live


def in_review(watch: LiveWatch, state: Mapping[str, Any], every_s: float) -> Callable[[], None] | None:
    """A check for the review wait to call between its polls, at most every `every_s`; None when the
    study has no running live run.

    The graph's state is frozen at the interrupt, so the check keeps its own refreshed copy of the live
    launch (its step and when it last moved: a run that trains on is never taken for stalled). A stop it
    makes is on disk (the launch intent holds the reason), and the first node after the review reads it
    there through the launcher's poll. A failed look (MLflow down) is said and tried again next time.
    """
    if not state.get("live"):
        return None
    live = Launch.model_validate(state["live"])
    if live.status != "running":
        return None
    last = float("-inf")

    def check() -> None:
        nonlocal live, last
        if live.status != "running" or time.monotonic() - last < every_s:
            return
        last = time.monotonic()
        try:
            live = watch.check(live, state)
        except Exception as e:  # noqa: BLE001 - the wait for a person must outlive an MLflow outage
            watch.emit("live.watch_failed", key=live.key, error=f"{type(e).__name__}: {e}")

    return check
