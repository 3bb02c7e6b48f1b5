"""Reading results: metric histories from MLflow, scores over seeds, and early-stop signals.

The core logs the metrics of DESIGN §3.6 with `step=` the trainer step. This module turns those
histories into one score per run, a mean with a 95% confidence interval per experiment, and the
signals the monitor stops a run on: divergence (a NaN or infinite value), reward collapse and a
plateau. Only a run that finished all its steps has a score: one stopped early (collapse,
timeout, stall, budget) or crashed counts as failed, never by its truncated tail. A seed without
a score is re-run once (unless what stopped it would happen again), and a seed that fails twice
makes the experiment `incomplete`. The verdicts against the baseline come from `decision`.
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
from researcher.lazy import lazy_module
from researcher.records import ExperimentResult, Launch, Proposal, Summary

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


@dataclass(frozen=True)
class RunScore:
    """One run's contribution to its experiment: a score, or why it has none."""

    score: float | None
    reason: str = ""


def run_outcome(launch: Launch, history: History | None, objective: Objective, last_step: int | None = None) -> RunScore:
    """A finished run that trained every step has a score; anything else is a failed seed.

    `last_step` is the run's last trainer step over all metrics read (an eval objective is not
    logged every step); without it the objective's own last step is used.
    """
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


def _rerunnable(launch: Launch) -> bool:
    return launch.attempt == 0 and launch.status != "skipped" and not any(
        launch.reason.startswith(r) for r in REPEATS_ON_RERUN)


def seed_table(launches: list[Launch], outcomes: dict[str, RunScore]) -> tuple[dict[int, float], dict[int, str],
                                                                               list[Launch]]:
    """(seed -> score, seed -> why it failed, re-runs to queue) for one experiment's launches.

    The latest attempt of each seed counts. A seed whose first run has no score is re-run once;
    while any re-run is owed the failures are provisional.
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
        elif _rerunnable(x):
            reruns.append(rerun_of(x))
        else:
            failed[seed] = (got.reason if x.attempt == 0 else f"its re-run was skipped: {x.reason}"
                            if x.status == "skipped" else f"failed twice; last: {got.reason}")
    return scores, failed, reruns


def experiment_result(proposal_id: str, launches: list[Launch], outcomes: dict[str, RunScore]) -> ExperimentResult:
    """An experiment's scores over seeds (no verdict yet: that needs the round's baseline)."""
    scores, failed, _ = seed_table(launches, outcomes)
    values = list(scores.values())
    summary = summarize(values)
    if scores:
        status = "ok"
    elif launches and all(x.status == "skipped" for x in launches):
        status = "skipped"
    else:
        status = "failed"
    note = "; ".join(f"seed {s}: {why}" for s, why in sorted(failed.items()))
    return ExperimentResult(proposal_id=proposal_id, status=status, values=values, summary=summary, note=note,
                            seed_scores=scores, failed_seeds=failed)


def config_of(p: Proposal) -> dict[str, object]:
    """What a proposal changes besides its training length."""
    return {k: v for k, v in p.overrides.items() if k != "trainer.steps"}


def is_baseline(p: Proposal, base_values: dict[str, object]) -> bool:
    """A proposal whose every override is the base config's own value, at the base commit (code never is)."""
    return p.kind == "config" and not p.needs_code_change and p.commit is None and all(base_values.get(k) == v for k, v in config_of(p).items())


def baseline_for(p: Proposal, proposals: list[Proposal], base_values: dict[str, object],
                 default_steps: int) -> Proposal | None:
    """The baseline trained as long as `p` on the same seeds: the latest such proposal."""
    steps = int(p.overrides.get("trainer.steps", default_steps))
    same = [q for q in proposals if is_baseline(q, base_values) and q.seeds == p.seeds
            and int(q.overrides.get("trainer.steps", default_steps)) == steps]
    return same[-1] if same else None


def judge(results: list[ExperimentResult], proposals: list[Proposal], base_values: dict[str, object],
          default_steps: int, objective: Objective, known: list[ExperimentResult] | None = None) -> list[ExperimentResult]:
    """Verdicts against the baseline for a batch of new results, corrected together per baseline.

    `known` are earlier results, where a baseline may already be. A round may hold experiments of different lengths (rungs); each group shares one baseline and
    one Holm–Bonferroni family. Results of baselines themselves keep `verdict=None`.
    """
    by_id = {p.id: p for p in proposals}
    every = {r.proposal_id: r for r in [*(known or []), *results]}
    groups: dict[str | None, list[ExperimentResult]] = {}
    for r in results:
        p = by_id.get(r.proposal_id)
        if p is None or is_baseline(p, base_values):
            continue
        base = baseline_for(p, proposals, base_values, default_steps)
        groups.setdefault(base.id if base else None, []).append(r)
    out = dict(every)
    for base_id, group in groups.items():
        base_result = every.get(base_id) if base_id else None
        verdicts = decision.judge_round(
            {r.proposal_id: r.seed_scores for r in group},
            base_result.seed_scores if base_result else None, objective.direction, baseline_id=base_id,
            incomplete={r.proposal_id: f"seeds without a score: {r.note}" for r in group if r.failed_seeds})
        for r in group:
            out[r.proposal_id] = r.model_copy(update={"verdict": verdicts[r.proposal_id]})
    return [out[r.proposal_id] for r in results]


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
