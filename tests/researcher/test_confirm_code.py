"""A code win is confirmed at its own commit: the pick's confirmation arm runs its commit with its
overrides, the baseline the base commit, a chain its last commit; the recommendation names the commit."""

from __future__ import annotations

from pathlib import Path

import pytest

from researcher.brief.schema import Objective
from researcher.evidence import analysis, confirmation
from researcher.records import CodeVersion, Launch, Proposal
from tests.researcher.helpers import make_brief

UP = Objective(metric="reward/mean", direction="maximize", window=2)
BASE = {"trainer.lr": 1.0e-5}


def code(pid: str, patch: bool = True, **kw) -> Proposal:
    return Proposal(id=pid, round=1, planner="person:ada", hypothesis="h h", rationale="r r", expected_effect="e e",
                    patch="--- a/x\n+++ b/x\n" if patch else None, **kw)


def scored(props: list[Proposal], scores: dict[str, list[float]], steps: int = 8, start: int = 0):
    outcomes = {f"{pid}-s{start + s}": analysis.RunScore(v) for pid, vs in scores.items() for s, v in enumerate(vs)}
    return [analysis.experiment_result(p.id, [Launch(key=f"{p.id}-s{start + s}", proposal_id=p.id, seed=start + s,
                                                     steps=steps, status="finished") for s in range(3)], outcomes)
            for p in props if p.id in scores]


@pytest.fixture
def brief(tmp_path: Path):
    return make_brief(tmp_path, "  trainer.lr:\n    kind: choice\n    values: [0.0, 0.03]", "seeds: [0, 1, 2]")


def search(brief, pick: Proposal, extra: list[Proposal] = (), more: dict[str, list[float]] | None = None):
    base = Proposal(id="r1-9", round=1, planner="baseline", hypothesis="the baseline", rationale="r r",
                    expected_effect="e e", overrides={"trainer.steps": 8})
    props = [*extra, pick, base]
    results = analysis.judge(scored(props, {**(more or {}), pick.id: [1.0, 1.2, 1.1], "r1-9": [0.0, 0.1, 0.05]}),
                             props, BASE, 8, UP)
    return props, results


def test_a_code_pick_is_confirmed_at_its_commit_with_its_overrides_and_the_baseline_at_the_base(brief) -> None:
    pick = code("r1-1", overrides={"trainer.lr": 0.03})
    props, results = search(brief, pick)
    versions = {"r1-1": CodeVersion(proposal_id="r1-1", parent_commit="base0", passed=True, commit="c0ffee1")}
    fresh = confirmation.proposals_for(pick, results[0], props, brief, BASE, 8, 2, versions)
    assert fresh[0].commit == "c0ffee1" and fresh[0].overrides == {"trainer.lr": 0.03, "trainer.steps": 8}
    # The baseline runs the base code with the pick's own overrides: only the code differs.
    assert fresh[1].commit is None and fresh[1].overrides == {"trainer.lr": 0.03, "trainer.steps": 8}
    assert analysis.is_reference(fresh[1], BASE) and not analysis.is_baseline(fresh[1], BASE)
    assert analysis.baseline_for(fresh[0], [*props, *fresh], BASE, 8) == fresh[1]
    assert not analysis.is_baseline(fresh[0], BASE)  # a commit is a change, even with no overrides left


def test_a_chain_confirms_the_last_commit(brief) -> None:
    a = code("r1-1")
    b = code("r1-2", parent="r1-1")
    props, results = search(brief, b, [a], {"r1-1": [0.5, 0.55, 0.6]})  # b is better than its parent a as well
    versions = {"r1-1": CodeVersion(proposal_id="r1-1", parent_commit="base0", passed=True, commit="aaaa"),
                "r1-2": CodeVersion(proposal_id="r1-2", parent_commit="aaaa", passed=True, commit="bbbb")}
    pick = confirmation.owed(props, results, 8, brief)
    assert pick is not None and pick.id == "r1-2"
    assert confirmation.proposals_for(pick, results[-2], props, brief, BASE, 8, 2, versions)[0].commit == "bbbb"


def test_a_code_pick_without_a_code_version_is_refused(brief) -> None:
    pick = code("r1-1")
    props, results = search(brief, pick)
    with pytest.raises(ValueError, match="without a valid code version"):
        confirmation.proposals_for(pick, results[0], props, brief, BASE, 8, 2, {})


def test_a_confirmed_code_win_is_recommended_by_its_commit(brief) -> None:
    pick = code("r1-1")
    props, results = search(brief, pick)
    versions = {"r1-1": CodeVersion(proposal_id="r1-1", parent_commit="base0", passed=True, commit="c0ffee1")}
    fresh = confirmation.proposals_for(pick, results[0], props, brief, BASE, 8, 2, versions)
    everyone = [*props, *fresh]
    assert confirmation.recommended(everyone, results, 8, brief) is None  # not confirmed yet
    held = scored(fresh, {"r2-1": [1.0, 1.2, 1.1], "r2-2": [0.0, 0.1, 0.05]}, start=3)
    judged = analysis.judge(held, everyone, BASE, 8, UP, known=results)
    assert judged[0].verdict is not None and judged[0].verdict.baseline == "r2-2"
    final = confirmation.attach([*results, *judged], everyone, BASE)
    assert confirmation.recommended(everyone, final, 8, brief) == (pick, "c0ffee1")
    assert confirmation.conclusion(everyone, final, 8, brief).startswith("recommend r1-1 (code at commit c0ffee1)")
