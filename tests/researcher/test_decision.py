"""The decision rule on known scores: better, worse, inconclusive, one seed, failed seeds, early stops."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from researcher.brief.schema import Objective
from researcher.evidence import analysis, confirmation, decision
from researcher.evidence.decision import (
    Candidate,
    Verdict,
    compare,
    confirm,
    held_out_seeds,
    holm,
    judge_round,
    recommend,
)
from researcher.records import Launch, Proposal
from tests.researcher.helpers import make_brief

UP = Objective(metric="reward/mean", direction="maximize", window=2)


def seeds(*values: float, start: int = 0) -> dict[int, float]:
    return {start + i: v for i, v in enumerate(values)}


def test_paired_t_test_matches_the_textbook_numbers() -> None:
    # differences 1, 2, 3: mean 2, sd 1, t = 2 / (1 / sqrt 3) = 3.464 on 2 dof -> p = 0.0742,
    # CI 2 ± 4.303 / sqrt 3 = [-0.484, 4.484]: not significant with three seeds
    v = compare(seeds(1.0, 2.0, 3.0), seeds(0.0, 0.0, 0.0), "maximize")
    assert v.test == decision.PAIRED and v.effect == pytest.approx(2.0)
    assert v.p == pytest.approx(0.0742, abs=1e-4)
    assert v.ci == pytest.approx([-0.484, 4.484], abs=1e-3)
    assert v.result == "inconclusive" and "p=0.0742" in v.reason


def test_a_consistent_gain_is_better_and_the_reverse_is_worse() -> None:
    cand, base = seeds(1.0, 1.2, 1.1, 1.3), seeds(0.0, 0.1, 0.05, 0.2)
    better = compare(cand, base, "maximize", baseline_id="r1-1")
    assert better.result == "better" and better.p is not None and better.p < 0.05
    assert better.ci is not None and 0 < better.ci[0] < better.effect < better.ci[1]  # type: ignore[operator]
    assert better.json_view() == {"result": "better", "test": "paired t-test", "effect": better.effect,
                              "ci": better.ci, "p": better.p}
    worse = compare(base, cand, "maximize")
    assert worse.result == "worse" and worse.effect == pytest.approx(-better.effect)  # type: ignore[operator]
    assert compare(base, cand, "minimize").result == "better"  # lower loss wins when minimising


def test_noise_larger_than_the_effect_is_inconclusive() -> None:
    v = compare(seeds(0.5, 0.9, 0.2, 0.7), seeds(0.6, 0.3, 0.8, 0.4), "maximize")
    assert v.result == "inconclusive" and v.p is not None and v.p > 0.05
    assert v.ci is not None and v.ci[0] < 0 < v.ci[1]


def test_one_seed_is_never_better_however_large_the_gain() -> None:
    v = compare(seeds(100.0), seeds(0.0, 0.1), "maximize")
    assert v.result == "inconclusive" and v.test == decision.NO_TEST and v.p is None
    assert "the candidate has 1 finished seed" in v.reason and "at least 2" in v.reason
    assert v.effect == pytest.approx(99.95)
    nan_seed = compare({0: 5.0, 1: math.nan}, seeds(0.0, 0.1), "maximize")  # NaN is not a finished seed
    assert nan_seed.result == "inconclusive" and nan_seed.n == 1


def test_unpaired_seeds_use_welch() -> None:
    v = compare(seeds(1.0, 1.2, 1.1), seeds(0.0, 0.1, 0.05, 0.2, 0.1, start=10), "maximize")
    assert v.test == decision.WELCH and v.result == "better" and (v.n, v.n_baseline) == (3, 5)


def test_scores_without_variance_cannot_be_judged() -> None:
    # a constant offset on two seeds would give t = inf and p = 0 from a naive t-test
    v = compare(seeds(1.0, 2.0), seeds(0.0, 1.0), "maximize")
    assert v.result == "inconclusive" and "cannot estimate noise" in v.reason and v.effect == 1.0


def test_holm_controls_the_round_not_each_candidate() -> None:
    raw = {k: Verdict(result="better", test=decision.PAIRED, effect=1.0, ci=[0.1, 2.0], p=p)
           for k, p in {"a": 0.01, "b": 0.04, "c": 0.03}.items()}
    out = holm(raw, "maximize")
    # step-down: 3 x 0.01 = 0.03; max(0.03, 2 x 0.03) = 0.06; max(0.06, 1 x 0.04) = 0.06
    assert out["a"].p_adjusted == pytest.approx(0.03) and out["a"].result == "better"
    assert out["c"].p_adjusted == pytest.approx(0.06) and out["c"].result == "inconclusive"
    assert out["b"].p_adjusted == pytest.approx(0.06) and "Holm" in out["b"].reason
    assert out["a"].json_view()["p"] == pytest.approx(0.03)  # show --json reports the adjusted p


def test_a_round_without_a_baseline_is_inconclusive() -> None:
    out = judge_round({"r1-2": seeds(1.0, 2.0)}, None, "maximize")
    assert out["r1-2"].result == "inconclusive" and "no baseline" in out["r1-2"].reason


def launch(seed: int, status: str = "finished", attempt: int = 0, reason: str = "", steps: int = 4) -> Launch:
    key = f"r1-2-s{seed}" + ("-rerun" if attempt else "")
    return Launch(key=key, proposal_id="r1-2", seed=seed, steps=steps, status=status, attempt=attempt,  # type: ignore[arg-type]
                  reason=reason)


def test_runs_stopped_early_are_scored_as_failed_not_on_their_tail() -> None:
    good_tail = [(1, 0.1), (2, 0.9), (3, 0.95)]
    stopped = analysis.run_outcome(launch(0, "stopped", reason="reward collapse: fell"), good_tail, UP)
    assert stopped.score is None and "reward collapse" in stopped.reason
    short = analysis.run_outcome(launch(0), good_tail, UP)  # finished, but at step 3 of 4
    assert short.score is None and "step 3 of 4" in short.reason
    full = analysis.run_outcome(launch(0), [*good_tail, (4, 1.0)], UP)
    assert full.score == pytest.approx(0.975)


def test_a_failed_seed_is_rerun_once_and_failing_again_makes_the_proposal_incomplete() -> None:
    first = [launch(0), launch(1, "failed", reason="exit code 1"), launch(2, "stopped", reason="divergence: loss")]
    outcomes = {"r1-2-s0": analysis.RunScore(1.0), "r1-2-s1": analysis.RunScore(None, "failed: exit code 1"),
                "r1-2-s2": analysis.RunScore(None, "stopped: divergence: loss")}
    scores, failed, reruns = analysis.seed_table(first, outcomes)
    assert scores == {0: 1.0} and [x.key for x in reruns] == ["r1-2-s1-rerun"]  # divergence would repeat
    assert reruns[0].attempt == 1 and reruns[0].status == "queued" and set(failed) == {2}

    recovered = {**outcomes, "r1-2-s1-rerun": analysis.RunScore(1.2)}
    scores, failed, reruns = analysis.seed_table([*first, launch(1, attempt=1)], recovered)
    assert scores == {0: 1.0, 1: 1.2} and not reruns

    twice = {**outcomes, "r1-2-s1-rerun": analysis.RunScore(None, "failed: exit code 1")}
    result = analysis.experiment_result("r1-2", [*first, launch(1, "failed", attempt=1)], twice)
    assert result.failed_seeds[1].startswith("failed twice") and result.seed_scores == {0: 1.0}
    verdict = judge_round({"r1-2": result.seed_scores}, seeds(0.0, 0.1, 0.2), "maximize",
                          incomplete={"r1-2": "seed 1 failed twice"})["r1-2"]
    assert verdict.result == "incomplete" and "failed twice" in verdict.reason


def test_judge_compares_with_the_baseline_of_the_same_length() -> None:
    base_values = {"trainer.lr": 0.003}
    props = [Proposal(id=f"r1-{i}", round=1, planner="heuristic", hypothesis="h h", rationale="r r",
                      expected_effect="e e", overrides={"trainer.lr": lr, "trainer.steps": steps})
             for i, (lr, steps) in enumerate([(0.003, 4), (0.03, 4), (0.0, 4), (0.003, 8)], start=1)]
    outcomes = {}
    launches = []
    for p, offsets in zip(props, ([0.0, 0.1, 0.2], [1.0, 1.2, 1.1], [0.05, 0.0, 0.3], [5.0, 5.1, 5.2])):
        for s, v in enumerate(offsets):
            launches.append(Launch(key=f"{p.id}-s{s}", proposal_id=p.id, seed=s, steps=4, status="finished"))
            outcomes[f"{p.id}-s{s}"] = analysis.RunScore(v)
    results = [analysis.experiment_result(p.id, [x for x in launches if x.proposal_id == p.id], outcomes)
               for p in props]
    judged = {r.proposal_id: r for r in analysis.judge(results, props, base_values, 8, UP)}
    assert judged["r1-1"].verdict is None and judged["r1-4"].verdict is None  # baselines of 4 and 8 steps
    assert judged["r1-2"].verdict.result == "better" and judged["r1-2"].verdict.baseline == "r1-1"  # type: ignore[union-attr]
    assert judged["r1-3"].verdict.result == "inconclusive"  # type: ignore[union-attr]
    assert judged["r1-2"].verdict.p_adjusted is not None  # one Holm family of two candidates  # type: ignore[union-attr]


def test_recommendation_needs_better_at_the_longest_training_and_confirmation() -> None:
    good = Verdict(result="better", test=decision.PAIRED, effect=0.5, ci=[0.1, 0.9], p=0.01)
    great_but_short = Verdict(result="better", test=decision.PAIRED, effect=2.0, ci=[1.0, 3.0], p=0.001)
    flat = Verdict(result="inconclusive", test=decision.PAIRED, effect=0.1, ci=[-0.5, 0.7], p=0.6)
    pick = recommend([Candidate(proposal_id="a", steps=8, verdict=good),
                      Candidate(proposal_id="b", steps=4, verdict=great_but_short),
                      Candidate(proposal_id="c", steps=8, verdict=flat)], "maximize")
    assert pick is not None and pick.proposal_id == "a"
    assert recommend([Candidate(proposal_id="c", steps=8, verdict=flat)], "maximize") is None
    held = held_out_seeds([0, 1, 2], 3)
    assert held == [3, 4, 5]
    ok = confirm("a", held, seeds(1.0, 1.2, 1.1, start=3), seeds(0.0, 0.1, 0.05, start=3), "maximize")
    assert ok.replicated and "replicated on held-out seeds [3, 4, 5]" in ok.fmt()
    no = confirm("a", held, seeds(0.1, 0.0, 0.2, start=3), seeds(0.0, 0.1, 0.05, start=3), "maximize")
    assert not no.replicated and no.fmt().startswith("did not replicate")


def test_confirmation_round_uses_unused_seeds_and_the_recommendation_stands_only_if_it_replicates(
        tmp_path: Path) -> None:
    brief = make_brief(tmp_path, "  trainer.lr:\n    kind: choice\n    values: [0.0, 0.03]", "seeds: [0, 1, 2]")
    base_values = {"trainer.lr": 1.0e-5}
    props = [Proposal(id=f"r1-{i}", round=1, planner="heuristic", hypothesis="h h", rationale="r r",
                      expected_effect="e e", overrides={"trainer.lr": lr, "trainer.steps": 4})
             for i, lr in enumerate([1.0e-5, 0.03], start=1)]
    outcomes = {f"r1-1-s{s}": analysis.RunScore(v) for s, v in enumerate([0.0, 0.1, 0.05])}
    outcomes |= {f"r1-2-s{s}": analysis.RunScore(v) for s, v in enumerate([1.0, 1.2, 1.1])}
    results = [analysis.experiment_result(p.id, [Launch(key=f"{p.id}-s{s}", proposal_id=p.id, seed=s, steps=4,
                                                        status="finished") for s in range(3)], outcomes)
               for p in props]
    results = analysis.judge(results, props, base_values, 8, UP)
    pick = confirmation.owed(props, results, 8, brief)
    assert pick is not None and pick.id == "r1-2"
    fresh = confirmation.proposals_for(pick, results[1], props, brief, base_values, 8, number=2)
    assert [p.seeds for p in fresh] == [[3, 4, 5], [3, 4, 5]]  # never the search's 0, 1, 2
    assert fresh[0].overrides == {"trainer.lr": 0.03, "trainer.steps": 8}  # full length
    assert fresh[1].overrides == {"trainer.lr": 1.0e-5, "trainer.steps": 8} and fresh[0].confirms == "r1-2"
    everyone = [*props, *fresh]
    assert confirmation.owed(everyone, results, 8, brief) is None  # one confirmation per study

    def confirm_with(gain: list[float]) -> str:
        runs = {f"r2-1-s{s}": analysis.RunScore(v) for s, v in zip(range(3, 6), gain)}
        runs |= {f"r2-2-s{s}": analysis.RunScore(v) for s, v in zip(range(3, 6), [0.0, 0.1, 0.05])}
        new = [analysis.experiment_result(p.id, [Launch(key=f"{p.id}-s{s}", proposal_id=p.id, seed=s, steps=8,
                                                        status="finished") for s in p.seeds or []], runs)
               for p in fresh]
        judged = analysis.judge(new, everyone, base_values, 8, UP, known=results)
        assert judged[0].verdict is not None and judged[0].verdict.baseline == "r2-2"  # not the search's r1-1
        return confirmation.conclusion(everyone, confirmation.attach([*results, *judged], everyone, base_values),
                                       8, brief)

    assert confirm_with([1.0, 1.2, 1.1]).startswith("recommend r1-2: replicated on held-out seeds [3, 4, 5]")
    assert "did not replicate" in confirm_with([0.1, 0.0, 0.2])
    assert "not confirmed" in confirmation.conclusion(props, results, 8, brief)


def test_a_run_past_its_timeout_or_without_new_steps_is_overdue() -> None:
    running = Launch(key="r1-1-s0", proposal_id="r1-1", seed=0, steps=8, status="running", started_at=1000.0)
    assert analysis.overdue(running, None, None, now=10_000.0) is None  # neither limit set
    assert analysis.overdue(running, 600.0, None, now=1500.0) is None
    timeout = analysis.overdue(running, 600.0, None, now=1700.0)
    assert timeout is not None and timeout.startswith("timeout: still running after 700 s")
    assert analysis.overdue(running, None, 60.0, now=1050.0) is None
    stalled = analysis.overdue(running, None, 60.0, now=1100.0)  # no step logged since the start
    assert stalled is not None and stalled.startswith("stalled: no new metric for 100 s")
    moving = running.model_copy(update={"progress_at": 1090.0, "steps_done": 3})
    assert analysis.overdue(moving, None, 60.0, now=1100.0) is None
    assert "last step 3" in (analysis.overdue(moving, None, 60.0, now=1200.0) or "")
    # stalled and timed-out runs are re-run once; a divergence would repeat, so it is not
    scores, failed, reruns = analysis.seed_table(
        [Launch(key="a-s0", proposal_id="a", seed=0, steps=8, status="stalled", reason=stalled),
         Launch(key="a-s1", proposal_id="a", seed=1, steps=8, status="stopped", reason="divergence: x")], {})
    assert [x.resumes for x in reruns] == ["a-s0"] and set(failed) == {1}
    hung = Launch(key="a-s0", proposal_id="a", seed=0, steps=8, status="stalled", reason=stalled)
    assert analysis.run_outcome(hung, [(1, 1.0)], UP).reason == stalled  # "stalled" said once, not twice
