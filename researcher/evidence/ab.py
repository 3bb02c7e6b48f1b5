"""The in-run A/B verdict: is the new code better than the old, from the steps where both were paired?

During an A/B inside one live run both code versions serve the same tasks on the same weights
(the core pairs them: `core.episodes.pairing`), and for each trainer step the run logs each
version's mean score over the (task, weights) cells both versions completed
(`core.config.ab_metric`). The evidence is the per-step difference new minus old.

Those differences are not independent: whatever a version carries from one step to the next (its
clients' state, the tasks it happened to draw, its share of the episodes) makes them
autocorrelated, and a paired t-test then claims far more than it knows (at AR(0.5) noise it calls a
null swap better ~12% of the time over 10 steps, not 2.5%). The test here is a HAC t-test:
the mean difference over a Newey–West long-run standard error (Bartlett kernel), with the fixed-b
bandwidth of Kiefer and Vogelsang (`BANDWIDTH_FRACTION` of the window) and the statistic's exact
finite-sample null distribution for that window length under independent Gaussian differences
(simulated once per length, `NULL_DRAWS` draws, a fixed seed). Fixed-b keeps the statistic's
reference distribution honest about the noise of the variance estimate, which at 10 steps is large;
bench/rigor.py measures what is left (about 7% false "better" at AR(0.5) over 10 steps, 5% over 20).
That remainder is why a live winner is kept only after a confirmation: the same test, on the next
window of steps, which the first verdict did not see (`confirm_ab`).

Pure functions over numbers: no MLflow, no processes. It is not the seed-level decision rule
(`researcher.evidence.decision.compare`), whose runs are independent by construction.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import lru_cache

import numpy as np

from researcher.evidence.decision import (
    ALPHA,
    MIN_SEEDS,
    NO_TEST,
    PAIRED,
    Direction,
    _finite,
    _judge,
    holm,
)
from researcher.records import Verdict

HAC = "HAC t-test (Newey–West, fixed-b)"
# The Bartlett bandwidth as a share of the window (Kiefer–Vogelsang's b): half the window keeps the
# lag covariances of a version's drift in the variance while leaving enough lags out to estimate it.
BANDWIDTH_FRACTION = 0.5
# Draws of the statistic's null distribution per window length: a p-value near ALPHA is then known to
# about +-0.002, far below the margins the verdicts turn on; a fixed seed makes every verdict repeatable.
NULL_DRAWS = 20_000
NULL_SEED = 20260
# Fewer steps than this estimate no noise (as `decision.MIN_SEEDS`); at two the test still runs, on its exact null.
MIN_STEPS = MIN_SEEDS
# A window's differences that are all equal to this relative precision carry no noise to judge by.
FLAT = 1e-12


def bandwidth(n: int) -> int:
    """The Bartlett kernel's lag count for a window of `n` steps (at least one)."""
    return max(1, math.ceil(BANDWIDTH_FRACTION * n))


def _long_run_variances(d: np.ndarray) -> np.ndarray:
    """Newey–West (Bartlett) long-run variance of each row of `d` (rows: windows, columns: steps)."""
    n = d.shape[-1]
    lags = bandwidth(n)
    e = d - d.mean(axis=-1, keepdims=True)
    total = (e * e).sum(axis=-1) / n
    for k in range(1, lags + 1):
        total = total + 2.0 * (1.0 - k / (lags + 1)) * (e[..., k:] * e[..., :-k]).sum(axis=-1) / n
    return total  # Bartlett weights keep it >= 0


def hac_statistic(d: np.ndarray) -> np.ndarray:
    """The HAC t statistic of each row's mean: mean / sqrt(long-run variance / n)."""
    n = d.shape[-1]
    return d.mean(axis=-1) / np.sqrt(np.maximum(_long_run_variances(d), 1e-300) / n)


@lru_cache(maxsize=64)
def null_distribution(n: int) -> np.ndarray:
    """|statistic| under no effect, sorted, for a window of `n` independent Gaussian differences (its exact
    finite-sample law: the statistic does not depend on the differences' scale)."""
    rng = np.random.default_rng([NULL_SEED, n])
    return np.sort(np.abs(hac_statistic(rng.standard_normal((NULL_DRAWS, n)))))


def hac_test(diffs: Mapping[int, float]) -> tuple[float, float, list[float]]:
    """(effect, two-sided p, 95% interval) of the mean per-step difference; ValueError when it cannot run."""
    d = np.array([diffs[s] for s in sorted(diffs)], dtype=float)
    n = len(d)
    if n < MIN_STEPS:
        raise ValueError(f"{n} step(s) where both versions logged a score: at least {MIN_STEPS} are needed")
    if np.ptp(d) <= FLAT * max(1.0, float(np.abs(d).max())):
        raise ValueError("the versions' scores differ by the same amount at every step (a saturated reward?), so "
                         "the test cannot estimate noise")
    stat = float(hac_statistic(d))
    null = null_distribution(n)
    exceed = len(null) - int(np.searchsorted(null, abs(stat), side="left"))
    p = (exceed + 1) / (len(null) + 1)  # a simulated p-value is never 0
    critical = float(np.quantile(null, 1 - ALPHA))
    se = float(np.sqrt(_long_run_variances(d) / n))
    effect = float(d.mean())
    return effect, p, [effect - critical * se, effect + critical * se]


def ab_verdict(new: Mapping[int, float], old: Mapping[int, float], direction: Direction, *,
               baseline_id: str | None = None, alpha: float = ALPHA) -> Verdict:
    """One window's verdict, uncorrected: the HAC test on new - old over the steps both logged."""
    new, old = _finite(new), _finite(old)
    common = sorted(set(new) & set(old))
    head = {"n": len(common), "n_baseline": len(common), "baseline": baseline_id}
    diffs = {s: new[s] - old[s] for s in common}
    try:
        effect, p, ci = hac_test(diffs)
    except ValueError as e:
        effect = float(np.mean(list(diffs.values()))) if diffs else None
        return Verdict(result="inconclusive", test=NO_TEST if len(common) < MIN_STEPS else HAC, effect=effect,
                       reason=str(e), **head)
    verdict = Verdict(result="inconclusive", test=HAC, effect=effect, ci=ci, p=p, **head)
    return _judge(verdict, p, direction, alpha, "")


def judge_ab(new: Mapping[int, float], old: Mapping[int, float], direction: Direction, *,
             baseline_id: str | None = None, round_verdicts: Mapping[str, Verdict] | None = None,
             pending: int = 0, alpha: float = ALPHA) -> Verdict:
    """An in-run A/B: the new version's per-step paired score against the old one's (step -> score), judged by
    the HAC test in the objective's direction, Holm-corrected with the round's other comparisons
    (`round_verdicts`, already judged) and `pending` comparisons still to run (at p = 1, so a verdict, and the
    drain that follows it, never needs revising)."""
    raw = ab_verdict(new, old, direction, baseline_id=baseline_id, alpha=alpha)
    this = "\0this"
    others = {k: v for k, v in (round_verdicts or {}).items() if v.p is not None}
    stand_ins = {f"\0pending{i}": Verdict(result="inconclusive", test=PAIRED, p=1.0, effect=0.0, ci=[0.0, 0.0])
                 for i in range(pending)}
    if raw.p is None or not (others or stand_ins):
        return raw
    return holm({**others, **stand_ins, this: raw}, direction, alpha)[this]


def confirm_ab(first: Verdict, new: Mapping[int, float], old: Mapping[int, float], direction: Direction, *,
               baseline_id: str | None = None, alpha: float = ALPHA) -> Verdict:
    """The confirmation of a `better` A/B: the same test on a second window of steps the first never saw (the
    caller reads steps after the first window's last). It stands only if it is `better` again, in the same
    direction; anything else says why the first window's win is not kept."""
    if first.result != "better":
        raise ValueError(f"only a better verdict is confirmed, not {first.result!r}")
    second = ab_verdict(new, old, direction, baseline_id=baseline_id, alpha=alpha)
    if second.result == "better":
        return second
    why = second.reason or f"the second window called it {second.result}"
    return second.model_copy(update={"reason": f"not confirmed on the next {second.n} steps: {why}"})
