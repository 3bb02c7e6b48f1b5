"""Baselines that fail (issue 38, item 7): a candidate whose baseline failed every seed is `incomplete`, not
`inconclusive`; the next round runs that baseline again for it (at most `WAITING_ATTEMPTS` arms in all), and
when the baseline is run again every candidate that waited on it is judged again."""

from __future__ import annotations

from researcher.brief.schema import Objective
from researcher.evidence import analysis, baselines, judging
from researcher.records import ExperimentResult, Launch, Proposal

UP = Objective(metric="reward/mean", direction="maximize", window=1)
BASE = {"trainer.lr": 1.0e-5, "trainer.steps": 8}
SEEDS = [0, 1, 2]


def candidate(pid: str, number: int) -> Proposal:
    return Proposal(id=pid, round=number, planner="heuristic", hypothesis="lr up", rationale="r r",
                    expected_effect="e e", overrides={"trainer.lr": 0.03, "trainer.steps": 8})


def ran(pid: str, scores: list[float] | None) -> ExperimentResult:
    """A finished arm with these per-seed scores, or (None) one whose every seed failed after its re-run."""
    if scores is None:
        launches = [Launch(key=f"{pid}-s{s}", proposal_id=pid, seed=s, steps=8, status="failed", attempt=1)
                    for s in SEEDS]
        return analysis.experiment_result(pid, launches, {x.key: analysis.RunScore(None, "exit code 1")
                                                          for x in launches})
    launches = [Launch(key=f"{pid}-s{s}", proposal_id=pid, seed=s, steps=8, status="finished") for s in SEEDS]
    return analysis.experiment_result(pid, launches, {f"{pid}-s{s}": analysis.RunScore(v) for s, v in zip(SEEDS, scores)})


def test_a_candidate_waiting_on_a_failed_baseline_is_judged_again_when_the_baseline_is_rerun() -> None:
    p1 = candidate("r1-1", 1)
    proposals = [p1, *baselines.needed([p1], [], [], BASE, 8, 1)]
    b1 = proposals[-1]
    results = analysis.judge([ran(p1.id, [1.0, 1.2, 1.1]), ran(b1.id, None)], proposals, BASE, 8, UP)
    first = next(r for r in results if r.proposal_id == p1.id).verdict
    assert first is not None and first.result == "incomplete" and first.baseline == b1.id
    assert f"its baseline {b1.id} has no score on any seed" in first.reason
    # The next round runs the baseline again for it, even with nothing new planned.
    rerun = baselines.needed([], proposals, [], BASE, 8, 2, results)
    assert len(rerun) == 1 and rerun[0].overrides == {"trainer.steps": 8} and rerun[0].id.startswith("r2-")
    proposals += rerun
    new = [ran(rerun[0].id, [0.0, 0.1, 0.05])]
    again = judging.waiting(new, results, proposals, BASE, 8)
    assert [r.proposal_id for r in again] == [p1.id]
    judged = analysis.judge([*new, *again], proposals, BASE, 8, UP, known=results)
    verdict = judged[1].verdict
    assert verdict is not None and verdict.baseline == rerun[0].id and verdict.result == "better"


def test_a_baseline_that_fails_every_attempt_leaves_the_candidate_incomplete_and_is_not_run_forever() -> None:
    p1 = candidate("r1-1", 1)
    proposals = [p1, *baselines.needed([p1], [], [], BASE, 8, 1)]
    results = analysis.judge([ran(p1.id, [1.0, 1.2, 1.1]), ran(proposals[-1].id, None)], proposals, BASE, 8, UP)
    for number in range(2, 2 + baselines.WAITING_ATTEMPTS - 1):
        rerun = baselines.needed([], proposals, [], BASE, 8, number, results)
        assert len(rerun) == 1
        proposals += rerun
        new = [ran(rerun[0].id, None)]
        again = judging.waiting(new, results, proposals, BASE, 8)
        judged = {r.proposal_id: r for r in analysis.judge([*new, *again], proposals, BASE, 8, UP, known=results)}
        results = [judged.get(r.proposal_id, r) for r in results] + [judged[rerun[0].id]]
        verdict = judged[p1.id].verdict
        assert verdict is not None and verdict.result == "incomplete" and verdict.baseline == rerun[0].id
    assert baselines.needed([], proposals, [], BASE, 8, 9, results) == []  # tried enough: no round of baselines only


def test_a_candidate_judged_on_a_good_baseline_is_not_judged_again() -> None:
    p1 = candidate("r1-1", 1)
    proposals = [p1, *baselines.needed([p1], [], [], BASE, 8, 1)]
    results = analysis.judge([ran(p1.id, [1.0, 1.2, 1.1]), ran(proposals[-1].id, [0.0, 0.1, 0.05])],
                             proposals, BASE, 8, UP)
    assert baselines.needed([], proposals, [], BASE, 8, 2, results) == []
    assert judging.waiting([ran("r2-9", [0.0])], results, proposals, BASE, 8) == []
