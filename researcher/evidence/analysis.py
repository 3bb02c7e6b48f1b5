"""Reading results: metric histories from MLflow, scores over seeds, and early-stop signals.

The core logs the metrics of DESIGN §3.6 with `step=` the trainer step. This module turns those
histories into one score per run, a mean with a 95% confidence interval per experiment, and the
signals the monitor stops a run on: divergence (a NaN or infinite value), reward collapse and a
plateau. Only a run that finished all its steps has a score: one stopped early (collapse,
timeout, stall, budget) or crashed counts as failed, never by its truncated tail. The one
exception is a plateau stop: it is scored at its stop step, and so is every arm it is compared
with on that seed (`pairing`). A seed without a score is re-run once (unless what stopped it would
happen again; a reference arm's seed gets one more fresh run, so nothing is judged against a
baseline that lost seeds to a crash), and a seed that fails twice makes the experiment
`incomplete`. The verdicts against the matching reference come from `decision` (`matching` says
which reference; a look of a group-sequential comparison is judged at its nominal level, `sequential`).
It reads MLflow and computes; it never starts, stops or tags anything.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from mlflow.tracking import MlflowClient

from core.mlflow_history import one_per_step
from researcher.brief.schema import MonitorSettings, Objective
from researcher.evidence import decision
from researcher.evidence.judging import arm_cost, judge  # noqa: F401  (judge re-exported: the study judges through analysis)
from researcher.evidence.matching import (  # noqa: F401  (re-exported: planners and tests ask analysis)
    baseline_for,
    config_of,
    is_baseline,
    is_reference,
)
from researcher.lazy import lazy_module
from researcher.records import COST_METRICS, Cost, ExperimentResult, Launch, Summary

# scipy.stats loads with the first interval (~1.2 s of CPU): every study process imports this module,
# and most of them (a restart, a review, a launch) compute none.
stats = lazy_module("scipy.stats")

History = list[tuple[int, float]]  # (step, value), sorted by step


def summarize(values: Sequence[float]) -> Summary:
    """Mean, sample std and the 95% Student-t interval of per-seed scores (NaNs dropped).

    Student-t, not normal: few seeds are the norm, and a normal quantile would make their intervals
    look far tighter than they are. One seed has no interval at all (NaN), never a zero-width one.
    """
    clean = [v for v in values if not math.isnan(v)]
    if not clean:
        return Summary(n=0, mean=math.nan, std=math.nan, ci_low=math.nan, ci_high=math.nan)
    mean = statistics.fmean(clean)
    if len(clean) == 1:
        return Summary(n=1, mean=mean, std=math.nan, ci_low=math.nan, ci_high=math.nan)
    std = statistics.stdev(clean)
    half = float(stats.t.ppf(0.5 + decision.CONFIDENCE / 2, len(clean) - 1)) * std / math.sqrt(len(clean))
    return Summary(n=len(clean), mean=mean, std=std, ci_low=mean - half, ci_high=mean + half)


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


# The reason `overdue` gives a hung run starts with this word, and the run ends with it as its status.
STALLED = "stalled"


def overdue(launch: Launch, run_timeout: float | None, stall_s: float | None, now: float) -> str | None:
    """Why a running run must be stopped for time: past its timeout, or stalled (no new trainer step
    for `stall_s`, counted from its start until it logs one); None when neither applies."""
    if launch.started_at is None:
        return None
    if run_timeout is not None and now - launch.started_at > run_timeout:
        return f"timeout: still running after {now - launch.started_at:.0f} s (launch.run_timeout {run_timeout:g} s)"
    last = launch.progress_at or launch.started_at
    if stall_s is not None and now - last > stall_s:
        return (f"{STALLED}: no new metric for {now - last:.0f} s (monitor.stall_s {stall_s:g} s; "
                f"last step {launch.steps_done})")
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
    # One value per step, the one logged last: a resumed run logs again the steps after its
    # checkpoint, and a store that cannot delete (an HTTP tracking server) keeps the old values too.
    return [(int(m.step), float(m.value)) for m in one_per_step(client.get_metric_history(run_id, metric))]


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


# Early-stop reasons that are properties of the configuration and seed: a re-run repeats them, so
# the seed counts as failed at once. Crashes, stalls and timeouts are re-run once.
REPEATS_ON_RERUN = ("divergence", "reward collapse", "plateau", "budget")


# A plateau stop's reason starts with this word: the run is scored at its stop step (see run_outcome).
PLATEAU = "plateau"


@dataclass(frozen=True)
class RunScore:
    """One run's contribution to its experiment: a score, or why it has none."""

    score: float | None
    reason: str = ""
    stopped_at: int | None = None  # a plateau stop: the step it was scored at
    cost: Cost | None = None  # its calls and tokens per episode, averaged over its steps (run_cost)


def run_cost(histories: dict[str, History]) -> Cost | None:
    """A run's calls and tokens per episode, each the mean over the steps it logged them; None: neither logged."""
    means = {name: statistics.fmean(v for _, v in histories[metric]) if histories.get(metric) else None
             for name, metric in COST_METRICS.items()}
    return Cost(**means) if any(v is not None for v in means.values()) else None


def run_outcome(launch: Launch, history: History | None, objective: Objective, last_step: int | None = None) -> RunScore:
    """A finished run that trained every step has a score; anything else is a failed seed.

    `last_step` is the run's last trainer step over all metrics read (an eval objective is not
    logged every step); without it the objective's own last step is used.
    """
    if launch.status == "stopped" and launch.reason.startswith(PLATEAU) and history:
        value = score(history, objective)  # the plateau is the run's end: scored there, never dropped
        if not math.isnan(value):
            return RunScore(value, launch.reason, stopped_at=history[-1][0])
    if launch.status != "finished":
        if launch.reason.startswith(launch.status):  # "stalled: no new metric ...": said once
            return RunScore(None, launch.reason)
        return RunScore(None, f"{launch.status}" + (f": {launch.reason}" if launch.reason else ""))
    if not history:
        return RunScore(None, f"finished without logging {objective.metric}")
    reached = history[-1][0] if last_step is None else max(last_step, history[-1][0])
    if reached < launch.steps:
        return RunScore(None, f"ended at step {reached} of {launch.steps}")
    value = score(history, objective)
    if math.isnan(value):
        return RunScore(None, f"{objective.metric} is not finite at the end")
    return RunScore(value)


def rerun_of(launch: Launch) -> Launch:
    """The one re-run of a failed seed: same config and seed, a new identity, queued. It resumes
    the dead run from its last checkpoint (a fresh start when it left none)."""
    return Launch(key=f"{launch.key}-rerun", proposal_id=launch.proposal_id, seed=launch.seed, steps=launch.steps,
                  config_path=launch.config_path, commit=launch.commit, attempt=1, resumes=launch.key)


# A reference arm's seed that failed its run and its resumed re-run gets one fresh run more (attempt 2):
# a verdict against a baseline that lost seeds compares fewer seeds, and every proposal judged against it
# pays for that, so the baseline is worth one more try before anything is judged against it.
REFERENCE_ATTEMPTS = 2
TIMES = {1: "twice", 2: "three times"}  # a seed's failures after its re-run (and a reference's retry)


def retry_of(launch: Launch) -> Launch:
    """A reference arm's last try for a seed: a fresh run (its resumed re-run failed too)."""
    return Launch(key=f"{launch.proposal_id}-s{launch.seed}-retry", proposal_id=launch.proposal_id, seed=launch.seed,
                  steps=launch.steps, config_path=launch.config_path, commit=launch.commit, attempt=2)


def _rerunnable(launch: Launch, reference: bool = False) -> bool:
    most = REFERENCE_ATTEMPTS if reference else 1
    return launch.attempt < most and launch.status != "skipped" and not any(
        launch.reason.startswith(r) for r in REPEATS_ON_RERUN)


def seed_table(launches: list[Launch], outcomes: dict[str, RunScore],
               reference: bool = False) -> tuple[dict[int, float], dict[int, str], list[Launch]]:
    """(seed -> score, seed -> why it failed, re-runs to queue) for one experiment's launches.

    The latest attempt of each seed counts. A seed whose first run has no score is re-run once (a
    reference arm's, twice: `REFERENCE_ATTEMPTS`); while any re-run is owed the failures are provisional.
    """
    latest: dict[int, Launch] = {}
    for x in launches:
        if x.seed not in latest or x.attempt > latest[x.seed].attempt:
            latest[x.seed] = x
    scores: dict[int, float] = {}
    failed: dict[int, str] = {}
    reruns: list[Launch] = []
    for seed, x in sorted(latest.items()):
        got = outcomes.get(x.key, RunScore(None, x.status))
        if got.score is not None:
            scores[seed] = got.score
        elif _rerunnable(x, reference):
            reruns.append(rerun_of(x) if x.attempt == 0 else retry_of(x))
        else:
            failed[seed] = (got.reason if x.attempt == 0 else f"its re-run was skipped: {x.reason}"
                            if x.status == "skipped" else f"failed {TIMES[x.attempt]}; last: {got.reason}")
    return scores, failed, reruns


def experiment_result(proposal_id: str, launches: list[Launch], outcomes: dict[str, RunScore]) -> ExperimentResult:
    """An experiment's scores over seeds (no verdict yet: that needs the round's baseline)."""
    scores, failed, _ = seed_table(launches, outcomes)
    latest: dict[int, Launch] = {}
    for x in launches:
        if x.seed not in latest or x.attempt > latest[x.seed].attempt:
            latest[x.seed] = x
    stopped = {s: got.stopped_at for s, x in latest.items()
               if s in scores and (got := outcomes.get(x.key)) is not None and got.stopped_at is not None}
    values = list(scores.values())
    summary = summarize(values)
    if scores:
        status = "ok"
    elif launches and all(x.status == "skipped" for x in launches):
        status = "skipped"
    else:
        status = "failed"
    note = "; ".join(f"seed {s}: {why}" for s, why in sorted(failed.items()))
    cost = arm_cost([got.cost for s, x in latest.items() if s in scores and (got := outcomes.get(x.key)) is not None])
    return ExperimentResult(proposal_id=proposal_id, status=status, values=values, summary=summary, note=note,
                            seed_scores=scores, failed_seeds=failed, stopped_at=stopped, cost=cost)


# The training diagnostics a curve summary carries besides the objective (DESIGN §3.6 names).
CURVE_DIAGNOSTICS = {"kl": "train/kl", "entropy": "train/entropy", "clip_frac": "train/clip_frac"}


def curve_summary(runs: list[dict[str, History]], objective: Objective) -> dict[str, float]:
    """start, end, least-squares slope per step and best step of the objective's mean curve over
    seeds, and the last mean of each diagnostic; {} when no run logged the objective."""
    curve = mean_curve([r[objective.metric] for r in runs if r.get(objective.metric)])
    if not curve:
        return {}
    steps = [float(s) for s, _ in curve]
    values = [v for _, v in curve]
    slope = float(np.polyfit(steps, values, 1)[0]) if len(curve) > 1 else 0.0
    best = max(curve, key=lambda sv: sv[1] if objective.direction == "maximize" else -sv[1])
    out = {"start": values[0], "end": values[-1], "slope": slope, "best_step": float(best[0])}
    for name, metric in CURVE_DIAGNOSTICS.items():
        tail = mean_curve([r[metric] for r in runs if r.get(metric)])
        if tail:
            out[name] = tail[-1][1]
    return out
