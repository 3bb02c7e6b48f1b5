"""Where two runs part: the first step at which their logged metrics differ.

Two runs of one config and one `trainer.seed` earn the same rewards step by step when their sampling
is repeatable (`engine.repeatable_sampling`, on-policy `trainer.max_staleness: 0`): every call's seed
then comes from (seed, episode, call, choice), and each step takes its groups in a stable order.
`first_parting` reads both runs' histories from MLflow and names the first step, and the metric,
where they do not, so a run that should repeat and does not says from when (`bench/repeatable_sampling.py`
prints it; `tests/core/test_seeds_runs.py` asserts on it).

Rewards are compared exactly: they are what the sampled text earned. The loss is not among the
defaults: its behaviour logprobs come from batched decoding, whose float rounding depends on which
rows share a forward pass, so two repeating runs log losses that differ in the last bits (measured:
1e-9 vs 2e-8 on a loss that is 0 up to rounding) while every sampled token is the same.

It compares values, it does not judge them: whether two seeds' runs differ by more than noise is the
researcher's statistics, not this.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from mlflow.tracking import MlflowClient

from core.mlflow_history import one_per_step

log = logging.getLogger(__name__)

# What a step's episodes earned: equal when the runs sampled the same text. Timings and throughput differ
# between any two runs and say nothing about whether they repeat.
OUTCOME_METRICS = ("reward/mean", "reward/std")


@dataclass(frozen=True)
class Parting:
    """The first step at which two runs' metric differs; a value is None where that run logged none."""

    step: int
    metric: str
    a: float | None
    b: float | None


def first_parting(client: MlflowClient, run_a: str, run_b: str, metrics: Sequence[str] = OUTCOME_METRICS,
                  upto_step: int | None = None) -> Parting | None:
    """The earliest step (up to `upto_step`, if given) at which any of `metrics` differs between the two
    runs, a step logged by one run only included; None when they agree on every step. Logs the parting."""
    found: Parting | None = None
    for name in metrics:
        a, b = ({m.step: m.value for m in one_per_step(client.get_metric_history(run, name))}
                for run in (run_a, run_b))
        for step in sorted(set(a) | set(b)):
            if (upto_step is not None and step > upto_step) or (found is not None and step >= found.step):
                break
            if a.get(step) != b.get(step):
                found = Parting(step, name, a.get(step), b.get(step))
                break
    if found is None:
        log.info("runs %s and %s agree on %s at every step", run_a, run_b, ", ".join(metrics))
    else:
        log.info("runs %s and %s part at step %d: %s %s vs %s", run_a, run_b, found.step, found.metric, found.a,
                 found.b)
    return found
