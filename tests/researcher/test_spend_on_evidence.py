"""Spend the budget on evidence (issue 38, item 8): a promising inconclusive comparison gets a stage whenever one
stage and the confirmation's first look fit in what is left; the confirmation's reserve shrinks, it never blocks
the stage. Simulated runs of a 24-run study through the real judging, stages and confirmation."""

from __future__ import annotations

from pathlib import Path

from researcher.brief.schema import Objective
from researcher.evidence import analysis, confirmation, stages
from researcher.records import ExperimentResult, Launch, Proposal
from tests.researcher.helpers import make_brief

UP = Objective(metric="reward/mean", direction="maximize", window=1)
BASE = {"trainer.lr": 1.0e-5}
FIX, NULL = 0.03, 0.001
EFFECT = 0.10  # the planted fix's real effect
# Per-seed noise of the candidates' runs against the baseline's on the same seed: the fix is better on 3 of 3
# seeds but p = 0.13 after Holm over two candidates (issue 38's new user), and clear once seeds are added.
OWN = {FIX: [0.05, -0.04, -0.01, 0.02, -0.03, 0.01, 0.01, -0.02, 0.015, 0.0, 0.01, -0.01],
       NULL: [0.2, -0.3, 0.05, -0.1, 0.05, -0.2, 0.1, 0.0, -0.05, 0.1, -0.1, 0.05]}
SHARED = [0.3, -0.2, 0.1, 0.25, -0.15, 0.05, -0.1, 0.2, 0.0, -0.05, 0.15, -0.25]  # what a seed does to every arm
RUNS = 24


def arm(pid: str, lr: float) -> Proposal:
    return Proposal(id=pid, round=1, planner="heuristic", hypothesis="h h", rationale="r r", expected_effect="e e",
                    overrides={"trainer.lr": lr, "trainer.steps": 8})


def run(p: Proposal, seeds: list[int]) -> ExperimentResult:
    lr = p.overrides.get("trainer.lr")

    def gain(s: int) -> float:  # a reference runs the base lr: no gain, no noise of a candidate's own
        return (EFFECT if lr == FIX else 0.0) + (OWN[lr][s % 12] if lr in OWN else 0.0)

    launches = [Launch(key=f"{p.id}-s{s}", proposal_id=p.id, seed=s, steps=8, status="finished") for s in seeds]
    return analysis.experiment_result(p.id, launches, {f"{p.id}-s{s}": analysis.RunScore(1.0 + SHARED[s % 12] + gain(s))
                                                       for s in seeds})


def evidence(brief, proposals, results, runs_left: int, number: int):
    """The plan node's `_evidence` after the search, round by round, as in a study: a stage while one is owed,
    else the confirmation while it fits. -> proposals, results, runs left."""
    while True:
        fresh = stages.next_stage(proposals, results, brief, BASE, 8, number, runs_left, 10**9)
        if fresh is None and (pick := confirmation.owed(proposals, results, 8, brief)) is not None:
            result = next(r for r in results if r.proposal_id == pick.id)
            fresh = confirmation.proposals_for(pick, result, proposals, brief, BASE, 8, number,
                                               looks=stages.confirmation_design(brief, runs_left, 10**9, 8))
            if sum(len(p.seeds or []) for p in fresh) > runs_left:
                fresh = None
        if fresh is None:
            return proposals, results, runs_left
        proposals = [*proposals, *fresh]
        runs_left -= sum(len(p.seeds or []) for p in fresh)
        assert runs_left >= 0
        new = analysis.judge([run(p, p.seeds or []) for p in fresh], proposals, BASE, 8, UP, known=results)
        results = stages.attach(confirmation.attach([*results, *new], proposals, BASE), proposals)
        number += 1


def test_a_planted_fix_at_3_seeds_in_a_24_run_study_is_recommended_after_a_stage_and_a_confirmation(
        tmp_path: Path) -> None:
    brief = make_brief(tmp_path, "  trainer.lr:\n    kind: choice\n    values: [0.03, 0.001]",
                       f"seeds: [0, 1, 2]\nbudget: {{max_runs: {RUNS}}}")
    search = [arm("r1-1", FIX), arm("r1-2", NULL), arm("r1-3", 1.0e-5)]
    results = analysis.judge([run(p, [0, 1, 2]) for p in search], search, BASE, 8, UP)
    first = next(r for r in results if r.proposal_id == "r1-1").verdict
    assert first is not None and first.result == "inconclusive" and first.effect > 0  # better on 3 of 3, not decided
    assert first.p_adjusted is not None and 0.05 < first.p_adjusted < 0.2
    proposals, results, left = evidence(brief, search, results, RUNS - 9, 2)
    staged = [p for p in proposals if p.extends == "r1-1"]
    assert len(staged) == 1 and staged[0].looks == [3, 6]  # one stage: what the budget pays beside the confirmation
    fix = next(r for r in results if r.proposal_id == "r1-1")
    assert fix.verdict is not None and fix.verdict.result == "better" and fix.verdict.look == 2
    assert fix.confirmation is not None and fix.confirmation.replicated
    assert confirmation.recommended(proposals, results, 8, brief) is not None
    assert confirmation.conclusion(proposals, results, 8, brief).startswith("recommend r1-1")
    assert left >= 0


def test_no_stage_when_one_stage_and_the_confirmations_first_look_do_not_both_fit(tmp_path: Path) -> None:
    brief = make_brief(tmp_path, "  trainer.lr:\n    kind: choice\n    values: [0.03, 0.001]", "seeds: [0, 1, 2]")
    search = [arm("r1-1", FIX), arm("r1-2", NULL), arm("r1-3", 1.0e-5)]
    results = analysis.judge([run(p, [0, 1, 2]) for p in search], search, BASE, 8, UP)
    assert stages.next_stage(search, results, brief, BASE, 8, 2, 11, 10**9) is None  # 6 + 6 > 11
    fresh = stages.next_stage(search, results, brief, BASE, 8, 2, 12, 10**9)
    assert fresh is not None and fresh[0].looks == [3, 6]


def test_a_comparison_pointing_the_wrong_way_gets_no_stage_whatever_the_budget(tmp_path: Path) -> None:
    brief = make_brief(tmp_path, "  trainer.lr:\n    kind: choice\n    values: [0.03]", "seeds: [0, 1, 2]")
    worse = [arm("r1-1", NULL), arm("r1-3", 1.0e-5)]
    results = analysis.judge([run(p, [0, 1, 2]) for p in worse], worse, BASE, 8, UP)
    verdict = next(r for r in results if r.proposal_id == "r1-1").verdict
    assert verdict is not None and verdict.effect is not None and verdict.effect < 0
    assert stages.next_stage(worse, results, brief, BASE, 8, 2, 10**6, 10**9) is None


def test_when_the_best_comparisons_looks_are_spent_the_next_one_pointing_the_right_way_gets_its_stage(
        tmp_path: Path) -> None:
    brief = make_brief(tmp_path, "  trainer.lr:\n    kind: choice\n    values: [0.03, 0.001]",
                       "seeds: [0, 1, 2]\nreplicate: {max_looks: 2}")
    search = [arm("r1-1", FIX), arm("r1-2", NULL), arm("r1-3", 1.0e-5)]
    # Both candidates inconclusive and pointing up; the larger effect is r1-1's.
    results = analysis.judge([run(p, [0, 1, 2]) for p in search], search, BASE, 8, UP)
    results = [r.model_copy(update={"verdict": r.verdict.model_copy(update={"result": "inconclusive", "effect": e})})
               if r.verdict else r for r, e in zip(results, (0.3, 0.1, None))]
    first = stages.next_stage(search, results, brief, BASE, 8, 2, 10**6, 10**9)
    assert first is not None and first[0].extends == "r1-1" and first[0].looks == [3, 6]
    # Its one planned stage ran and stayed inconclusive (its looks are spent): r1-2's turn, not the end.
    proposals = [*search, *first]
    staged = [analysis.experiment_result(p.id, [], {}).model_copy(update={"status": "ok"}) for p in first]
    after = stages.attach([*results, *staged], proposals)
    after = [r.model_copy(update={"verdict": r.verdict.model_copy(update={"result": "inconclusive", "look": 2})})
             if r.proposal_id == "r1-1" and r.verdict else r for r in after]
    second = stages.next_stage(proposals, after, brief, BASE, 8, 3, 10**6, 10**9)
    assert second is not None and second[0].extends == "r1-2"
