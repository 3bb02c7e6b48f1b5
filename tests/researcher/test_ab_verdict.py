"""The in-run A/B verdict (`researcher.evidence.decision.judge_ab`): both versions serve under the same weights at
every step after a swap, so the per-step difference is judged, never before against after.

Rewards are simulated the way a learning run makes them: a shared rising curve plus the weights'
autocorrelated wander (both common to the two versions at a step), plus each version's own episode
sampling noise. A null change rides that drift without being called better (the before/after
comparison it replaces calls it better almost every time: the test shows both); a real effect is;
the brief's direction decides what better means; Holm counts the round's other comparisons.
"""

from __future__ import annotations

import random

from researcher.evidence.decision import compare, judge_ab

WINDOW = 10


def _run(effect: float, rng: random.Random, steps: int = 2 * WINDOW, slope: float = 0.3) -> tuple[dict, dict]:
    """(old, new) per-step rewards: the first half only the old version serves, then both (an A/B)."""
    wander, old, new = 0.0, {}, {}
    for t in range(steps):
        wander = 0.8 * wander + rng.gauss(0.0, 0.6)
        shared = slope * t + wander
        old[t] = shared + rng.gauss(0.0, 0.8)
        if t >= steps // 2:
            new[t] = shared + effect + rng.gauss(0.0, 0.8)
    return old, new


def _rate(effect: float, result: str, trials: int = 200, seed: int = 0) -> tuple[float, float]:
    """(A/B, before/after) rate of `result` for a change worth `effect` over `trials` simulated swaps."""
    rng = random.Random(seed)
    ab = before_after = 0
    for _ in range(trials):
        old, new = _run(effect, rng)
        swap = min(new)
        ab += judge_ab(new, old, "maximize").result == result
        before = {s: v for s, v in old.items() if s < swap}
        before_after += compare(new, before, "maximize").result == result
    return ab / trials, before_after / trials


def test_a_null_swap_on_a_learning_run_is_not_called_better_though_before_after_would() -> None:
    ab, before_after = _rate(0.0, "better")
    assert ab <= 0.05
    assert before_after >= 0.5  # the curve alone makes the new version look better after the swap


def test_a_real_effect_is_called_better() -> None:
    ab, _ = _rate(2.0, "better")
    assert ab >= 0.9


def test_the_briefs_direction_decides_what_better_means() -> None:
    old = {s: 1.0 + 0.1 * s + (0.05 if s % 2 else -0.05) for s in range(10)}
    higher = {s: v + 1.0 + (0.02 if s % 3 else -0.03) for s, v in old.items()}
    up = judge_ab(higher, old, "maximize")
    down = judge_ab(higher, old, "minimize")
    assert (up.result, down.result) == ("better", "worse")
    assert up.test == "paired t-test" and up.effect > 0.9 and up.ci[0] > 0
    lower = {s: v - 1.0 + (0.02 if s % 3 else -0.03) for s, v in old.items()}
    assert judge_ab(lower, old, "minimize").result == "better"
    assert set(up.json_view()) == {"result", "test", "effect", "ci", "p"}


def test_only_steps_where_both_versions_logged_are_paired() -> None:
    old = {s: float(s) for s in range(10)}
    new = {s: float(s) + 1.0 + 0.01 * (s % 3) for s in range(5, 10)} | {20: -100.0}  # step 20: old logged nothing
    verdict = judge_ab(new, old, "maximize")
    assert verdict.result == "better" and verdict.n == 5 and abs(verdict.effect - 1.01) < 0.01
    assert judge_ab({5: 2.0}, old, "maximize").result == "inconclusive"  # one paired step estimates no noise


def test_holm_counts_the_rounds_other_and_pending_comparisons() -> None:
    diffs = [0.9, -0.4, 1.6, 0.2, 1.1, -0.2, 0.7, 1.4, 0.1, 0.6]  # p = 0.02 alone
    old = {s: 0.5 * s for s in range(10)}
    new = {s: v + diffs[s] for s, v in old.items()}
    alone = judge_ab(new, old, "maximize")
    assert alone.result == "better" and 0.005 < alone.p < 0.05 and alone.p_adjusted is None
    crowded = judge_ab(new, old, "maximize", pending=9)  # nine more comparisons this round, counted at p = 1
    assert crowded.result == "inconclusive" and abs(crowded.p_adjusted - 10 * alone.p) < 1e-9
    earlier = {"p1/1": judge_ab(old, new, "maximize")}  # an earlier swap of the round, much worse
    assert judge_ab(new, old, "maximize", round_verdicts=earlier).p_adjusted >= alone.p


def test_a_saturated_reward_is_inconclusive_and_says_why_in_steps() -> None:
    old = {s: 1.0 for s in range(10)}
    verdict = judge_ab(dict(old), old, "maximize")
    assert verdict.result == "inconclusive" and "every step" in verdict.reason and "seeds" not in verdict.reason
    shifted = judge_ab({s: 1.5 for s in range(10)}, old, "maximize")  # a constant gap: no noise to judge it by
    assert shifted.result == "inconclusive" and "every step" in shifted.reason
