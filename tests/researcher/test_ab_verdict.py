"""The in-run A/B verdict (`researcher.evidence.ab.judge_ab`): both versions serve under the same weights at
every step after a swap, so the per-step difference is judged, never before against after.

Rewards are simulated the way a learning run makes them: a shared rising curve plus the weights'
autocorrelated wander (both common to the two versions at a step), plus each version's own episode
sampling noise. A null change rides that drift without being called better (the before/after
comparison it replaces calls it better almost every time: the test shows both); a real effect is;
the brief's direction decides what better means; Holm counts the round's other comparisons. Each
version's own autocorrelated noise (AR(0.5)) is where the paired t-test fails and the HAC test holds;
a confirmation window keeps a win only when it shows again.
"""

from __future__ import annotations

import random

import pytest

from researcher.evidence.ab import HAC, confirm_ab, judge_ab
from researcher.evidence.decision import compare

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
    assert up.test == HAC and up.effect > 0.9 and up.ci[0] > 0
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
    diffs = [0.9, -0.4, 1.6, 0.2, 1.1, -0.2, 0.7, 1.4, 0.1, 0.6]  # p = 0.003 alone
    old = {s: 0.5 * s for s in range(10)}
    new = {s: v + diffs[s] for s, v in old.items()}
    alone = judge_ab(new, old, "maximize")
    assert alone.result == "better" and 0.001 < alone.p < 0.05 and alone.p_adjusted is None
    crowded = judge_ab(new, old, "maximize", pending=29)  # 29 more comparisons this round, counted at p = 1
    assert crowded.result == "inconclusive" and abs(crowded.p_adjusted - 30 * alone.p) < 1e-9
    earlier = {"p1/1": judge_ab(old, new, "maximize")}  # an earlier swap of the round, much worse
    assert judge_ab(new, old, "maximize", round_verdicts=earlier).p_adjusted >= alone.p


def test_a_saturated_reward_is_inconclusive_and_says_why_in_steps() -> None:
    old = {s: 1.0 for s in range(10)}
    verdict = judge_ab(dict(old), old, "maximize")
    assert verdict.result == "inconclusive" and "every step" in verdict.reason and "seeds" not in verdict.reason
    shifted = judge_ab({s: 1.5 for s in range(10)}, old, "maximize")  # a constant gap: no noise to judge it by
    assert shifted.result == "inconclusive" and "every step" in shifted.reason


def _ar(n: int, phi: float, rng: random.Random) -> list[float]:
    """A stationary AR(`phi`) series of unit variance: one version's own drift from step to step."""
    x, out = rng.gauss(0.0, 1.0), []
    for _ in range(n):
        x = phi * x + rng.gauss(0.0, (1 - phi**2) ** 0.5)
        out.append(x)
    return out


def test_version_specific_autocorrelated_noise_fools_a_t_test_but_not_the_hac_test() -> None:
    rng, trials = random.Random(5), 600
    hac = t_test = 0
    for _ in range(trials):
        a, b = _ar(WINDOW, 0.5, rng), _ar(WINDOW, 0.5, rng)
        new, old = dict(enumerate(a)), dict(enumerate(b))
        hac += judge_ab(new, old, "maximize").result == "better"
        t_test += compare(new, old, "maximize").result == "better"  # the paired t-test on the same steps
    assert t_test / trials >= 0.08  # the t-test takes AR(0.5) drift for an effect (nominal: 0.025)
    assert hac / trials <= 0.09 and hac < t_test * 0.7


def test_a_win_is_kept_only_when_the_next_window_shows_it_again() -> None:
    rng = random.Random(9)
    old = {s: rng.gauss(0.0, 0.3) for s in range(2 * WINDOW)}
    new = {s: v + 1.0 + rng.gauss(0.0, 0.3) for s, v in old.items()}
    first = judge_ab({s: new[s] for s in range(WINDOW)}, old, "maximize")
    assert first.result == "better"
    later = range(WINDOW, 2 * WINDOW)
    kept = confirm_ab(first, {s: new[s] for s in later}, {s: old[s] for s in later}, "maximize")
    assert kept.result == "better" and kept.n == WINDOW
    gone = confirm_ab(first, {s: old[s] + rng.gauss(0.0, 0.3) for s in later}, {s: old[s] for s in later}, "maximize")
    assert gone.result != "better" and gone.reason.startswith(f"not confirmed on the next {WINDOW} steps")
    with pytest.raises(ValueError, match="only a better verdict"):
        confirm_ab(gone, new, old, "maximize")
