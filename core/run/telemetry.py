"""MLflow telemetry for one core run: params, tags, batched metrics, sampled trajectories, resume.

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

Resuming (``resume=ResumePoint(...)``, from the checkpoint) reopens the run the checkpoint names:

- a run still ``RUNNING`` whose writing process (tag ``swarmrl.process``) is gone is first marked
  ``KILLED``; one whose process is alive is refused (``TelemetryError``), so two processes never
  write one run;
- the values logged after the checkpoint's step by the stopped process are removed
  (``core.mlflow_history.rewind``), so the run holds one value per step;
- the tag ``swarmrl.resumed`` gets the checkpoint's step appended (``"12,40"``).

When that run cannot be reopened (the checkpoint records none, it lives in another tracking store,
or it was deleted), a new run is created with ``swarmrl.resumed_from`` = the old run id, a
warning says so, and the old run's history up to the checkpoint is copied into it when the old
store can still be read. Either way one run holds the whole curve.

It uses its own ``MlflowClient`` (never ``mlflow.set_tracking_uri``), so nothing process-wide
changes, and its own random generator for sampling trajectories, so telemetry cannot shift the
training RNG. It reads metrics back only to copy a history at resume; the researcher's analysis
does the rest. It does not decide the final status: the run loop passes it to ``close``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import posixpath
import random
import re
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import psutil
from mlflow.entities import Metric, Param, Run, RunTag
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, RESOURCE_DOES_NOT_EXIST, ErrorCode
from mlflow.tracking import MlflowClient
from pydantic import BaseModel, ValidationError

from core.config import TelemetryConfig
from core.mlflow_history import canonical_uri, copy_history, rewind, store_exists
from core.records import Episode

log = logging.getLogger(__name__)

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"  # MLflow 3's own default store (DESIGN §3.6)
TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
RunStatus = Literal["FINISHED", "FAILED", "KILLED"]
END_STATUSES: tuple[RunStatus, ...] = ("FINISHED", "FAILED", "KILLED")

# Tags this module owns. The process tag tells, at resume, a run whose writer died (kill -9, power
# loss) from one that is still being written; the resume tags link the pieces of a resumed run.
PROCESS_TAG = "swarmrl.process"
RESUMED_TAG = "swarmrl.resumed"  # checkpoint steps the run was resumed at, comma-separated
RESUMED_FROM_TAG = "swarmrl.resumed_from"  # on a new run that continues one it could not reopen
# psutil reports a start time rounded to clock ticks (10 ms); a reused pid starts seconds later.
START_TIME_TOLERANCE_S = 0.5

# What MLflow accepts as a metric key (mlflow.utils.validation, POSIX rules): checked here so a bad
# name is dropped alone instead of failing the whole batch on the server.
_METRIC_NAME = re.compile(r"^[/\w.\- :]+$")
MAX_KEY_LENGTH = 250
# MLflow's limits on param and tag values; longer values are cut (with a marker) rather than refused.
MAX_PARAM_LENGTH = 6000
MAX_TAG_LENGTH = 8000
# Metrics kept while the store is unreachable: about 500 steps of a 200-metric run, a few MB.
MAX_PENDING_METRICS = 100_000


class TelemetryError(RuntimeError):
    """The run cannot be opened as asked; the message says why and what to do."""


class RunOwner(BaseModel):
    """The process writing an MLflow run, stored as JSON in the run's ``swarmrl.process`` tag."""

    host: str  # socket.gethostname() of the writing process
    pid: int  # its process id on that host
    started: float  # its start time (seconds since the epoch), so a reused pid is not taken for it

    @classmethod
    def current(cls) -> RunOwner:
        return cls(host=socket.gethostname(), pid=os.getpid(), started=psutil.Process().create_time())

    def alive(self) -> bool:
        """Whether the process still runs. One on another host cannot be checked and counts as gone."""
        if self.host != socket.gethostname():
            return False
        try:
            started = psutil.Process(self.pid).create_time()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return False
        return abs(started - self.started) <= START_TIME_TOLERANCE_S


@dataclass(frozen=True)
class ResumePoint:
    """Where a resumed core run continues: its checkpoint's step and the MLflow run it logged to."""

    step: int
    run_id: str | None  # None: the checkpoint predates recording the run
    tracking_uri: str | None  # canonical (``canonical_uri``) store URI of that run


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

    def __init__(
        self,
        cfg: TelemetryConfig,
        params: Mapping[str, str],
        tags: Mapping[str, str],
        resume: ResumePoint | None = None,
    ):
        self.cfg = cfg
        self.tracking_uri = resolve_tracking_uri(cfg.tracking_uri)
        self.store_uri = canonical_uri(self.tracking_uri)  # what a checkpoint records
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        self._pending: list[Metric] = []
        self._closed = False
        all_tags = {k: _cut(str(v), MAX_TAG_LENGTH) for k, v in {**cfg.tags, **tags}.items()}
        all_tags[PROCESS_TAG] = RunOwner.current().model_dump_json()
        all_params = {k: _cut(str(v), MAX_PARAM_LENGTH) for k, v in params.items()}
        self.run_id = ""  # set once a run is open
        try:
            if resume is None or not self._reopen(resume, all_params, all_tags):
                self.experiment_id = self._experiment(cfg.experiment)
                run = self.client.create_run(self.experiment_id, run_name=cfg.run_name, tags=all_tags)
                self.run_id = run.info.run_id
                self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in all_params.items()])
                if resume is not None:
                    self._continue(resume)
        except BaseException as e:
            if self.run_id:  # opened, then failed: never leave it RUNNING
                self.client.set_terminated(self.run_id, "KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED")
            raise
        log.info("MLflow run %s in experiment %s at %s", self.run_id, self.experiment_id, self.tracking_uri)

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

    # -- resume ----------------------------------------------------------------------------------
    def _reopen(self, resume: ResumePoint, params: dict[str, str], tags: dict[str, str]) -> bool:
        """Reopen the checkpoint's run in place; False when it cannot be (a new run follows)."""
        if resume.run_id is None:
            log.warning("the checkpoint at step %d names no MLflow run", resume.step)
            return False
        if resume.tracking_uri != self.store_uri:
            log.warning("the checkpoint's MLflow run %s is in %s, and this run logs to %s",
                        resume.run_id, resume.tracking_uri, self.store_uri)
            return False
        run = _find_run(self.client, resume.run_id)
        if run is None or run.info.lifecycle_stage == "deleted":
            log.warning("the checkpoint's MLflow run %s is %s in %s", resume.run_id,
                        "gone" if run is None else "deleted", self.store_uri)
            return False
        _settle(self.client, run)
        removed = rewind(self.tracking_uri, run.info.run_id, resume.step)
        if removed is None:
            log.warning("this tracking store cannot delete metric values: those logged after step %d by the "
                        "stopped process stay in run %s, and readers keep the last value of each step",
                        resume.step, run.info.run_id)
        elif removed:
            log.info("removed %d metric values logged after step %d by the stopped process", removed, resume.step)
        self.client.update_run(run.info.run_id, status="RUNNING")
        self.run_id, self.experiment_id = run.info.run_id, run.info.experiment_id

        old = run.data.params
        changed = sorted(k for k, v in params.items() if k in old and old[k] != v)
        if changed:  # MLflow refuses to change a logged param; the checkpoint's config has the truth
            log.warning("config changed at resume; MLflow keeps the first values of %s", changed)
        earlier = run.data.tags.get(RESUMED_TAG)
        tags = {**tags, RESUMED_TAG: f"{earlier},{resume.step}" if earlier else str(resume.step)}
        self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in params.items() if k not in old],
                              tags=[RunTag(k, v) for k, v in tags.items()])
        log.info("reopened MLflow run %s at step %d", self.run_id, resume.step)
        return True

    def _continue(self, resume: ResumePoint) -> None:
        """Link this new run to the one it continues and give it that run's history up to the checkpoint."""
        tags = {RESUMED_TAG: str(resume.step)}
        if resume.run_id is not None:
            tags[RESUMED_FROM_TAG] = resume.run_id
        self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
        log.warning("resuming at step %d in a new MLflow run %s (tag %s=%s)", resume.step, self.run_id,
                    RESUMED_FROM_TAG, resume.run_id)
        if resume.run_id is None or resume.tracking_uri is None:
            return
        if not store_exists(resume.tracking_uri):
            log.warning("the old tracking store %s is gone; the new run starts at step %d",
                        resume.tracking_uri, resume.step + 1)
            return
        try:
            old_client = MlflowClient(tracking_uri=resume.tracking_uri)
            old = _find_run(old_client, resume.run_id)
            if old is None:
                log.warning("MLflow run %s is not in %s; the new run starts at step %d",
                            resume.run_id, resume.tracking_uri, resume.step + 1)
                return
            if old.info.lifecycle_stage != "deleted":
                _settle(old_client, old)
            copy_history(old_client, resume.run_id, self.client, self.run_id, resume.step)
        except (MlflowException, TelemetryError) as e:  # unreadable, or still written: the resume goes on
            log.warning("could not copy the history of MLflow run %s: %s", resume.run_id, e)

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


def _find_run(client: MlflowClient, run_id: str) -> Run | None:
    try:
        return client.get_run(run_id)
    except MlflowException as e:
        if e.error_code != ErrorCode.Name(RESOURCE_DOES_NOT_EXIST):
            raise
        return None


def _owner(run: Run) -> RunOwner | None:
    raw = run.data.tags.get(PROCESS_TAG)
    if raw is None:
        return None  # written by a swarmrl that did not record its process
    try:
        return RunOwner.model_validate_json(raw)
    except ValidationError:
        log.warning("MLflow run %s has an unreadable %s tag: %r", run.info.run_id, PROCESS_TAG, raw)
        return None


def _settle(client: MlflowClient, run: Run) -> None:
    """A run left RUNNING by a process that is gone becomes KILLED; one whose process lives is refused."""
    if run.info.status != "RUNNING":
        return
    owner = _owner(run)
    if owner is not None and owner.alive():
        raise TelemetryError(
            f"MLflow run {run.info.run_id} is still being written by process {owner.pid} on {owner.host}; "
            "stop that process before resuming"
        )
    client.set_terminated(run.info.run_id, "KILLED")
    who = f"process {owner.pid} on {owner.host}" if owner is not None else "a process"
    log.warning("MLflow run %s was left RUNNING by %s that is gone: marked KILLED", run.info.run_id, who)


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
