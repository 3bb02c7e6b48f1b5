"""Analysis: scores over seeds with honest intervals, and the early-stop signals."""

from __future__ import annotations

import math

import pytest

from researcher.brief.schema import MonitorSettings, Objective
from researcher.evidence.analysis import collapse, divergence, mean_curve, plateau, score, summarize

UP = Objective(metric="reward/mean", direction="maximize", window=2)
DOWN = Objective(metric="train/loss", direction="minimize")


def test_interval_uses_student_t_for_few_seeds_and_one_seed_has_none() -> None:
    s = summarize([1.0, 2.0, 3.0])
    assert s.mean == 2.0 and s.n == 3
    assert s.ci_high - s.mean == pytest.approx(4.303 * 1.0 / math.sqrt(3), rel=1e-3)
    one = summarize([5.0])
    assert one.n == 1 and math.isnan(one.ci_low) and math.isnan(one.ci_high)  # not a zero-width certainty
    assert one.fmt() == "5 (1 seed)"
    assert summarize([math.nan]).n == 0


def test_score_is_the_mean_of_the_last_window_and_nan_poisons_it() -> None:
    assert score([(1, 0.0), (2, 1.0), (3, 3.0)], UP) == 2.0
    assert math.isnan(score([(1, 1.0), (2, math.nan)], UP))
    assert math.isnan(score([], UP))


def test_divergence_names_metric_and_step() -> None:
    assert divergence({"train/loss": [(1, 0.5), (2, 0.4)]}) is None
    assert divergence({"train/loss": [(1, 0.5), (2, math.inf)]}) == "divergence: train/loss = inf at step 2"


def test_collapse_needs_two_low_values_after_a_best() -> None:
    settings = MonitorSettings(collapse_drop=0.5)
    assert collapse([(1, 0.8), (2, 0.9), (3, 0.3)], UP, settings) is None  # one low step is noise
    reason = collapse([(1, 0.8), (2, 0.9), (3, 0.3), (4, 0.2)], UP, settings)
    assert reason is not None and "reward collapse" in reason
    assert collapse([(1, 0.8), (2, 0.9), (3, 0.3), (4, 0.2)], UP, MonitorSettings(collapse_drop=None)) is None


def test_plateau_after_patience_without_improvement() -> None:
    settings = MonitorSettings(plateau_patience=3, plateau_min_delta=0.01)
    rising = [(i, 0.1 * i) for i in range(1, 8)]
    flat = rising[:3] + [(i, 0.3) for i in range(4, 8)]
    assert plateau(rising, UP, settings) is None
    assert plateau(flat, UP, settings) is not None
    assert plateau(flat, UP, MonitorSettings()) is None  # off unless the brief asks


def test_mean_curve_keeps_steps_all_seeds_reached() -> None:
    assert mean_curve([[(1, 1.0), (2, 3.0)], [(1, 3.0)]]) == [(1, 2.0)]
