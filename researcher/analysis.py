"""Reading results: metric histories from MLflow, scores over seeds, and early-stop signals.

The core logs the metrics of DESIGN §3.6 with `step=` the trainer step. This module turns those
histories into one score per run, a mean with a 95% confidence interval per experiment, and the
signals the monitor stops a run on: divergence (a NaN or infinite value), reward collapse and a
plateau. It reads MLflow and computes; it never starts, stops or tags anything.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from mlflow.tracking import MlflowClient

from researcher.brief import MonitorSettings, Objective
from researcher.records import Summary

# Two-sided 95% Student-t quantiles by degrees of freedom: few seeds are the norm, and a normal
# quantile would make their intervals look far tighter than they are (the "single-run noise"
# that fools other research agents). Beyond 30 the normal value is close enough.
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
        10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 25: 2.060, 30: 2.042}
_Z95 = 1.96

History = list[tuple[int, float]]  # (step, value), sorted by step


def t95(dof: int) -> float:
    if dof > 30:
        return _Z95
    return _T95.get(dof) or _T95[min(k for k in _T95 if k >= dof)]


def summarize(values: Sequence[float]) -> Summary:
    """Mean, sample std and the 95% t interval of per-seed scores (NaNs dropped)."""
    clean = [v for v in values if not math.isnan(v)]
    if not clean:
        return Summary(n=0, mean=math.nan, std=math.nan, ci_low=math.nan, ci_high=math.nan)
    mean = statistics.fmean(clean)
    if len(clean) == 1:
        return Summary(n=1, mean=mean, std=0.0, ci_low=mean, ci_high=mean)
    std = statistics.stdev(clean)
    half = t95(len(clean) - 1) * std / math.sqrt(len(clean))
    return Summary(n=len(clean), mean=mean, std=std, ci_low=mean - half, ci_high=mean + half)


def clearly_better(a: Summary, b: Summary, objective: Objective) -> bool:
    """a beats b with non-overlapping intervals: the claim a report may make without hedging."""
    if a.n == 0 or b.n == 0:
        return False
    if objective.direction == "maximize":
        return a.ci_low > b.ci_high
    return a.ci_high < b.ci_low


def score(history: History, objective: Objective) -> float:
    """A run's score: the mean of its last `window` objective values; NaN when there are none."""
    if not history:
        return math.nan
    tail = [v for _, v in history[-objective.window:]]
    return math.nan if any(math.isnan(v) or math.isinf(v) for v in tail) else statistics.fmean(tail)


def divergence(histories: dict[str, History]) -> str | None:
    """The first metric that went NaN or infinite, as a reason; None when all are finite."""
    for name, history in histories.items():
        for step, value in history:
            if math.isnan(value) or math.isinf(value):
                return f"divergence: {name} = {value} at step {step}"
    return None


def collapse(history: History, objective: Objective, settings: MonitorSettings) -> str | None:
    """The objective fell more than `collapse_drop` of its best magnitude below the best, and stayed.

    Two consecutive values must be down, so one noisy step does not kill a run.
    """
    if settings.collapse_drop is None or len(history) < 3:
        return None
    values = [v for _, v in history]
    sign = 1.0 if objective.direction == "maximize" else -1.0
    best = max(sign * v for v in values[:-2])
    floor = best - settings.collapse_drop * max(abs(best), 1e-8)
    if all(sign * v < floor for v in values[-2:]):
        return f"reward collapse: {objective.metric} fell from {sign * best:.4g} to {values[-1]:.4g}"
    return None


def plateau(history: History, objective: Objective, settings: MonitorSettings) -> str | None:
    """No improvement larger than `plateau_min_delta` over the last `plateau_patience` steps."""
    patience = settings.plateau_patience
    if patience is None or len(history) <= patience:
        return None
    sign = 1.0 if objective.direction == "maximize" else -1.0
    values = [sign * v for _, v in history]
    before, recent = max(values[:-patience]), max(values[-patience:])
    if recent - before <= settings.plateau_min_delta:
        return f"plateau: {objective.metric} did not improve for {patience} steps"
    return None


@dataclass
class RunMetrics:
    """What the monitor and the report need from one MLflow run."""

    status: str  # MLflow run status: RUNNING, FINISHED, FAILED, KILLED, SCHEDULED
    histories: dict[str, History]

    @property
    def last_step(self) -> int:
        return max((h[-1][0] for h in self.histories.values() if h), default=0)


def read_history(client: MlflowClient, run_id: str, metric: str) -> History:
    points = client.get_metric_history(run_id, metric)
    return sorted((int(m.step), float(m.value)) for m in points)


def read_run(client: MlflowClient, run_id: str, metrics: Sequence[str]) -> RunMetrics:
    run = client.get_run(run_id)
    return RunMetrics(status=run.info.status,
                      histories={m: read_history(client, run_id, m) for m in dict.fromkeys(metrics)})


def mean_curve(histories: Sequence[History]) -> History:
    """Step-wise mean over seeds, over the steps every seed reached."""
    if not histories:
        return []
    by_step: dict[int, list[float]] = {}
    for h in histories:
        for step, value in h:
            by_step.setdefault(step, []).append(value)
    return [(s, statistics.fmean(v)) for s, v in sorted(by_step.items()) if len(v) == len(histories)]
