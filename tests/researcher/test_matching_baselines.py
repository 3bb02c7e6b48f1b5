"""Baselines that match (issue 31, item 3): only the code differs between a code proposal and its reference;
a chained proposal is judged against its parent too; a failed or partial baseline is run again before
anything is judged against it; a paired test uses the seeds both arms finished."""

from __future__ import annotations

from researcher.brief.schema import Objective
from researcher.evidence import analysis, baselines, decision
from researcher.evidence.matching import parent_reference_for
from researcher.records import Decision, ExperimentResult, Launch, Proposal

UP = Objective(metric="reward/mean", direction="maximize", window=2)
BASE = {"trainer.lr": 1.0e-5, "trainer.steps": 8}


def person(pid: str, number: int = 1, patch: bool = True, **kw) -> Proposal:
    return Proposal(id=pid, round=number, planner="person:ada", hypothesis="my patch helps", rationale="r r",
                    expected_effect="e e", patch="--- a/x\n+++ b/x\n" if patch else None, **kw)


def result(pid: str, scores: dict[int, float], failed: dict[int, str] | None = None) -> ExperimentResult:
    launches = [Launch(key=f"{pid}-s{s}", proposal_id=pid, seed=s, steps=8, status="finished")
                for s in [*scores, *(failed or {})]]
    outcomes = {f"{pid}-s{s}": analysis.RunScore(v) for s, v in scores.items()}
    outcomes |= {f"{pid}-s{s}": analysis.RunScore(None, why) for s, why in (failed or {}).items()}
    launches = [x if x.seed in scores else x.model_copy(update={"status": "failed", "attempt": 1}) for x in launches]
    return analysis.experiment_result(pid, launches, outcomes)


def test_a_code_proposal_with_overrides_gets_a_baseline_with_the_same_overrides_at_the_base_code() -> None:
    patch = person("p1", overrides={"trainer.lr": 0.03})
    added = baselines.needed([patch], [], [], BASE, 8, 1)
    assert [b.overrides for b in added] == [{"trainer.lr": 0.03, "trainer.steps": 8}]
    ref = added[0]
    assert ref.reference and ref.commit is None and ref.parent is None and analysis.is_reference(ref, BASE)
    plain = Proposal(id="r1-9", round=1, planner="baseline", hypothesis="the baseline", rationale="r r",
                     expected_effect="e e", overrides={"trainer.steps": 8})
    everyone = [plain, patch, *added]
    assert analysis.baseline_for(patch, everyone, BASE, 8) == ref  # never the base lr's arm
    judged = analysis.judge([result("p1", {0: 1.0, 1: 1.1, 2: 1.2}), result(ref.id, {0: 0.9, 1: 1.0, 2: 1.1}),
                             result("r1-9", {0: 0.0, 1: 0.1, 2: 0.2})], everyone, BASE, 8, UP)
    verdict = judged[0].verdict
    assert verdict is not None and verdict.baseline == ref.id  # +0.1 over lr 0.03 at the base code, not +1.0
    assert abs((verdict.effect or 0) - 0.1) < 1e-9
    # A config proposal of the same lr at the base code serves as that reference: nothing more to run.
    config = Proposal(id="r1-1", round=1, planner="heuristic", hypothesis="lr up", rationale="r r",
                      expected_effect="e e", overrides={"trainer.lr": 0.03, "trainer.steps": 8})
    assert baselines.needed([person("p2", overrides={"trainer.lr": 0.03})], [config, plain], [], BASE, 8, 1) == []


def test_a_chained_proposal_is_also_judged_against_its_parent() -> None:
    parent = person("p1")
    child = person("p2", parent="p1", overrides={"trainer.lr": 0.03})
    added = baselines.needed([parent, child], [], [], BASE, 8, 1)
    # the base code with p1's config and with the child's, and p1's code with the child's config
    assert sorted((b.parent or "", sorted(b.overrides.items())) for b in added) == [
        ("", [("trainer.lr", 0.03), ("trainer.steps", 8)]), ("", [("trainer.steps", 8)]),
        ("p1", [("trainer.lr", 0.03), ("trainer.steps", 8)])]
    assert all(b.reference for b in added)
    ref = next(b for b in added if b.parent == "p1")
    base_of_child = next(b for b in added if b.parent is None and "trainer.lr" in b.overrides)
    everyone = [parent, child, *added]
    assert parent_reference_for(child, everyone, BASE, 8) == ref
    assert analysis.baseline_for(child, everyone, BASE, 8) == base_of_child
    batch = [result("p2", {0: 2.0, 1: 2.1, 2: 2.3}), result(ref.id, {0: 1.9, 1: 2.05, 2: 2.1}),
             result(base_of_child.id, {0: 0.0, 1: 0.1, 2: 0.2})]
    judged = {r.proposal_id: r for r in analysis.judge(batch, everyone, BASE, 8, UP)}
    assert judged["p2"].verdict is not None and judged["p2"].verdict.result == "better"  # against the base code
    against_parent = judged["p2"].parent_verdict
    assert against_parent is not None and against_parent.baseline == ref.id and against_parent.result != "better"
    assert judged[ref.id].verdict is None  # a reference is never judged itself
    # A parent that ran the child's config, steps and seeds is the reference itself: nothing added for it.
    same = person("p3", parent="p1")
    assert [b.parent for b in baselines.needed([same], [parent], [], BASE, 8, 2)] == [None]
    assert parent_reference_for(same, [parent, same], BASE, 8) == parent


def test_a_failed_or_partial_baseline_is_not_reused_and_is_run_again() -> None:
    first = [person("p1")]
    earlier = [*first, *baselines.needed(first, [], [], BASE, 8, 1)]
    base_id = earlier[-1].id
    later = [person("p2", number=2)]
    ok = result(base_id, {0: 0.1, 1: 0.2, 2: 0.3})
    assert baselines.needed(later, earlier, [], BASE, 8, 2, [ok]) == []  # a whole baseline is reused
    partial = result(base_id, {0: 0.1, 1: 0.2}, failed={2: "failed twice; last: exit code 1"})
    again = baselines.needed(later, earlier, [], BASE, 8, 2, [partial])
    assert len(again) == 1 and again[0].id.startswith("r2-") and again[0].overrides == {"trainer.steps": 8}
    failed = ExperimentResult(proposal_id=base_id, status="failed", note="every seed crashed")
    assert len(baselines.needed(later, earlier, [], BASE, 8, 2, [failed])) == 1
    vetoed = [Decision(proposal_id=base_id, verdict="vetoed", by="ada")]
    assert len(baselines.needed(later, earlier, vetoed, BASE, 8, 2, [ok])) == 1


def test_a_reference_seed_that_failed_its_rerun_gets_one_fresh_retry_before_the_verdict() -> None:
    crashed = [Launch(key="r1-2-s0", proposal_id="r1-2", seed=0, steps=8, status="failed", reason="exit code 1"),
               Launch(key="r1-2-s0-rerun", proposal_id="r1-2", seed=0, steps=8, status="failed", reason="exit code 1",
                      attempt=1, resumes="r1-2-s0")]
    outcomes = {x.key: analysis.RunScore(None, "failed: exit code 1") for x in crashed}
    _, failed, reruns = analysis.seed_table(crashed, outcomes)
    assert not reruns and failed[0].startswith("failed twice")  # a candidate's seed: done after its re-run
    _, _, retry = analysis.seed_table(crashed, outcomes, reference=True)
    assert [(x.key, x.attempt, x.resumes) for x in retry] == [("r1-2-s0-retry", 2, "")]  # fresh, not resumed
    third = [*crashed, retry[0].model_copy(update={"status": "failed", "reason": "exit code 1"})]
    _, failed, more = analysis.seed_table(third, {**outcomes, "r1-2-s0-retry": analysis.RunScore(None, "failed")},
                                          reference=True)
    assert not more and failed[0].startswith("failed three times")
    diverged = [crashed[0].model_copy(update={"status": "stopped", "reason": "divergence: loss = nan"})]
    assert analysis.seed_table(diverged, {}, reference=True)[2] == []  # what repeats is not retried


def test_a_partial_baseline_is_paired_on_the_seeds_both_finished_not_welch() -> None:
    candidate = {0: 1.0, 1: 1.2, 2: 1.1, 3: 1.3}
    baseline = {0: 0.0, 1: 0.1, 3: 0.2}  # seed 2 lost
    v = decision.compare(candidate, baseline, "maximize")
    assert v.test == decision.PAIRED and (v.n, v.n_baseline) == (3, 3)
    assert abs((v.effect or 0) - (1.0 + 1.1 + 1.1) / 3) < 1e-9  # the differences on seeds 0, 1, 3
    disjoint = decision.compare({0: 1.0, 1: 1.2}, {5: 0.0, 6: 0.1}, "maximize")
    assert disjoint.test == decision.WELCH  # nothing to pair: the unpaired test, said so
