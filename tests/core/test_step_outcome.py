"""A train step's typed outcome: what the run loop counts toward `trainer.max_failed_steps`, and the
metric names the run logs for it (the names are given in `core.train.outcome` alone)."""

from __future__ import annotations

from core.train.outcome import StepOutcome


def test_a_failed_step_learnt_nothing_and_logs_only_that_it_failed():
    outcome = StepOutcome.failure()
    outcome.timings = {"time/train_s": 0.5}
    assert outcome.learnt_nothing
    assert outcome.logged() == {"train/failed": 1.0}  # timings are summed by the loop, not logged per policy


def test_a_skipped_step_learnt_nothing_and_logs_its_metrics_with_the_skip():
    outcome = StepOutcome({"train/loss": float("nan"), "train/updated": 0.0}, skipped=True)
    assert outcome.learnt_nothing and not outcome.failed
    assert outcome.logged()["train/skipped"] == 1.0 and outcome.logged()["train/updated"] == 0.0


def test_a_step_that_trained_learnt_something_and_logs_no_skip():
    outcome = StepOutcome({"train/loss": 0.25, "train/updated": 1.0})
    assert not outcome.learnt_nothing
    assert outcome.logged() == {"train/loss": 0.25, "train/updated": 1.0, "train/skipped": 0.0}
