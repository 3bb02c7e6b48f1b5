"""The baseline rule: every judged proposal has a reference arm that differs from it only in what it tests.

A verdict compares a candidate with the arm `matching.baseline_for` gives it: the base config at the
base code for a config change; the base code *with the proposal's own overrides* for a code change
(only the code differs); trained as long on the same seeds. A chained code proposal (`parent: A`)
is also judged against A's code with its overrides (`matching.parent_reference_for`): A itself when
A ran that config, else an arm this rule adds (planner `baseline`, `parent: A`, run at A's commit).

This module says which reference arms a round still needs: one per (steps, seeds, config, code) that
its proposals use and no usable earlier arm covers, so each is run once and reused. An earlier arm
is not usable when it was vetoed, or when it ended failed or lost seeds (a partial baseline): the
next round that needs it runs it again, within the budget (`prepare` skips what the budget cannot pay).
The plan node adds them to the round, and the review node approves them by policy: a reference
changes nothing a person has not approved (a parent's reference runs code its child already holds).
Pure functions over the study's records; this module launches, scores and judges nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from researcher.evidence.matching import (
    BASELINE_PLANNER,
    at_base_code,
    changed,
    is_reference,
    key,
    parent_reference_for,
    reference_config,
    runs_code,
    steps_of,
)
from researcher.records import Decision, ExperimentResult, Proposal

REASON = "the study's baseline (base config at the base commit): approved by the study's baseline rule"
# Arms of one reference a study runs for candidates of earlier rounds that wait on it (the first and one
# more): a baseline that fails every seed twice is a broken setup, not bad luck, and rounds of nothing but
# baselines would otherwise spend the budget on it. Those candidates stay `incomplete` and say why.
WAITING_ATTEMPTS = 2

# (steps, seeds, config key, parent id or None): what one reference arm runs.
Need = tuple[int, tuple[int, ...] | None, str, str | None]


def _seeds(p: Proposal) -> tuple[int, ...] | None:
    return tuple(p.seeds) if p.seeds is not None else None


def _usable(q: Proposal, vetoed: set[str], results: dict[str, ExperimentResult]) -> bool:
    """Not vetoed, and not ended failed or partial: a baseline that lost seeds is run again, not reused."""
    r = results.get(q.id)
    return q.id not in vetoed and (r is None or (r.status == "ok" and not r.failed_seeds))


def needed(fresh: Sequence[Proposal], earlier: Sequence[Proposal], decisions: Sequence[Decision],
           base_values: dict[str, Any], default_steps: int, number: int,
           results: Sequence[ExperimentResult] = ()) -> list[Proposal]:
    """Reference arms to add to round `number` so every proposal in `fresh` has its own (none already there),
    and so does every earlier candidate still waiting on a baseline that failed every seed (`_waiting`).

    Hot swaps are judged inside the live run, not against runs, and need none; confirmation rounds and
    replication stages bring their own references.
    """
    vetoed = {d.proposal_id for d in decisions if d.verdict == "vetoed"}
    done = {r.proposal_id: r for r in results}
    every = [*earlier, *fresh]
    have: set[Need] = set()
    for q in every:
        if not _usable(q, vetoed, done):
            continue
        if at_base_code(q):
            have.add((steps_of(q, default_steps), _seeds(q), key(changed(q, base_values)), None))
        elif q.reference and q.parent is not None:
            have.add((steps_of(q, default_steps), _seeds(q), key(changed(q, base_values)), q.parent))
    wanted: dict[Need, dict[str, object]] = {}
    for p in [*fresh, *_waiting(earlier, done, base_values, default_steps)]:
        if is_reference(p, base_values) or p.mode == "hot_swap" or p.confirms or p.extends:
            continue
        runs = (steps_of(p, default_steps), _seeds(p))
        config = reference_config(p, base_values)
        wanted.setdefault((*runs, key(config), None), config)
        if p.parent is not None and runs_code(p):
            parent = next((q for q in every if q.id == p.parent), None)
            if parent is not None and parent_reference_for(p, [parent], base_values, default_steps) is None:
                wanted.setdefault((*runs, key(changed(p, base_values)), p.parent), changed(p, base_values))
    taken = {p.id for p in every}
    out: list[Proposal] = []
    index = len([p for p in fresh if p.round == number])
    for need, config in wanted.items():
        if need in have:
            continue
        steps, seeds, _, parent = need
        index += 1
        while f"r{number}-{index}" in taken:
            index += 1
        on = f"seeds {list(seeds)}" if seeds is not None else "the brief's seeds"
        what = ", ".join(f"{k}={v}" for k, v in sorted(config.items()))
        code = f"the code of {parent}" if parent else "the base commit"
        out.append(Proposal(
            id=f"r{number}-{index}", round=number, planner=BASELINE_PLANNER, seeds=list(seeds) if seeds else None,
            hypothesis=(f"the reference: {code}" + (f" with {what}" if what else " with the base config")),
            rationale=(f"every judged proposal is compared with an arm that differs from it only in what it tests, "
                       f"trained {steps} steps on {on}"),
            expected_effect="the reference the proposals of this length, seeds and config are judged against",
            overrides={**config, "trainer.steps": steps}, priority=1, reference=True, parent=parent))
    return out


def _waiting(earlier: Sequence[Proposal], done: dict[str, ExperimentResult], base_values: dict[str, Any],
             default_steps: int) -> list[Proposal]:
    """Earlier candidates judged while their baseline had no score on any seed (`judging._baseline_failed`),
    whose baseline has been tried fewer than `WAITING_ATTEMPTS` times: the next round runs it again for them."""
    out = []
    for p in earlier:
        r = done.get(p.id)
        if r is None or r.verdict is None or r.verdict.result != "incomplete" or is_reference(p, base_values):
            continue
        base = next((q for q in earlier if q.id == r.verdict.baseline), None)
        if base is None or done.get(base.id) is None or done[base.id].status != "failed":
            continue
        need = (steps_of(base, default_steps), _seeds(base), key(changed(base, base_values)))
        tried = [q for q in earlier if at_base_code(q)
                 and (steps_of(q, default_steps), _seeds(q), key(changed(q, base_values))) == need]
        if len(tried) < WAITING_ATTEMPTS:
            out.append(p)
    return out


def is_rule_baseline(p: Proposal) -> bool:
    """A baseline the rule added (approved by policy, never put to a person)."""
    return p.planner == BASELINE_PLANNER


# The planner name of replication stages (researcher.evidence.stages): more seeds of arms already approved.
STAGE_PLANNER = "replication"
STAGE_REASON = ("a replication stage: more seeds of arms already approved and run, approved by the study's "
                "replication rule")


def policy_reason(p: Proposal) -> str | None:
    """Why the study approves `p` itself (within budget), or None when its policy or a person decides."""
    if is_rule_baseline(p):
        return REASON
    if p.planner == STAGE_PLANNER:
        return STAGE_REASON
    return None
