"""`launch.backend: ray`: core runs as Ray jobs (the Jobs API) instead of local processes.

Each launch becomes one Ray job whose entrypoint is the same `swarm run` command line a local
launch spawns (`Launcher.argv`: the same tags, seed, checkpoint folder and run-id file), run from
the study's folder. The job's submission id is derived from the study and the launch key, so a
study that restarts finds the job it submitted before (adoption) instead of submitting it twice;
the intent is written before the submission, as for local runs. Status comes from the job's
status, the log from the job's logs (copied into the launch's `run.log`), a stop is `stop_job`
after the reason is recorded: Ray sends SIGTERM, and SIGKILL after `launch.grace_s`.

The cluster must see the study's folder, the `swarm` command and the MLflow store at the same
paths (shared storage), as a local launch does. This module talks to Ray's job server only; it
does not place actors (that is the core's `placement`) nor read metrics.
"""

from __future__ import annotations

import re
import shlex
import time
from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient
from ray.job_submission import JobStatus, JobSubmissionClient

from researcher.code.workspace import Workspace
from researcher.records import TERMINAL, Launch
from researcher.runs.launcher import Emit, Launcher, LaunchTarget, write_json

STOP_POLL_S = 0.5  # how often a stop looks whether the job has ended
# Ray's job server answers 500 "No available agent to submit job, please try again later" until a
# node's dashboard agent has registered: seconds after `ray start`, a minute on a busy host (seen in
# the suite at load 6-13). That answer is retried for this long, then the launch fails with it.
AGENT_WAIT_S = 120.0
AGENT_POLL_S = 1.0
NO_AGENT_YET = "No available agent"
# Environment of every job: offline model loading and quiet tokenizers, as `swarm run` expects.
JOB_ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def submission_id(study: str, key: str) -> str:
    """The job's id on the cluster: the same for the same launch, whatever process asks."""
    return _UNSAFE.sub("-", f"swarmrl-{study}-{key}")


class RayJobLauncher(Launcher):
    """A `Launcher` whose runs are Ray jobs on the cluster whose dashboard is at `address`."""

    def __init__(self, target: LaunchTarget, state_dir: Path, grace_s: float, emit: Emit,
                 workspace: Workspace | None = None, *, address: str, gpus: int = 0):
        super().__init__(target, state_dir, grace_s, emit, workspace)
        self.address, self.gpus = address, gpus
        self._jobs: JobSubmissionClient | None = None

    @property
    def jobs(self) -> JobSubmissionClient:
        if self._jobs is None:  # connects on first use, so a study that never launches never dials
            self._jobs = JobSubmissionClient(self.address)
        return self._jobs

    def _job(self, key: str) -> Any | None:
        """The job's info, or None when the cluster has no job with this launch's id."""
        try:
            return self.jobs.get_job_info(submission_id(self.target.study, key))
        except RuntimeError as e:  # the SDK's "job does not exist" (any other failure is raised)
            if "does not exist" in str(e) or "404" in str(e):
                return None
            raise

    def start(self, launch: Launch, client: MlflowClient) -> Launch:
        if launch.status in TERMINAL:
            return launch
        rd = self.run_dir(launch.key)
        sid = submission_id(self.target.study, launch.key)
        intent = self._intent(launch.key)
        try:
            submitted = intent is not None and self._job(launch.key) is not None
        except (ConnectionError, RuntimeError) as e:
            return launch.model_copy(update={"status": "failed", "ended_at": time.time(),
                                             "reason": f"cannot reach the Ray job server at {self.address}: {e}"})
        if intent is not None and submitted:  # an earlier attempt submitted it: adopt the job
            run_id = self.find_run_id(client, launch.key)
            return launch.model_copy(update={"status": "running", "run_id": run_id, "log_path": str(rd / "run.log"),
                                             "started_at": intent.get("started_at") or time.time()})
        prepared = self._record_intent(launch, rd, submission_id=sid, ray_address=self.address)
        if isinstance(prepared, Launch):
            return prepared
        argv, started = prepared
        env = {**JOB_ENV, "MLFLOW_TRACKING_URI": self.target.tracking_uri,
               "RAY_JOB_STOP_WAIT_TIME_S": str(max(int(self.grace_s), 1))}  # read by Ray's job supervisor
        waited_until = time.monotonic() + AGENT_WAIT_S
        while True:
            try:
                self.jobs.submit_job(
                    entrypoint=f"cd {shlex.quote(str(self.target.workdir))} && exec {shlex.join(argv)}",
                    submission_id=sid, runtime_env={"env_vars": env},
                    metadata={"swarmrl.study": self.target.study, "swarmrl.launch": launch.key},
                    entrypoint_num_gpus=self.gpus or None,
                )
                break
            except (RuntimeError, ConnectionError) as e:
                if NO_AGENT_YET in str(e) and time.monotonic() < waited_until:  # the server took nothing: ask again
                    time.sleep(AGENT_POLL_S)
                    continue
                return launch.model_copy(update={"status": "failed", "reason": f"could not submit the Ray job to the Ray job server at {self.address}: {e}",
                                                 "log_path": str(rd / "run.log"), "ended_at": time.time()})
        self.emit("launch.submitted", key=launch.key, submission_id=sid)
        return launch.model_copy(update={"status": "running", "started_at": started, "log_path": str(rd / "run.log")})

    def _alive(self, launch: Launch) -> tuple[bool, int | None]:
        """(alive, exit code when known): a succeeded job exited 0, a failed one 1, a stopped one unknown."""
        info = self._job(launch.key)
        if info is None:
            return False, None
        self._copy_logs(launch.key)
        status = info.status
        if status in (JobStatus.PENDING, JobStatus.RUNNING):
            return True, None
        return False, {JobStatus.SUCCEEDED: 0, JobStatus.FAILED: 1}.get(status)

    def _copy_logs(self, key: str) -> None:
        try:
            text = self.jobs.get_job_logs(submission_id(self.target.study, key))
        except RuntimeError:
            return
        (self.run_dir(key) / "run.log").write_text(text)

    def stop(self, launch: Launch, reason: str, client: MlflowClient, status: str = "stopped") -> Launch:
        if launch.status != "running":
            return launch
        intent = self._intent(launch.key) or {"key": launch.key}
        write_json(self.intents / f"{launch.key}.json", {**intent, "stop_reason": reason, "stop_status": status})
        if self._alive(launch)[0]:
            stop_job(self.address, submission_id(self.target.study, launch.key))
            while self._alive(launch)[0]:  # Ray escalates to SIGKILL after RAY_JOB_STOP_WAIT_TIME_S
                time.sleep(STOP_POLL_S)
        return self.poll(launch, client)


def stop_job(address: str, sid: str) -> bool:
    """Ask the cluster to stop a job (SIGTERM, then SIGKILL); False when it was not running."""
    try:
        return JobSubmissionClient(address).stop_job(sid)
    except RuntimeError:
        return False
