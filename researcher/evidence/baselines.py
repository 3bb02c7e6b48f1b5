"""The baseline rule: every judged proposal has a baseline arm, whatever the planner.

A verdict compares a candidate with the base config at the base commit, trained as long on the
same seeds (`analysis.baseline_for`). This module says which baselines a round still needs: one
per (steps, seeds) that its proposals use and no earlier baseline covers, so each baseline is run
once and reused by every later proposal of the same length and seeds. The plan node adds them to
the round (planner `baseline`), and the review node approves them by policy: a baseline changes
nothing, so there is nothing for a person to judge. Pure functions over the study's records; this
module launches, scores and judges nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from researcher.evidence.analysis import is_baseline
from researcher.records import Decision, Proposal

BASELINE_PLANNER = "baseline"
REASON = "the study's baseline (base config at the base commit): approved by the study's baseline rule"


def _key(p: Proposal, default_steps: int) -> tuple[int, tuple[int, ...] | None]:
    return int(p.overrides.get("trainer.steps", default_steps)), tuple(p.seeds) if p.seeds is not None else None


def needed(fresh: Sequence[Proposal], earlier: Sequence[Proposal], decisions: Sequence[Decision],
           base_values: dict[str, Any], default_steps: int, number: int) -> list[Proposal]:
    """Baselines to add to round `number` so every proposal in `fresh` has one (none already there).

    An earlier baseline of the same steps and seeds is reused unless it was vetoed. Hot swaps are
    judged inside the live run, not against runs, and need none.
    """
    vetoed = {d.proposal_id for d in decisions if d.verdict == "vetoed"}
    have = {_key(p, default_steps) for p in [*earlier, *fresh] if is_baseline(p, base_values) and p.id not in vetoed}
    wanted: dict[tuple[int, tuple[int, ...] | None], None] = {}
    for p in fresh:
        if is_baseline(p, base_values) or p.mode == "hot_swap":
            continue
        key = _key(p, default_steps)
        if key not in have:
            wanted.setdefault(key)
    taken = {p.id for p in [*earlier, *fresh]}
    out: list[Proposal] = []
    index = len([p for p in fresh if p.round == number])
    for steps, seeds in wanted:
        index += 1
        while f"r{number}-{index}" in taken:
            index += 1
        on = f"seeds {list(seeds)}" if seeds is not None else "the brief's seeds"
        out.append(Proposal(
            id=f"r{number}-{index}", round=number, planner=BASELINE_PLANNER, seeds=list(seeds) if seeds else None,
            hypothesis="the baseline: the base config at the base commit, as the reference",
            rationale=f"every judged proposal is compared with the baseline trained {steps} steps on {on}",
            expected_effect="the reference the candidates of this length and seeds are judged against",
            overrides={"trainer.steps": steps}, priority=1))
    return out


def is_rule_baseline(p: Proposal) -> bool:
    """A baseline the rule added (approved by policy, never put to a person)."""
    return p.planner == BASELINE_PLANNER
