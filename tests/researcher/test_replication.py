"""Replication that adapts (issue 31, item 6): an inconclusive search pick or confirmation gets held-out seeds
in stages, each look judged at its group-sequential level, until it decides or the budget is spent."""

from __future__ import annotations

from pathlib import Path

import pytest

from researcher.brief.schema import Objective
from researcher.evidence import analysis, confirmation, sequential, stages
from researcher.records import ExperimentResult, Launch, Proposal
from tests.researcher.helpers import make_brief

UP = Objective(metric="reward/mean", direction="maximize", window=1)
BASE = {"trainer.lr": 1.0e-5}
# Per-seed noise of the paired differences: a +1.0 effect with this spread is p ~ 0.07 on 3 seeds (one look
# at a fixed 5% test would end "not recommended"), and decided well before 12.
NOISE = [0.6, -0.5, 0.3, -0.2, 0.5, -0.4, 0.1, 0.2, -0.3, 0.4, -0.1, 0.0, 0.3, -0.2, 0.1]


def arm(pid: str, lr: float, **kw) -> Proposal:
    return Proposal(id=pid, round=1, planner="heuristic", hypothesis="h h", rationale="r r", expected_effect="e e",
                    overrides={"trainer.lr": lr, "trainer.steps": 8}, **kw)


def run(p: Proposal, seeds: list[int], effect: float) -> ExperimentResult:
    gain = effect if p.overrides.get("trainer.lr") == 0.03 else 0.0
    launches = [Launch(key=f"{p.id}-s{s}", proposal_id=p.id, seed=s, steps=8, status="finished") for s in seeds]
    outcomes = {f"{p.id}-s{s}": analysis.RunScore(1.0 + gain + (NOISE[s % len(NOISE)] if gain else 0.0))
                for s in seeds}
    return analysis.experiment_result(p.id, launches, outcomes)


def study(tmp_path: Path, effect: float, budget_runs: int = 10**6, extra: str = ""):
    """A search of one candidate against the baseline on 3 seeds, then stages and the confirmation as the plan
    node runs them; -> proposals, results, rounds."""
    brief = make_brief(tmp_path, "  trainer.lr:\n    kind: choice\n    values: [0.03]",
                       "seeds: [0, 1, 2]" + extra)
    proposals = [arm("r1-1", 1.0e-5), arm("r1-2", 0.03)]
    results = analysis.judge([run(p, [0, 1, 2], effect) for p in proposals], proposals, BASE, 8, UP)
    runs_left, number = budget_runs - 6, 2
    while True:
        fresh = stages.next_stage(proposals, results, brief, BASE, 8, number, runs_left, 10**9)
        if fresh is None and (pick := confirmation.owed(proposals, results, 8, brief)) is not None:
            looks = stages.confirmation_design(brief, runs_left, 10**9, 8)
            result = next(r for r in results if r.proposal_id == pick.id)
            fresh = confirmation.proposals_for(pick, result, proposals, brief, BASE, 8, number, looks=looks)
            if runs_left < 6:
                fresh = None
        if fresh is None:
            return brief, proposals, results, number - 1
        proposals += fresh
        runs_left -= sum(len(p.seeds or []) for p in fresh)
        new = analysis.judge([run(p, p.seeds or [], effect) for p in fresh], proposals, BASE, 8, UP, known=results)
        results = stages.attach(confirmation.attach([*results, *new], proposals, BASE), proposals)
        number += 1


def test_an_inconclusive_search_and_confirmation_add_seeds_in_stages_until_decided(tmp_path: Path) -> None:
    brief, proposals, results, rounds = study(tmp_path, effect=1.0)
    by_id = {r.proposal_id: r for r in results}
    search = by_id["r1-2"]
    assert search.stages and search.stages[0].look is None  # the round's fixed-size test was its first look
    assert search.stages[0].result == "inconclusive" and search.verdict is not None
    assert search.verdict.result == "better" and search.verdict.look is not None and search.verdict.look >= 2
    staged = [p for p in proposals if p.extends == "r1-2"]
    assert staged and all(p.planner == "replication" and p.looks == [3, 6, 9, 12] for p in staged)
    # The staged seeds are new: never the search's 0-2, and the reference ran the same ones.
    for p in staged:
        ref = next(q for q in proposals if q.extends == "r1-1" and q.stage == p.stage)
        assert p.seeds == ref.seeds and not set(p.seeds or []) & {0, 1, 2} and ref.reference
    conf = search.confirmation
    assert conf is not None and conf.replicated and conf.stages and len(conf.stages) == conf.verdict.look
    assert conf.stages[0].result == "inconclusive" and conf.stages[0].level is not None
    assert conf.stages[0].level < 0.001  # O'Brien–Fleming: almost nothing spent at the first look
    held = [s for p in proposals if p.confirms for s in (p.seeds or [])]
    searched = [s for p in proposals if not p.confirms for s in (p.seeds or [])]
    assert not set(held) & set(searched)  # held out from everything the search used
    assert confirmation.recommended(proposals, results, 8, brief) is not None
    text = conf.fmt()
    assert "look" in text and "of 4 at nominal p <" in text


def test_a_decided_look_adds_nothing_and_a_null_change_is_not_kept(tmp_path: Path) -> None:
    _, proposals, results, _ = study(tmp_path, effect=0.0)
    assert not any(p.confirms for p in proposals)  # never better, never confirmed
    verdict = {r.proposal_id: r for r in results}["r1-2"].verdict
    assert verdict is not None and verdict.result != "better"
    _, big, _, _ = study(tmp_path, effect=5.0)  # decided by the search's own look: no stage
    assert not any(p.extends for p in big if not p.confirms)


def test_the_budget_caps_the_looks_and_a_stage_it_cannot_pay_is_not_planned(tmp_path: Path) -> None:
    brief = make_brief(tmp_path, "  trainer.lr:\n    kind: choice\n    values: [0.03]", "seeds: [0, 1, 2]")
    assert stages.confirmation_design(brief, 6, 10**9, 8) is None  # only the first look fits: a fixed test
    assert stages.confirmation_design(brief, 12, 10**9, 8) == [3, 6]
    assert stages.confirmation_design(brief, 10**6, 10**9, 8) == [3, 6, 9, 12]  # replicate.max_looks
    assert stages.confirmation_design(brief, 10**6, 12 * 8, 8) == [3, 6]  # trainer steps bind too
    off = make_brief(tmp_path, "  trainer.lr:\n    kind: choice\n    values: [0.03]",
                     "seeds: [0, 1, 2]\nreplicate: {enabled: false}")
    assert stages.confirmation_design(off, 10**6, 10**9, 8) is None
    _, proposals, _, _ = study(tmp_path, effect=1.0, budget_runs=14)  # the search's stages leave the reserve
    assert not [p for p in proposals if p.extends and not p.confirms]
    with pytest.raises(ValueError):
        sequential.nominal_levels((0, 3), 0.05, "pocock")
