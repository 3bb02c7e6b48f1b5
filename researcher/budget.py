"""Budget accounting: what a study has spent against its brief, and whether it may spend more.

Runs and trainer steps are counted when a run is launched, at the steps it was asked for, so the
count is the same whether or not the study was interrupted; the study's live run is one run too,
its steps counted as it logs them (`researcher.runs.live_watch` refreshes them). Compute time (`wall_s`)
is the time some run was running: the union of the runs' [start, end] intervals, the live run's
included. Time waiting for a person, and a downtime in which
nothing ran (the machine rebooted), are free; a run's end is its last sign of life
(`researcher.runs.launcher`), not the moment a resumed study noticed it was gone. Tokens are
what the llm planner's endpoint reported. GPU-hours are each launched run's wall time times the
GPUs the brief says a run requests (`launch.gpus`; 0 on CPU). This module computes; it stops nothing itself.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from researcher.brief.schema import Brief
from researcher.records import Launch

LAUNCHED = ("running", "finished", "failed", "stopped", "stalled")


@dataclass(frozen=True)
class Spent:
    runs: int
    steps: int
    tokens: int
    wall_s: float
    gpu_hours: float = 0.0  # sum over launched runs of their wall time x the GPUs each requests

    @classmethod
    def of(cls, state: Mapping[str, Any], now: float | None = None, gpus: int = 0) -> Spent:
        """What `state` has spent; `gpus` is the brief's `launch.gpus` (GPUs per run)."""
        launches = [Launch.model_validate(x) for x in state.get("launches", [])]
        live = Launch.model_validate(state["live"]) if state.get("live") else None
        return cls.counted(launches, live, int(state.get("tokens_used", 0)), now, gpus)

    @classmethod
    def counted(cls, launches: Sequence[Launch], live: Launch | None, tokens: int, now: float | None = None,
                gpus: int = 0) -> Spent:
        """What the launches, the live run and `tokens` LLM tokens have spent, from records already typed."""
        launched = [x for x in launches if x.status in LAUNCHED]
        clock = now or time.time()
        live_runs = [live] if live is not None and live.status in LAUNCHED else []
        timed = launched + live_runs
        intervals = [(x.started_at, max(x.started_at, x.ended_at or clock)) for x in timed if x.started_at is not None]
        run_s = sum(end - start for start, end in intervals)
        steps = sum(x.steps for x in launched) + (live.steps_done if live is not None else 0)
        return cls(runs=len(launched) + len(live_runs), steps=steps, tokens=tokens,
                   wall_s=interval_union(intervals), gpu_hours=run_s * gpus / 3600.0)

    def left(self, brief: Brief) -> tuple[int, int, int]:
        """(runs, steps, tokens) still available."""
        b = brief.budget
        return (max(0, b.max_runs - self.runs), max(0, b.max_total_steps - self.steps),
                max(0, b.llm_tokens - self.tokens))

    def exhausted(self, brief: Brief, llm: bool) -> str | None:
        """Why the study may not start another round, or None."""
        b = brief.budget
        if self.runs >= b.max_runs:
            return f"budget: {self.runs} of {b.max_runs} runs used"
        compute = self.compute_exhausted(brief)
        if compute:
            return compute
        if llm and self.tokens >= b.llm_tokens:
            return f"budget: {self.tokens} of {b.llm_tokens} LLM tokens used"
        return None

    def compute_exhausted(self, brief: Brief) -> str | None:
        """Why a run already going may not go on (steps, wall-clock, GPU-hours spent), or None."""
        b = brief.budget
        if self.steps >= b.max_total_steps:
            return f"budget: {self.steps} of {b.max_total_steps} trainer steps used"
        if self.wall_s >= b.wall_clock:
            return f"budget: {self.wall_s:.0f} s of {b.wall_clock:.0f} s wall-clock used"
        if b.gpu_hours is not None and self.gpu_hours >= b.gpu_hours:
            return f"budget: {self.gpu_hours:.2f} of {b.gpu_hours:g} GPU-hours used"
        return None

    def rows(self, brief: Brief) -> list[tuple[str, str, str]]:
        """(what, used, limit) for status output and the report."""
        b = brief.budget
        return [("runs", str(self.runs), str(b.max_runs)), ("trainer steps", str(self.steps), str(b.max_total_steps)),
                ("wall-clock (s)", f"{self.wall_s:.0f}", f"{b.wall_clock:.0f}"),
                ("LLM tokens", str(self.tokens), str(b.llm_tokens)),
                ("GPU-hours", f"{self.gpu_hours:.2f}", "-" if b.gpu_hours is None else f"{b.gpu_hours:g}")]


def interval_union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by the intervals: runs side by side count once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total
