"""Chains (issue 38, item 5): a chained proposal is recommended only if it is better than its parent as well as
the base; otherwise the study recommends the parent, and its conclusion says why the child's addition was not
kept. Simulated runs through the real judging, confirmation and conclusion."""

from __future__ import annotations

from pathlib import Path

from researcher.brief.schema import Objective
from researcher.evidence import analysis, baselines, confirmation
from researcher.records import ExperimentResult, Launch, Proposal
from tests.researcher.helpers import make_brief

UP = Objective(metric="reward/mean", direction="maximize", window=1)
BASE = {"trainer.lr": 1.0e-5, "trainer.steps": 8}
# Per-seed noise shared by the arms of one seed (same seed, same start), and a little of each arm's own.
SHARED = [0.0, 0.4, -0.3, 0.2, -0.1, 0.3, -0.2, 0.1]
OWN = {"fix": [0.02, -0.03, 0.01, 0.0, 0.02, -0.01, 0.03, -0.02],
       "child": [0.35, -0.1, 0.05, 0.3, -0.2, 0.25, 0.0, 0.1]}  # no effect of its own, but a noisy look above its parent


def code(pid: str, number: int, **kw) -> Proposal:
    return Proposal(id=pid, round=number, planner="person:ada", hypothesis="my patch helps", rationale="r r",
                    expected_effect="e e", patch="--- a/x\n+++ b/x\n", commit=f"{pid}0000", **kw)


def run(p: Proposal, seeds: list[int], gains: dict[str, float]) -> ExperimentResult:
    """Scores of one arm: 1.0, plus the real fix's +1.0 in any arm that runs its code, plus the shared noise."""
    launches = [Launch(key=f"{p.id}-s{s}", proposal_id=p.id, seed=s, steps=8, status="finished") for s in seeds]
    gain = gains.get(p.parent if p.reference else p.id, 0.0)
    own = OWN.get(p.id if not p.reference else "", [0.0] * len(SHARED))
    return analysis.experiment_result(p.id, launches, {f"{p.id}-s{s}": analysis.RunScore(
        1.0 + gain + SHARED[s % len(SHARED)] + own[s % len(own)]) for s in seeds})


def test_a_chained_no_effect_child_of_a_real_fix_is_not_recommended_over_its_parent(tmp_path: Path) -> None:
    brief = make_brief(tmp_path, "  trainer.lr:\n    kind: choice\n    values: [0.03]", "seeds: [0, 1, 2, 3]")
    gains = {"fix": 1.0, "child": 1.0}  # the child carries the fix's code and adds nothing real
    fix = code("fix", 1, overrides={"trainer.steps": 8})
    child = code("child", 1, parent="fix", overrides={"trainer.steps": 8})
    proposals = [fix, child, *baselines.needed([fix, child], [], [], BASE, 8, 1)]
    seeds = [0, 1, 2, 3]
    results = analysis.judge([run(p, seeds, gains) for p in proposals], proposals, BASE, 8, UP)
    by_id = {r.proposal_id: r for r in results}
    assert by_id["child"].verdict is not None and by_id["child"].verdict.result == "better"  # against the base
    assert by_id["fix"].verdict is not None and by_id["fix"].verdict.result == "better"
    assert by_id["child"].verdict.effect > by_id["fix"].verdict.effect  # the child looks bigger than its parent
    assert by_id["child"].parent_verdict is not None and by_id["child"].parent_verdict.result == "inconclusive"
    # The confirmation is owed to the parent, not to the child that rode on it.
    pick = confirmation.owed(proposals, results, 8, brief)
    assert pick is not None and pick.id == "fix"
    fresh = confirmation.proposals_for(pick, by_id["fix"], proposals, brief, BASE, 8, 2)
    proposals += fresh
    new = analysis.judge([run(p, p.seeds or [], {**gains, "r2-1": 1.0}) for p in fresh], proposals, BASE, 8, UP,
                         known=results)
    results = confirmation.attach([*results, *new], proposals, BASE)
    recommended = confirmation.recommended(proposals, results, 8, brief)
    assert recommended is not None and recommended[0].id == "fix" and recommended[1] == "fix0000"
    said = confirmation.conclusion(proposals, results, 8, brief)
    assert said.startswith("recommend fix")
    assert "child was judged better than the baseline but not better than its parent fix" in said
    assert "its addition to fix was not kept" in said


def test_a_child_better_than_its_parent_too_is_the_pick(tmp_path: Path) -> None:
    brief = make_brief(tmp_path, "  trainer.lr:\n    kind: choice\n    values: [0.03]", "seeds: [0, 1, 2, 3]")
    gains = {"fix": 1.0, "child": 2.0}  # the child's addition is real: +1.0 over its parent
    fix = code("fix", 1, overrides={"trainer.steps": 8})
    child = code("child", 1, parent="fix", overrides={"trainer.steps": 8})
    proposals = [fix, child, *baselines.needed([fix, child], [], [], BASE, 8, 1)]
    results = analysis.judge([run(p, [0, 1, 2, 3], gains) for p in proposals], proposals, BASE, 8, UP)
    pick = confirmation.owed(proposals, results, 8, brief)
    assert pick is not None and pick.id == "child"
    assert confirmation.not_kept(proposals, results, 8) == []


def test_a_child_never_compared_with_its_parent_is_not_recommended_and_the_conclusion_says_so(tmp_path: Path) -> None:
    brief = make_brief(tmp_path, "  trainer.lr:\n    kind: choice\n    values: [0.03]", "seeds: [0, 1, 2, 3]")
    child = code("child", 2, parent="fix", overrides={"trainer.steps": 8})
    fix = code("fix", 1, overrides={"trainer.steps": 8}, seeds=[9, 10])  # ran other seeds: no parent arm to pair
    proposals = [fix, child, *baselines.needed([child], [fix], [], BASE, 8, 2)]
    parent_arm = next(p for p in proposals if p.reference and p.parent == "fix")
    ran = [run(p, [0, 1, 2, 3], {"child": 1.0}) for p in proposals if p.id not in ("fix", parent_arm.id)]
    results = analysis.judge(ran, proposals, BASE, 8, UP)
    assert next(r for r in results if r.proposal_id == "child").verdict.result == "better"
    assert confirmation.owed(proposals, results, 8, brief) is None
    said = confirmation.conclusion(proposals, results, 8, brief)
    assert said.startswith("nothing to recommend: child was judged better than the baseline but not better than its "
                           "parent fix (never compared with it")
