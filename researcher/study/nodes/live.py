"""The live nodes: keep the study's live core run going and swap approved `hot_swap` proposals into it.

`start_live` (before the first plan) and `live` (between `prepare`, which leaves hot-swap proposals
to it, and `launch`). With `run.live: true` they start the live run once (launch key `live`,
adopted on resume like any launch) and refresh its state. Each approved, validated `hot_swap` proposal of the round is then swapped in
(`researcher.runs.live_swaps`: intent before act, never twice) as an A/B, tagged `swarmrl.swap.<n>` on the
live run, and judged, each edited sandbox on its own: over the first `run.swap_window` steps after the
swap where both versions logged their paired score (`core.config.ab_metric`: the same tasks on the same
weights), the per-step difference new - old in the brief's direction (`researcher.evidence.ab.judge_ab`:
a HAC t-test, valid under autocorrelated noise, Holm across the round's comparisons). A `better` verdict
is confirmed on the next `swap_window` steps, which it never saw (`confirm_ab`). Then the loser drains:
the old version when the new one is better and confirmed, else the new one (inconclusive keeps the old
code). The live run is watched all along (`researcher.runs.live_watch`: the study stops it when
it diverges, stalls or spends the budget); an A/B whose window it did not fill ends `inconclusive`
with the reason ("the live run stalled: ..."), never judged on a partial window, and nothing drains
from a stopped run. The old version's steps before the swap are kept as a picture (`before`), never as
evidence. The swap and its verdict join the state (`swaps`), the proposal gets its result, and its
review run is closed. A swap that fails leaves the old code serving and the proposal `failed` with
the reason. The node does not plan, validate, review or start other runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from core.config_io import ConfigError
from researcher.code.workspace import WorkspaceError
from researcher.evidence import analysis
from researcher.evidence.ab import confirm_ab, judge_ab
from researcher.evidence.decision import Verdict
from researcher.records import ExperimentResult, Launch, Proposal, SwapResult, SwapSide
from researcher.runs import live_watch
from researcher.runs.live_swaps import LIVE_KEY, LiveRun, SwapFailed
from researcher.study.nodes.base import StudyState, dump
from researcher.study.nodes.running import RunNodes

NO_LIVE = "not swapped: a hot swap needs a live run (brief `run.live: true`)"
LIVE_ENDED = "not swapped: the live run has ended ({status}: {reason})"


class LiveNode(RunNodes):
    def _live_run(self) -> LiveRun:
        assert self.ctx.workspace is not None
        return LiveRun(self.ctx.launcher, self.ctx.client, self.ctx.paths.state, self.ctx.workspace)

    def _ensure_live(self, state: StudyState) -> Launch | None:
        """The live run, started on first use; None when the brief asks for none (or has no workspace)."""
        ctx = self.ctx
        if not ctx.brief.run.live or ctx.workspace is None:
            return None
        if state.get("live"):  # refreshed, and stopped if it diverged, stalled or spent the budget
            return Launch.model_validate(self._watch_live(state))
        try:
            config = ctx.brief.resolve_config(ctx.workdir)
        except ConfigError as e:
            return Launch(key=LIVE_KEY, proposal_id=LIVE_KEY, seed=0, steps=0, status="failed",
                          reason=f"invalid run config: {e}")
        config = self._code_config(config, LIVE_KEY)
        code = str(ctx.launcher.run_dir(LIVE_KEY) / "code")
        # Swappable means isolated: each workspace sandbox runs as its own `swarm client` process.
        clients = [c.model_copy(update={"isolate": True}) if c.agent.startswith(code) else c for c in config.clients]
        config = config.model_copy(update={"clients": clients})
        ctx.paths.configs.mkdir(parents=True, exist_ok=True)
        path = ctx.paths.configs / f"{LIVE_KEY}.yaml"
        path.write_text(yaml.safe_dump(config.model_dump(), sort_keys=False))
        live = Launch(key=LIVE_KEY, proposal_id=LIVE_KEY, seed=ctx.brief.seeds[0], steps=config.trainer.steps,
                      config_path=str(path), commit=state.get("workspace_base", ""))
        live = ctx.launcher.start(live, ctx.client)
        ctx.emit("live.started", key=live.key, status=live.status, pid=live.pid)
        return live

    def start_live(self, state: StudyState) -> dict[str, Any]:
        """Before the first plan: the live run is going before anyone proposes a swap into it."""
        self._enter("start_live", state)
        live = self._ensure_live(state)
        return {"live": live.model_dump() if live is not None else {}}

    def live(self, state: StudyState) -> dict[str, Any]:
        self._enter("live", state)
        ctx = self.ctx
        live = self._ensure_live(state)
        study = self._study(state)
        results, swaps = list(study.results), list(study.swaps)
        done = {r.proposal_id for r in results}
        verdicts, code = study.verdicts, study.versions
        todo = [p for p in study.current if p.mode == "hot_swap" and p.id not in done
                and (d := verdicts.get(p.id)) is not None and d.verdict == "approved"
                and p.id in code and code[p.id].passed]
        update: dict[str, Any] = {"live": live.model_dump() if live is not None else {}}
        names = _sandboxes(live) if live is not None and live.config_path else []
        # The round's comparisons: those judged before a resume, then one per edited sandbox of each to come.
        current = {p.id for p in study.current}
        judged = {f"{s.proposal_id}/{s.n}": s.verdict for s in swaps if s.proposal_id in current and s.verdict}
        pending = sum(len(_edited(names, code[p.id].diff)) for p in todo)
        for p in sorted(todo, key=lambda q: (q.priority, q.id)):
            pending -= len(_edited(names, code[p.id].diff))
            if live is not None and live.status == "running" and live.run_id is None:
                live = ctx.launcher.poll(live, ctx.client)
            try:
                if live is None:
                    raise SwapFailed(NO_LIVE)
                if live.status != "running":
                    raise SwapFailed(LIVE_ENDED.format(status=live.status, reason=live.reason or "-"))
                swapped, live = self._swap(p, code[p.id].commit, code[p.id].diff, live, judged, pending,
                                           {**state, "swaps": dump(swaps)})
            except (SwapFailed, WorkspaceError) as e:  # the old code keeps serving; the study goes on
                results.append(ExperimentResult(proposal_id=p.id, status="failed", note=str(e)))
                ctx.board.close(p.id, None, "FAILED", str(e))
                ctx.emit("swap.failed", proposal_id=p.id, reason=str(e)[:500])
                continue
            swaps += swapped
            results.append(self._result(p, swapped))
        update.update(live=live.model_dump() if live is not None else {}, swaps=dump(swaps), results=dump(results))
        return update

    def _swap(self, p: Proposal, commit: str, diff: str, live: Launch, judged: dict[str, Verdict],
              pending: int, state: StudyState) -> tuple[list[SwapResult], Launch]:
        """A/B each edited sandbox, judge it (Holm with the round's `judged` and `pending` comparisons,
        `judged` growing as they are made) and drain its loser; -> the swaps and the live run as it is now.
        The live run is watched while an A/B waits for its steps (`researcher.runs.live_watch`): one that
        ends, stalls, diverges or spends the budget before the window is full ends the A/B `inconclusive`
        with that reason, never judged on the steps it had."""
        ctx, runner = self.ctx, self._live_run()
        watched = {"live": live.model_dump()}

        def stopped() -> str | None:
            """Why the live run can no longer serve the A/B (refreshing it), or None while it can."""
            watched["live"] = self._watch_live({**state, "live": watched["live"]})
            current = Launch.model_validate(watched["live"])
            return None if current.status == "running" else live_watch.ended(current)

        edited = _edited(_sandboxes(live), diff)
        runner.wait_up(lambda: stopped() is None)
        run_id = live.run_id or ctx.launcher.find_run_id(ctx.client, LIVE_KEY)
        ctx.emit("swap.intent", proposal_id=p.id, commit=commit, sandboxes=edited)
        records = runner.swap(p.id, commit, edited, run_id)
        out = []
        for i, record in enumerate(records):
            if run_id:
                runner.tag(run_id, record, p.id)
            ctx.emit("swap.done", proposal_id=p.id, n=record["n"], step=record["step"], to=record["to_version"])
            window = ctx.brief.run.swap_window
            old, new, cut = runner.ab_steps(run_id, record, window, stopped, ctx.brief.launch.run_timeout or 3600.0,
                                            ctx.brief.monitor.poll_s) if run_id else (None, None, None)
            if cut is not None:  # a window the live run did not fill is no evidence either way
                verdict = Verdict(result="inconclusive", test="none", baseline=old.version if old else None,
                                  reason=cut)
            elif old and new:
                verdict = judge_ab(new.steps, old.steps, ctx.brief.objective.direction, baseline_id=old.version,
                                   round_verdicts=judged, pending=pending + len(records) - i - 1)
                # Each version's calls and tokens per episode over the window: a harness that buys its score says so.
                verdict = verdict.model_copy(update={
                    "cost": runner.cost(run_id, record["sandbox"], [record["to_version"]], new.steps),
                    "cost_baseline": runner.cost(run_id, record["sandbox"], record["from_versions"], old.steps)})
            else:
                verdict = None
            judged[f"{p.id}/{record['n']}"] = verdict if verdict is not None else Verdict(result="inconclusive",
                                                                                         test="none")
            confirmation = self._confirm_swap(runner, run_id, record, verdict, new, stopped) if new else None
            better = confirmation is not None and confirmation.result == "better"
            serving = Launch.model_validate(watched["live"]).status == "running"
            for version in (record["from_versions"] if better else [record["to_version"]]) if serving else []:
                runner.drain(record["sandbox"], version, p.id)
            # A stopped live run serves nothing: no version is kept.
            kept = (record["to_version"] if better else ",".join(record["from_versions"])) if serving else None
            ctx.emit("swap.drained", proposal_id=p.id, n=record["n"], kept=kept,
                     verdict=verdict.fmt() if verdict else "")
            out.append(SwapResult(proposal_id=p.id, n=record["n"], step=record["step"], sandbox=record["sandbox"],
                                  from_version=",".join(record["from_versions"]), to_version=record["to_version"],
                                  before=runner.before(run_id, record, window) if run_id else None, after=new, old=old,
                                  verdict=verdict, confirmation=confirmation, kept=kept))
        return out, Launch.model_validate(watched["live"])

    def _confirm_swap(self, runner: LiveRun, run_id: str | None, record: dict, verdict: Verdict | None, first: SwapSide,
                 stopped) -> Verdict | None:
        """A better verdict's confirmation on the next `swap_window` steps, after the first window's last (None:
        nothing to confirm); a window the live run did not fill confirms nothing."""
        if verdict is None or verdict.result != "better" or not run_id:
            return None
        brief = self.ctx.brief
        old, new, cut = runner.ab_steps(run_id, record, brief.run.swap_window, stopped, brief.launch.run_timeout or 3600.0,
                                        brief.monitor.poll_s, after=max(first.steps))
        if cut is not None:
            return Verdict(result="inconclusive", test="none", baseline=old.version, reason=f"not confirmed: {cut}")
        confirmation = confirm_ab(verdict, new.steps, old.steps, brief.objective.direction, baseline_id=old.version)
        self.ctx.emit("swap.confirmation", n=record["n"], sandbox=record["sandbox"], verdict=confirmation.fmt())
        return confirmation

    def _result(self, p: Proposal, swapped: list[SwapResult]) -> ExperimentResult:
        """The proposal's result: the new version's scores in the A/B, judged against the old one's beside it,
        each sandbox on its own; the proposal's verdict is its weakest sandbox's (`_weakest`)."""
        values = [v for s in swapped if s.after for v in s.after.steps.values()]
        note = "; ".join(f"A/B swap {s.n} of {s.sandbox} at step {s.step}: {s.from_version} vs {s.to_version} over "
                         f"{len(s.after.steps) if s.after else 0} steps, score {_fmt(s.old.mean if s.old else None)} "
                         f"(old) vs {_fmt(s.after.mean if s.after else None)} (new): "
                         f"{s.verdict.fmt() if s.verdict else 'not judged'}"
                         f"{f'; confirmation: {s.confirmation.fmt()}' if s.confirmation else ''}; "
                         f"kept {s.kept or 'none (the live run stopped)'}" for s in swapped)
        summary = analysis.summarize(values)
        verdict = _weakest(swapped)
        self.ctx.board.close(p.id, summary, "FINISHED", note)
        self.ctx.emit("result", proposal_id=p.id, status="ok", summary=summary.fmt(),
                      verdict=verdict.fmt() if verdict else "")
        return ExperimentResult(proposal_id=p.id, status="ok", values=values, summary=summary, note=note,
                                verdict=verdict)


# Which sandbox's verdict speaks for a proposal: the first in this order (a win counts only when confirmed).
_WEAKEST_FIRST = ("worse", "incomplete", "inconclusive", "better")


def _weakest(swapped: list[SwapResult]) -> Verdict | None:
    """The proposal's verdict across its sandboxes: better only when every sandbox's win was confirmed, else the
    weakest sandbox's own verdict (an unconfirmed win: its confirmation), named by sandbox."""
    own = []
    for s in swapped:
        v = s.confirmation if s.verdict is not None and s.verdict.result == "better" else s.verdict
        if v is None:
            return None
        own.append((_WEAKEST_FIRST.index(v.result) if v.result in _WEAKEST_FIRST else 0, s.sandbox, v))
    rank, sandbox, verdict = min(own, key=lambda t: t[0])
    if rank == len(_WEAKEST_FIRST) - 1:  # every sandbox won, confirmed: the first window's evidence
        return swapped[0].verdict
    if len(swapped) == 1:
        return verdict
    return verdict.model_copy(update={"reason": f"sandbox {sandbox}: {verdict.reason or verdict.result}"})


def _edited(names: list[str], diff: str) -> list[str]:
    """The live run's sandboxes a diff touches (it names a/sandboxes/<n>/...); all of them if it names none."""
    return [n for n in names if f"/sandboxes/{n}/" in diff] or names


def _sandboxes(live: Launch) -> list[str]:
    """The names of the workspace sandboxes the live run's clients run (from its written config)."""
    config = yaml.safe_load(Path(live.config_path).read_text()) or {}
    agents = [str(c.get("agent", "")) for c in config.get("clients", [])]
    return [a.rsplit("/sandboxes/", 1)[-1].rstrip("/") for a in agents if "/sandboxes/" in a]


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"
