"""Stop rules that treat arms alike (issue 31, item 5): no collapse stop unless a brief asks for one, and a
seed a plateau stopped is scored at the same step in every arm it is compared with."""

from __future__ import annotations

from pathlib import Path

from researcher.brief.schema import MonitorSettings, Objective
from researcher.evidence import analysis
from researcher.evidence.pairing import Arm, aligned
from researcher.records import Launch, Proposal
from tests.researcher.helpers import make_brief

UP = Objective(metric="reward/mean", direction="maximize", window=1)
BASE = {"trainer.lr": 1.0e-5}
# A real RL curve: it dips to a third of its best for two steps, then climbs past it (the documented
# smollm2-guess run that reached 1.1 looked like this at step 6).
DIP_AND_RECOVER = [(1, 0.3), (2, 0.6), (3, 0.2), (4, 0.2), (5, 0.9), (6, 1.1)]


def test_no_collapse_stop_unless_the_brief_asks_for_one(tmp_path: Path) -> None:
    brief = make_brief(tmp_path, "  trainer.lr:\n    kind: choice\n    values: [0.0, 0.03]")
    assert brief.monitor.collapse_drop is None
    for upto in range(3, len(DIP_AND_RECOVER) + 1):  # at no step of the dip is the run stopped
        assert analysis.collapse(DIP_AND_RECOVER[:upto], UP, brief.monitor) is None
    asked = MonitorSettings(collapse_drop=0.5)  # a brief that sets it still gets it
    assert analysis.collapse(DIP_AND_RECOVER[:4], UP, asked) is not None


def proposal(pid: str, lr: float) -> Proposal:
    return Proposal(id=pid, round=1, planner="heuristic", hypothesis="h h", rationale="r r", expected_effect="e e",
                    overrides={"trainer.lr": lr, "trainer.steps": 10})


# Each arm's run per seed: the reward at every step 1..10. The baseline's seed 0 converged early and a
# plateau stopped it at step 4 (at 0.9, its best); the candidate's seed 0 was still climbing then.
CURVES = {
    ("base", 0): [0.5, 0.8, 0.9, 0.9],
    ("base", 1): [0.1 * s for s in range(1, 11)],
    ("base", 2): [0.05 * s for s in range(1, 11)],
    ("cand", 0): [0.1 * s + 0.05 for s in range(1, 11)],
    ("cand", 1): [0.1 * s + 0.1 for s in range(1, 11)],
    ("cand", 2): [0.05 * s + 0.12 for s in range(1, 11)],
}


def runs(pid: str) -> tuple[list[Launch], dict[str, analysis.RunScore]]:
    launches, outcomes = [], {}
    for seed in range(3):
        curve = [(i + 1, v) for i, v in enumerate(CURVES[(pid, seed)])]
        stopped = len(curve) < 10
        x = Launch(key=f"{pid}-s{seed}", proposal_id=pid, seed=seed, steps=10, run_id=f"{pid}{seed}",
                   status="stopped" if stopped else "finished", steps_done=curve[-1][0],
                   reason="plateau: reward/mean did not improve for 2 steps" if stopped else "")
        launches.append(x)
        outcomes[x.key] = analysis.run_outcome(x, curve, UP)
    return launches, outcomes


def score_at(pid: str, seed: int, step: int) -> float | None:
    curve = CURVES[(pid, seed)]
    return curve[step - 1] if step <= len(curve) else None


def test_a_plateau_stop_is_scored_at_its_step_and_so_is_the_other_arm_on_that_seed() -> None:
    base_runs, base_outcomes = runs("base")
    stopped = base_outcomes["base-s0"]
    assert stopped.score == 0.9 and stopped.stopped_at == 4  # scored where it stopped, not a failed seed
    base = analysis.experiment_result("base", *runs("base"))
    cand = analysis.experiment_result("cand", *runs("cand"))
    assert base.seed_scores[0] == 0.9 and base.stopped_at == {0: 4} and not base.failed_seeds
    props = [proposal("base", 1.0e-5), proposal("cand", 0.03)]
    judged = analysis.judge([cand, base], props, BASE, 10, UP, score_at=score_at)
    verdict = judged[0].verdict
    assert verdict is not None and verdict.result != "incomplete" and (verdict.n, verdict.n_baseline) == (3, 3)
    # seed 0 compared at step 4 in both arms: candidate 0.45 against 0.9, not its step-10 1.05 against 0.9
    expected = ((0.45 - 0.9) + (1.1 - 1.0) + (0.62 - 0.5)) / 3
    assert abs((verdict.effect or 0) - expected) < 1e-9 and "0@4" in verdict.reason


def test_without_a_score_at_the_stop_step_the_seed_leaves_both_arms() -> None:
    cand = Arm(scores={0: 1.0, 1: 1.1, 2: 1.2}, owner={0: "c", 1: "c", 2: "c"})
    base = Arm(scores={0: 0.9, 1: 0.5, 2: 0.6}, owner={0: "b", 1: "b", 2: "b"}, stopped={0: 4})
    left, right, note = aligned(cand, base, lambda pid, seed, step: None)
    assert set(left) == set(right) == {1, 2} and "left out of both arms" in note
    left, right, note = aligned(cand, base, None)  # nothing to read the other run with: the same
    assert set(left) == set(right) == {1, 2}
