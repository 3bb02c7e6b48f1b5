"""Replication that adapts: an inconclusive comparison buys the seeds it lacks, in stages.

When the search is over and nothing was judged better at the longest training, the most promising
comparison there (inconclusive, its effect in the objective's direction) gets seeds the study never
used, for the candidate and its reference alike, a stage at a time (once its planned looks are spent, the
next most promising one gets its stages); once something is `better`, the
confirmation round runs on held-out seeds, and while *its* look is inconclusive it too gets more
seeds in stages. Each stage is a round of two arms (planner `replication`, approved by the study:
more seeds of arms already approved) that `extends` the arm it adds to; their scores pool with it.

Every look is judged at its nominal level under a group-sequential design fixed before the looks it
governs (`researcher.evidence.sequential`: O'Brien–Fleming or Pocock spending, `replicate.boundary`):
the confirmation's when it is planned, the search comparison's at its first added stage. The number of
looks is `replicate.max_looks`, cut to what the budget left can pay then; the search's stages leave the
budget for `CONFIRM_RESERVE_LOOKS` looks of the confirmation, a reserve that shrinks to what one stage leaves
but never below the confirmation's first look: a promising comparison gets a stage whenever one stage and that
first look fit. It stops adding when a look decides, when the planned looks are spent, or when the budget cannot
pay the next stage.

What bounds the error: the confirmation is the test. Its seeds are held out, its looks spend alpha, so
a null pick is confirmed `better` at most alpha/2 of the time whatever the search did. The search's
stages are a screen that chooses what to confirm: their first look was the round's fixed-size test, so
a search comparison's own error may reach about twice its alpha; `bench/rigor.py` measures what the
two together keep (false keeps) and find (adaptive detection).

Pure functions over the study's records: which stage is owed and what each root's looks say. The
plan node launches nothing itself either; the graph runs a stage like any round.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from researcher.brief.schema import Brief
from researcher.evidence import confirmation, decision
from researcher.evidence.baselines import STAGE_PLANNER
from researcher.evidence.matching import (
    baseline_for,
    is_reference,
    line,
    root,
    steps_of,
)
from researcher.records import CodeVersion, ExperimentResult, Proposal, Verdict

# Looks of the confirmation the search's stages must leave the budget for: one look and one added stage,
# so a confirmation that starts inconclusive can still buy seeds (a fixed test on the first look alone
# is what ended the hidden check of issue 31 at p = 0.097 with a third of its budget unspent).
CONFIRM_RESERVE_LOOKS = 2
# Arms per stage: the candidate and its reference.
ARMS = 2


def design(first: int, add: int, max_looks: int, runs: int, steps: int, steps_per_run: int) -> list[int] | None:
    """Seeds per arm at each planned look: `first`, then `add` more a look, as many looks as `max_looks` and
    the budget (`runs`, `steps`, beyond the first look) pay for; None when not even one stage fits."""
    looks = [first]
    while len(looks) < max_looks:
        cost = ARMS * add
        if cost > runs or cost * steps_per_run > steps:
            break
        runs, steps = runs - cost, steps - cost * steps_per_run
        looks.append(looks[-1] + add)
    return looks if len(looks) > 1 else None


def confirmation_design(brief: Brief, runs_left: int, steps_left: int, steps_per_run: int) -> list[int] | None:
    """The confirmation's looks, planned when it starts from the budget left then; None: a fixed test."""
    if not brief.replicate.enabled:
        return None
    first = brief.confirm.seeds or len(brief.seeds)
    add = brief.replicate.stage_seeds or first
    paid = ARMS * first
    return design(first, add, brief.replicate.max_looks, runs_left - paid, steps_left - paid * steps_per_run,
                  steps_per_run)


def _reserve(brief: Brief, steps_per_run: int, looks: int = CONFIRM_RESERVE_LOOKS) -> tuple[int, int]:
    """Runs and steps of the confirmation's first `looks` looks."""
    if not brief.confirm.enabled:
        return 0, 0
    first = brief.confirm.seeds or len(brief.seeds)
    add = brief.replicate.stage_seeds or first
    runs = ARMS * (first + add * (looks - 1))
    return runs, runs * steps_per_run


def _search_budget(brief: Brief, default_steps: int, per_run: int, add: int, runs_left: int,
                   steps_left: int) -> tuple[int, int] | None:
    """What the search's stages may spend: all that is left but the confirmation's reserve, the reserve shrunk
    to what one stage leaves, never below the confirmation's first look. None when one stage and that first
    look do not both fit: then the stage would only buy a pick the study could not confirm (issue 38, item 8:
    a full reserve of `CONFIRM_RESERVE_LOOKS` looks once ended a study with a real fix unrecommended and 15
    of its 24 runs unspent)."""
    stage_runs, stage_steps = ARMS * add, ARMS * add * per_run
    first_runs, first_steps = _reserve(brief, default_steps, looks=1)
    if stage_runs + first_runs > runs_left or stage_steps + first_steps > steps_left:
        return None
    full_runs, full_steps = _reserve(brief, default_steps)
    spare_runs = max(first_runs, min(full_runs, runs_left - stage_runs))
    spare_steps = max(first_steps, min(full_steps, steps_left - stage_steps))
    return runs_left - spare_runs, steps_left - spare_steps


def _search_roots(proposals: Sequence[Proposal], results: dict[str, ExperimentResult], brief: Brief,
                  base_values: dict[str, Any], default_steps: int) -> list[Proposal]:
    """The search's inconclusive comparisons at the longest training that point the objective's way, the most
    promising (largest effect) first."""
    sign = 1.0 if brief.objective.direction == "maximize" else -1.0
    judged = [(p, results[p.id].verdict) for p in proposals
              if p.confirms is None and p.extends is None and not is_reference(p, base_values) and p.mode != "hot_swap"
              and p.id in results and results[p.id].verdict is not None]
    if not judged:
        return []
    longest = max(steps_of(p, default_steps) for p, _ in judged)
    open_ = [(p, v) for p, v in judged if steps_of(p, default_steps) == longest and v is not None
             and v.result == "inconclusive" and v.test != decision.NO_TEST and sign * (v.effect or 0.0) > 0]
    return [p for p, _ in sorted(open_, key=lambda pv: -sign * (pv[1].effect or 0.0))]


def next_stage(proposals: Sequence[Proposal], results: Sequence[ExperimentResult], brief: Brief,
               base_values: dict[str, Any], default_steps: int, number: int, runs_left: int, steps_left: int,
               code: dict[str, CodeVersion] | None = None) -> list[Proposal] | None:
    """The two arms of the next replication stage (round `number`), or None when none is owed or affordable."""
    if not brief.replicate.enabled:
        return None
    done = {r.proposal_id: r for r in results}
    confirming = [p for p in proposals if p.confirms and not is_reference(p, base_values)]
    if confirming:
        last = max(confirming, key=lambda p: p.stage)
        verdict = done[last.id].verdict if last.id in done else None
        return _stage(root(last, proposals), last, verdict, last.looks, proposals, brief, base_values, default_steps,
                      number, runs_left, steps_left, code)
    if confirmation.search_recommendation(proposals, results, default_steps, brief) is not None:
        return None  # something is better: the confirmation round is owed, not a stage
    # The most promising comparison first; one whose planned looks are spent leaves the next its stage, so a
    # study ends "nothing to recommend" with budget left only when no comparison points the right way.
    for first in _search_roots(proposals, done, brief, base_values, default_steps):
        last = line(first, proposals)[-1]
        verdict = done[first.id].verdict if last.id in done else None  # the root carries its line's last look
        looks = last.looks
        if looks is None:
            seeds = len(first.seeds or brief.seeds)
            add = brief.replicate.stage_seeds or seeds
            spend = _search_budget(brief, default_steps, steps_of(first, default_steps), add, runs_left, steps_left)
            looks = design(seeds, add, brief.replicate.max_looks, *spend, steps_of(first, default_steps)) if spend else None
        fresh = _stage(first, last, verdict, looks, proposals, brief, base_values, default_steps, number, runs_left,
                       steps_left, code)
        if fresh is not None:
            return fresh
    return None


def _stage(first: Proposal, last: Proposal, verdict: Verdict | None, looks: list[int] | None,
           proposals: Sequence[Proposal], brief: Brief, base_values: dict[str, Any], default_steps: int, number: int,
           runs_left: int, steps_left: int, code: dict[str, CodeVersion] | None) -> list[Proposal] | None:
    """The two arms of the next stage of `first`'s line (its latest look `last`, judged `verdict`), or None when its
    look decided, its planned looks are spent, or the budget cannot pay the stage."""
    if verdict is None or verdict.result != "inconclusive" or looks is None or last.stage >= len(looks):
        return None
    add = looks[last.stage] - looks[last.stage - 1]
    per_run = steps_of(first, default_steps)
    if ARMS * add > runs_left or ARMS * add * per_run > steps_left:
        return None
    reference = baseline_for(last, proposals, base_values, default_steps)
    if reference is None:
        return None
    commit = first.commit or ((code or {}).get(first.id).commit if first.id in (code or {}) else None)  # type: ignore[union-attr]
    if first.kind == "code" and not commit:
        return None  # its code never validated: nothing to run more seeds of
    used = [*brief.seeds, *(s for p in proposals for s in (p.seeds or []))]
    seeds = decision.held_out_seeds(used, add)
    stage = last.stage + 1
    look = f"look {stage} of {len(looks)} ({looks[stage - 1]} seeds per arm)"
    common: dict[str, Any] = {"round": number, "planner": STAGE_PLANNER, "seeds": seeds, "stage": stage,
                              "looks": looks, "priority": 1,
                              "expected_effect": f"the comparison's {look} decides it, or the next stage is owed"}
    ref_root = root(reference, proposals)
    return [
        Proposal(id=f"r{number}-1", hypothesis=f"{first.id} again on seeds {seeds}: {look}",
                 rationale=f"{first.id} against {ref_root.id} was inconclusive ({verdict.fmt()}): more seeds decide it",
                 overrides=dict(first.overrides), commit=commit, extends=first.id, confirms=first.confirms, **common),
        Proposal(id=f"r{number}-2", hypothesis=f"{ref_root.id} again on seeds {seeds}, the reference of {first.id}",
                 rationale=f"the reference runs the same added seeds as {first.id}: {look}",
                 overrides=dict(ref_root.overrides), reference=True, extends=ref_root.id, confirms=ref_root.confirms,
                 **common),
    ]


def attach(results: list[ExperimentResult], proposals: Sequence[Proposal]) -> list[ExperimentResult]:
    """Each search comparison's latest look onto its first arm's result, every look's verdict in `stages`.

    The first arm's own verdict (the round's fixed-size test) stays the first look; idempotent.
    """
    by_result = {r.proposal_id: r for r in results}
    out = list(results)
    for i, r in enumerate(out):
        p = next((q for q in proposals if q.id == r.proposal_id), None)
        if p is None or p.extends is not None or p.confirms is not None:
            continue
        added = [by_result[q.id].verdict for q in line(p, proposals)[1:] if q.id in by_result]
        added_verdicts: list[Verdict] = [v for v in added if v is not None]
        if not added_verdicts:
            continue
        original = r.stages[0] if r.stages else r.verdict
        looks = [v for v in [original, *added_verdicts] if v is not None]
        out[i] = r.model_copy(update={"verdict": looks[-1], "stages": looks})
    return out
