"""The offline planner: successive halving over the brief's search space.

The search (Jamieson & Talwalkar 2016, the core of Hyperband):
1. Rung 0 runs `arms` configurations for a few trainer steps. The baseline (the base config's own
   values) is always one arm, so the study can say whether any change helped at all. The other
   arms are drawn from the space with a seeded generator: a shuffled grid when every parameter
   is a choice, log-uniform or uniform draws for ranges.
2. Each next rung keeps the best 1/eta of the previous rung (mean over seeds; a failed or
   diverged experiment ranks last) and gives them eta times as many steps. Each survivor's
   baseline of the same length is not this planner's doing: the study graph adds one for any
   planner's proposals (`researcher.evidence.baselines`), and verdicts use it (`researcher.evidence.decision`).
3. It ends when one configuration is left (beside its baseline). Whether it is recommended is
   not the planner's call: only a `better` verdict that replicates on held-out seeds is.

Decisions feed back: a vetoed configuration is never proposed again, and a replacement is drawn
(rung 0) or the next-best survivor is promoted (later rungs). The plan is a pure function of the
brief, its seed and the study's history, so a resumed study plans exactly as an uninterrupted one.
It never proposes code changes: those need the llm planner or a person.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Iterator
from typing import Any

from researcher.brief.schema import ChoiceParam, RangeParam
from researcher.planner.types import PlanContext, Planned, PlanResult
from researcher.records import Proposal, ProposalDraft

# A grid larger than this is sampled instead of enumerated, to keep planning instant.
_MAX_GRID = 10_000
# Draws without a new configuration before the space counts as exhausted.
_MAX_DRAW_MISSES = 1_000
# Sampled floats keep this many significant digits: readable proposals, and stable arm ids.
_SIG_DIGITS = 3

PLAINLY = "heuristic planner (offline, no LLM): successive halving over the brief's search space"


def arm_id(values: dict[str, Any]) -> str:
    return json.dumps(values, sort_keys=True, separators=(",", ":"))


def _round(x: float) -> float:
    return float(f"{x:.{_SIG_DIGITS}g}")


def _draw(param: RangeParam | ChoiceParam, rng: random.Random) -> Any:
    if isinstance(param, ChoiceParam):
        return rng.choice(param.values)
    if param.log:
        value = math.exp(rng.uniform(math.log(param.low), math.log(param.high)))
    else:
        value = rng.uniform(param.low, param.high)
    return int(round(value)) if param.integer else _round(value)


def candidate_arms(ctx: PlanContext) -> Iterator[dict[str, Any]]:
    """Baseline first, then the seeded sequence of distinct configurations."""
    params = ctx.brief.config_params()
    baseline = {k: ctx.base_values.get(k) for k in params}
    seen = {arm_id(baseline)}
    yield baseline
    rng = random.Random(ctx.brief.planner.seed)
    if all(isinstance(p, ChoiceParam) for p in params.values()):
        sizes = [len(p.values) for p in params.values() if isinstance(p, ChoiceParam)]
        if math.prod(sizes) <= _MAX_GRID:
            grid = [dict(zip(params, combo)) for combo in
                    itertools.product(*(p.values for p in params.values() if isinstance(p, ChoiceParam)))]
            rng.shuffle(grid)
            for arm in grid:
                if arm_id(arm) not in seen:
                    seen.add(arm_id(arm))
                    yield arm
            return
    misses = 0
    while misses < _MAX_DRAW_MISSES:
        arm = {k: _draw(p, rng) for k, p in params.items()}
        if arm_id(arm) in seen:
            misses += 1
            continue
        misses = 0
        seen.add(arm_id(arm))
        yield arm


def rung_sizes(arms: int, eta: int) -> list[int]:
    sizes = [arms]
    while sizes[-1] > 1:
        sizes.append(max(1, sizes[-1] // eta))
    return sizes


class HeuristicPlanner:
    name = "heuristic"

    def plan(self, ctx: PlanContext) -> PlanResult:
        settings = ctx.brief.planner.heuristic
        last_rung = len(rung_sizes(settings.arms, settings.eta)) - 1
        min_steps = settings.min_steps or max(1, ctx.base_steps // settings.eta ** last_rung)
        vetoed = {p.arm for p in ctx.proposals if self._vetoed(ctx, p)}
        arms = {p.arm: json.loads(p.arm) for p in ctx.proposals if p.arm}

        members = self._members(ctx, 0)
        if len(members) < settings.arms:
            need = settings.arms - len(members)
            taken = {p.arm for p in members} | vetoed
            fresh = [a for a in candidate_arms(ctx) if arm_id(a) not in taken][:need]
            if fresh:
                return self._propose(ctx, [(a, 0) for a in fresh], min_steps, "rung 0: sampling "
                                     f"{len(fresh)} configuration(s) of {settings.arms}")
            if not members:
                return PlanResult([], done=True, note=f"{PLAINLY}: the search space has no configuration "
                                  "left that was not vetoed")
        sizes = rung_sizes(settings.arms, settings.eta)
        baseline = arm_id({k: ctx.base_values.get(k) for k in ctx.brief.config_params()})
        for rung in range(0, last_rung + 1):
            members = self._members(ctx, rung)
            ranked = sorted(members, key=lambda p: self._score(ctx, p), reverse=True)
            if rung == last_rung or len(members) <= 1:
                return PlanResult([], done=True, note=self._final_note(ctx, ranked, baseline, rung))
            # The best 1/eta go on. Their baseline of the same length is the study graph's rule
            # (`researcher.evidence.baselines`), not this planner's: every planner gets one.
            picks = [p.arm for p in ranked if p.arm not in vetoed][:sizes[rung + 1]]
            if not picks:
                return PlanResult([], done=True, note=self._final_note(ctx, ranked, baseline, rung))
            have = {p.arm for p in self._members(ctx, rung + 1)}
            missing = [a for a in picks if a not in have and a is not None]
            if missing:
                return self._propose(ctx, [(arms.get(a) or json.loads(a), rung + 1) for a in missing], min_steps,
                                     f"rung {rung + 1}: promoting the best {len(picks)} of {len(members)} from "
                                     f"rung {rung}")
        return PlanResult([], done=True, note=f"{PLAINLY}: search complete")

    @staticmethod
    def _vetoed(ctx: PlanContext, p: Proposal) -> bool:
        d = ctx.verdict(p.id)
        return d is not None and d.verdict == "vetoed"

    def _members(self, ctx: PlanContext, rung: int) -> list[Proposal]:
        """Approved (or undecided) experiments of a rung, one per configuration."""
        out: dict[str, Proposal] = {}
        for p in ctx.proposals:
            if p.rung == rung and p.arm and not self._vetoed(ctx, p):
                out.setdefault(p.arm, p)
        return list(out.values())

    @staticmethod
    def _score(ctx: PlanContext, p: Proposal) -> float:
        """Higher is better whatever the direction; failed and unmeasured rank last."""
        result = ctx.result(p.id)
        if result is None or result.summary is None or math.isnan(result.summary.mean):
            return -math.inf
        sign = 1.0 if ctx.brief.objective.direction == "maximize" else -1.0
        return sign * result.summary.mean

    def _propose(self, ctx: PlanContext, arms: list[tuple[dict[str, Any], int]], min_steps: int,
                 note: str) -> PlanResult:
        planned: list[Planned] = []
        runs_left, steps_left = ctx.runs_left, ctx.steps_left
        eta = ctx.brief.planner.heuristic.eta
        for priority, (values, rung) in enumerate(arms, start=1):
            steps = min_steps * eta ** rung
            runs, cost = ctx.cost(steps)
            if runs > runs_left or cost > steps_left:
                note += f"; {len(arms) - len(planned)} left out for budget"
                break
            runs_left, steps_left = runs_left - runs, steps_left - cost
            changed = {k: v for k, v in values.items() if ctx.base_values.get(k) != v}
            what = ", ".join(f"{k}={v}" for k, v in sorted(changed.items())) or "the baseline"
            planned.append(Planned(ProposalDraft(
                hypothesis=f"{what} scores well on {ctx.brief.objective.metric}",
                rationale=(f"successive halving rung {rung}: " + ("a fresh configuration from the search space"
                           if rung == 0 else f"among the best of rung {rung - 1}")),
                overrides={**values, "trainer.steps": steps},
                expected_effect=f"{ctx.brief.objective.direction} {ctx.brief.objective.metric} "
                                f"relative to the other arms of rung {rung}",
                priority=min(priority, 10)), arm=arm_id(values), rung=rung))
        if not planned:
            return PlanResult([], done=True, note=f"{PLAINLY}: budget exhausted ({note})")
        return PlanResult(planned, note=f"{PLAINLY}; {note}")

    def _final_note(self, ctx: PlanContext, ranked: list[Proposal], baseline: str, rung: int) -> str:
        scored = [p for p in ranked if self._score(ctx, p) != -math.inf]
        if not scored:
            return f"{PLAINLY}: search complete at rung {rung}; no configuration produced a score"
        best = next((p for p in scored if p.arm != baseline), None)
        if best is None:
            return f"{PLAINLY}: search complete at rung {rung}; only the baseline is left"
        result = ctx.result(best.id)
        shown = ", ".join(f"{k}={v}" for k, v in sorted(best.overrides.items()) if k != "trainer.steps")
        assert result is not None and result.summary is not None
        verdict = f"; against the baseline: {result.verdict.fmt()}" if result.verdict else ""
        return (f"{PLAINLY}: search complete at rung {rung}; best configuration {shown} "
                f"({ctx.brief.objective.metric} {result.summary.fmt()}, proposal {best.id}{verdict})")
