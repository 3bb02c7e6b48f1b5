"""MLflow telemetry for one core run: params, tags, batched metrics, sampled trajectories.

One `Telemetry` is one MLflow run. The tracking store is, in order: the config's
``tracking_uri``, ``$MLFLOW_TRACKING_URI``, then MLflow's own default ``sqlite:///mlflow.db`` in
the working folder. The experiment is created when missing. Params are the flattened run config;
metric names follow DESIGN §3.6 and are logged with ``step=`` the trainer step.

Telemetry must never stop training, and must not lose what it can keep:

- metrics are sent in one ``log_batch`` per step (one call per metric over HTTP is ~30x slower);
- a non-finite value, or a name MLflow would reject, is skipped with a warning, so one bad metric
  cannot sink the batch it came in;
- a batch the store refuses or cannot be reached for stays queued and is retried with the next
  step's batch and at ``close`` (up to ``MAX_PENDING_METRICS``; the oldest are dropped beyond that);
- trajectory artifacts are best effort: a failed upload is logged and not retried.

It uses its own ``MlflowClient`` (never ``mlflow.set_tracking_uri``), so nothing process-wide
changes, and its own random generator for sampling trajectories, so telemetry cannot shift the
training RNG. It does not read metrics back; the researcher's analysis does.
"""

from __future__ import annotations

import json
import logging
import math
import os
import posixpath
import random
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from mlflow.entities import Metric, Param
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, ErrorCode
from mlflow.tracking import MlflowClient

from core.config import TelemetryConfig
from core.records import Episode

log = logging.getLogger(__name__)

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"  # MLflow 3's own default store (DESIGN §3.6)
TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
RunStatus = Literal["FINISHED", "FAILED", "KILLED"]
END_STATUSES: tuple[RunStatus, ...] = ("FINISHED", "FAILED", "KILLED")

# What MLflow accepts as a metric key (mlflow.utils.validation, POSIX rules): checked here so a bad
# name is dropped alone instead of failing the whole batch on the server.
_METRIC_NAME = re.compile(r"^[/\w.\- :]+$")
MAX_KEY_LENGTH = 250
# MLflow's limits on param and tag values; longer values are cut (with a marker) rather than refused.
MAX_PARAM_LENGTH = 6000
MAX_TAG_LENGTH = 8000
# Metrics kept while the store is unreachable: about 500 steps of a 200-metric run, a few MB.
MAX_PENDING_METRICS = 100_000


def resolve_tracking_uri(configured: str | None) -> str:
    return configured or os.environ.get(TRACKING_URI_ENV) or DEFAULT_TRACKING_URI


def valid_metric_name(name: str) -> bool:
    return (
        bool(_METRIC_NAME.match(name))
        and len(name) <= MAX_KEY_LENGTH
        and posixpath.normpath(name) == name
        and not name.startswith(("/", ".."))
    )


def _cut(value: str, limit: int) -> str:
    marker = "...[truncated]"
    return value if len(value) <= limit else value[: limit - len(marker)] + marker


class Telemetry:
    """One MLflow run; `log` each trainer step, `close` once at the end."""

    def __init__(self, cfg: TelemetryConfig, params: Mapping[str, str], tags: Mapping[str, str]):
        self.cfg = cfg
        self.tracking_uri = resolve_tracking_uri(cfg.tracking_uri)
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        self.experiment_id = self._experiment(cfg.experiment)
        all_tags = {k: _cut(str(v), MAX_TAG_LENGTH) for k, v in {**cfg.tags, **tags}.items()}
        run = self.client.create_run(self.experiment_id, run_name=cfg.run_name, tags=all_tags)
        self.run_id: str = run.info.run_id
        self._pending: list[Metric] = []
        self._closed = False
        self.client.log_batch(
            self.run_id, params=[Param(k, _cut(str(v), MAX_PARAM_LENGTH)) for k, v in params.items()]
        )
        log.info("MLflow run %s in experiment %r at %s", self.run_id, cfg.experiment, self.tracking_uri)

    def _experiment(self, name: str) -> str:
        existing = self.client.get_experiment_by_name(name)
        if existing is not None:
            if existing.lifecycle_stage == "deleted":
                log.warning("MLflow experiment %r was deleted; restoring it", name)
                self.client.restore_experiment(existing.experiment_id)
            return existing.experiment_id
        try:
            return self.client.create_experiment(name)
        except MlflowException as e:
            # Another process created it between our look-up and create: use theirs.
            if e.error_code != ErrorCode.Name(RESOURCE_ALREADY_EXISTS):
                raise
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    # -- metrics ---------------------------------------------------------------------------------
    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Log one step's metrics in one batch; skips non-finite values and invalid names."""
        if self._closed:
            raise RuntimeError(f"telemetry run {self.run_id} is closed")
        now = int(time.time() * 1000)
        skipped: list[str] = []
        for name, value in metrics.items():
            number = _as_float(value)
            if number is None or not math.isfinite(number) or not valid_metric_name(name):
                skipped.append(name)
                continue
            self._pending.append(Metric(name, number, now, step))
        if skipped:
            log.warning("step %d: metrics not logged (non-finite value or invalid name): %s", step, sorted(skipped))
        self._flush()

    def _flush(self) -> bool:
        if not self._pending:
            return True
        try:
            self.client.log_batch(self.run_id, metrics=self._pending)
        except MlflowException as e:
            if len(self._pending) > MAX_PENDING_METRICS:
                dropped = len(self._pending) - MAX_PENDING_METRICS
                del self._pending[:dropped]
                log.error("MLflow unreachable too long: dropped the %d oldest queued metrics", dropped)
            log.warning("MLflow refused or missed %d metrics (kept for retry): %s", len(self._pending), e)
            return False
        self._pending = []
        return True

    # -- trajectories ----------------------------------------------------------------------------
    def log_trajectories(self, step: int, episodes: Sequence[Episode]) -> None:
        """A few of this step's episodes, as `trajectories/step-NNNNNNNN.jsonl` artifacts."""
        n = min(self.cfg.trajectories_per_step, len(episodes))
        if n == 0:
            return
        # Seeded by the step so reruns pick the same episodes, and separate from the global RNG.
        chosen = random.Random(step).sample(list(episodes), n)
        text = "".join(json.dumps(trajectory_record(e), default=str) + "\n" for e in chosen)
        try:
            self.client.log_text(self.run_id, text, f"trajectories/step-{step:08d}.jsonl")
        except (MlflowException, OSError) as e:
            log.warning("step %d: trajectories not uploaded: %s", step, e)

    # -- end ---------------------------------------------------------------------------------------
    def close(self, status: RunStatus = "FINISHED") -> None:
        """Flush what is queued and end the run; a second call does nothing."""
        if status not in END_STATUSES:
            raise ValueError(f"run status must be one of {END_STATUSES}, got {status!r}")
        if self._closed:
            return
        if not self._flush():
            log.error("closing MLflow run %s with %d metrics that could not be logged", self.run_id, len(self._pending))
        self.client.set_terminated(self.run_id, status)
        self._closed = True

    def __enter__(self) -> Telemetry:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: Any) -> None:
        if exc_type is None:
            self.close("FINISHED")
        else:
            self.close("KILLED" if issubclass(exc_type, KeyboardInterrupt) else "FAILED")


def _as_float(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def trajectory_record(episode: Episode) -> dict[str, Any]:
    """What a person reading a trajectory needs: messages, replies, reward and token counts."""
    return {
        "episode_id": episode.id,
        "sandbox": episode.sandbox,
        "task_id": episode.task_id,
        "client_version": episode.client_version,
        "reward": episode.reward,
        "metrics": episode.metrics,
        "prompt_tokens": sum(len(c.prompt_ids) for c in episode.calls),
        "completion_tokens": sum(len(c.completion_ids) for c in episode.calls),
        "calls": [
            {
                "model": c.model,
                "version": c.version,
                "messages": c.messages,
                "reply": c.reply,
                "finish_reason": c.finish_reason,
                "prompt_tokens": len(c.prompt_ids),
                "completion_tokens": len(c.completion_ids),
            }
            for c in episode.calls
        ],
    }
