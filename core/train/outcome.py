"""What one policy's train step came to: a `StepOutcome`, typed, for the run loop to act on and log.

The run loop counts a step that learnt nothing (it raised, or its optimizer step was skipped for a
non-finite loss or gradient) toward `trainer.max_failed_steps` by reading `failed` and `skipped`,
never by looking for metric names. The names the run logs for those two flags (DESIGN §3.6) are
given here and nowhere else (`StepOutcome.logged`; tests/test_structure.py holds the bar).
It is deliberately not the trainer (`core.train.trainer` fills one in) and not telemetry
(`core.run.telemetry` sends what `logged` returns).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepOutcome:
    """One policy's step: its trainer's metrics, whether it learnt nothing and why, and where its time went."""

    metrics: dict[str, float] = field(default_factory=dict)  # the trainer's train/*, merge/*, reward/* values
    failed: bool = False  # it raised: weights and version unchanged, gradients dropped, the error logged
    skipped: bool = False  # a non-finite loss or gradient skipped its optimizer step: weights unchanged
    timings: dict[str, float] = field(default_factory=dict)  # seconds, by metric name (`time/train_s`, `time/sync_s`)

    @classmethod
    def failure(cls) -> StepOutcome:
        """A step that raised: it has no trainer metrics to report."""
        return cls(failed=True)

    @property
    def learnt_nothing(self) -> bool:
        """Whether it counts toward `trainer.max_failed_steps`: it raised or its optimizer step was skipped."""
        return self.failed or self.skipped

    def logged(self) -> dict[str, float]:
        """Its metrics as the run logs them: a failed step only `train/failed` 1 (it has nothing else to
        report), any other its trainer's metrics and `train/skipped` (1 when the optimizer step was skipped)."""
        if self.failed:
            return {"train/failed": 1.0}
        return {**self.metrics, "train/skipped": float(self.skipped)}
