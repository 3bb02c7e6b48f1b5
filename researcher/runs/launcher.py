"""Starting, finding and stopping core runs (`swarm run` subprocesses), idempotently.

A launch writes its intent (argv, marker) to `.study/launches/<key>.json` before it spawns, and
the pid right after. Asked again for the same key (a resumed study re-running its launch node),
it first looks for what it already started: the recorded pid, any process whose command line
carries the launch's unique run-id-file path (the window between spawn and writing the pid), or
an MLflow run tagged with the key. Only when none exists does it spawn. Core runs get their own
session, so they outlive a killed study and are adopted on resume.

A launch with a `commit` runs the sandbox code of the study's workspace at that commit: the
launcher checks it out into `runs/<key>/code/` (a folder of the run's own, so runs of different
code never collide) before spawning, and tags the run `swarmrl.sandbox_version=<commit>`. Such a run's
environment holds none of the study's secrets (LLM API keys, the admin token, cloud credentials;
`run_env`) but the MLflow tracking ones its telemetry needs, and its client processes, which run that
code, start contained (`--set containment.clients=...`, `contain_mode`): `required`, so a run that lands
where bubblewrap is missing refuses to start rather than run proposal code without its boundaries, unless
the brief sets `containment: auto` on purpose; then, without bubblewrap, `auto` (allowlisted environment
and limits) with a warning that says what is lost (`AUTO_LOSS`). A launch without a commit runs the person's own config and code as is.

A finished run is judged by its exit code when it is our child, else by its MLflow run status.
A stop records its reason in the intent before it signals, so a stop cut short by a crash is
still reported as a stop, with the status the stop asked for (`stopped`, or `stalled` for a hang).
A run that ends stopped, stalled or failed while its MLflow run still reads RUNNING (killed before
it could close it) is set to KILLED (stopped, stalled) or FAILED, ending at its last sign of life. Linux only (/proc). It does not read metrics or decide anything.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from mlflow.entities import ViewType
from mlflow.tracking import MlflowClient

from core.config import ContainMode
from core.config_io import is_secret
from researcher.records import TERMINAL, Launch
from researcher.code.sealed import SealError, verify
from researcher.code.workspace import Workspace, WorkspaceError

log = logging.getLogger(__name__)

# Lines of a failed run's log kept in the study state and report.
LOG_TAIL_LINES = 40
# How often a stop checks whether the run has exited before escalating to SIGKILL.
_STOP_POLL_S = 0.2

Emit = Callable[..., None]
WARM_ENV = "SWARMRL_WARM"  # the `swarm warm` socket a `swarm run` forks from (core.run.warm.ENV)
# Paths (":"-separated) the core masks in every client it contains (core.contain.contained.HIDE_ENV).
CONTAIN_HIDE_ENV = "SWARMRL_CONTAIN_HIDE"


@dataclass(frozen=True)
class LaunchTarget:
    """Where and how core runs start."""

    command: list[str]  # e.g. [".venv/bin/swarm", "run"]
    workdir: Path  # the project folder the study started in: relative config paths resolve here
    tracking_uri: str
    experiment: str
    study: str
    containment: Literal["required", "auto"] = "required"  # the brief's `containment`: see `contain_mode`
    warm: str | None = None  # the study's `swarm warm` socket (researcher.runs.warm); None: as the environment says
    # What the contained clients of its runs and swaps must not read: the study's state and MLflow store
    # (study.store.private_paths). The core masks what `CONTAIN_HIDE_ENV` lists in every client it contains.
    hidden: tuple[Path, ...] = ()
    # The study's sealed judges (researcher.code.sealed): every run gets them as `server.judges_dir`, so every
    # arm is scored by the judge the study sealed at its start, never by one in the code the run checks out.
    # None: the runs' own sandbox folders (a study that edits no code runs the person's code as is).
    judges: Path | None = None


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write an intent record durably (fsynced, then renamed): what was about to act survives a kill -9."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    tmp.replace(path)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def find_process(marker: str) -> int | None:
    """The pid of a live process whose command line contains `marker`."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and marker in _cmdline(int(entry.name)):
            return int(entry.name)
    return None


def _config_tags(config_path: str) -> dict[str, str]:
    try:
        data = yaml.safe_load(Path(config_path).read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {}
    return {str(k): str(v) for k, v in ((data.get("telemetry") or {}).get("tags") or {}).items()}


def log_tail(path: str | Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def hide_env(hidden: Sequence[Path]) -> dict[str, str]:
    """`CONTAIN_HIDE_ENV` naming `hidden`, for a `swarm run` or `swarm swap` whose clients are contained."""
    return {CONTAIN_HIDE_ENV: ":".join(str(p) for p in hidden)} if hidden else {}


def run_env(commit: str | None, tracking_uri: str, warm: str | None = None,
            hidden: Sequence[Path] = ()) -> dict[str, str]:
    """The environment of a core run. A run of a proposal's code (a `commit`) gets none of the study's
    secrets but the MLflow tracking ones its telemetry needs: its clients inherit it and run that code.
    `warm`: the study's `swarm warm` socket (researcher.runs.warm), which the run forks from.
    `hidden`: what its contained clients must not read (`hide_env`)."""
    env = {**os.environ, "MLFLOW_TRACKING_URI": tracking_uri, **({WARM_ENV: warm} if warm else {}),
           **hide_env(hidden)}
    if commit:
        env = {k: v for k, v in env.items() if not is_secret(k) or k.startswith("MLFLOW_TRACKING_")}
    return env


# What a run of proposal code gives up without bubblewrap (brief `containment: auto`), in the warning it logs.
AUTO_LOSS = ("bubblewrap (bwrap) is not on PATH and the brief sets `containment: auto`: proposal code runs without "
             "the filesystem, network and pid boundaries. It keeps the environment allowlist and resource limits, "
             "but it can read every file this user can (the study's state, MLflow's store, other runs' tokens), "
             "reach any port (MLflow among them), and, with no pid namespace of its own, read a parent's "
             "environment in /proc/<pid>/environ (the study's secrets); as root, the process limit does not "
             "hold either. Install bubblewrap (apt-get install bubblewrap) to contain it")
_warned_auto = False


def contain_mode(brief_mode: Literal["required", "auto"] = "required") -> ContainMode:
    """How proposal code is contained (module docstring): `required` (bubblewrap or refuse) unless the brief set
    `containment: auto` on purpose and bubblewrap is missing here; that downgrade is logged once, saying what it
    loses (`AUTO_LOSS`)."""
    global _warned_auto
    if brief_mode == "required" or shutil.which("bwrap"):
        return "required"
    if not _warned_auto:
        log.warning(AUTO_LOSS)
        _warned_auto = True
    return "auto"


class Launcher:
    def __init__(self, target: LaunchTarget, state_dir: Path, grace_s: float, emit: Emit,
                 workspace: Workspace | None = None) -> None:
        self.target, self.grace_s, self.emit, self.workspace = target, grace_s, emit, workspace
        self.intents = state_dir / "launches"
        self.runs = state_dir / "runs"
        self.intents.mkdir(parents=True, exist_ok=True)
        self._children: dict[str, subprocess.Popen[bytes]] = {}

    def run_dir(self, key: str) -> Path:
        return self.runs / key

    def _record_intent(self, launch: Launch, rd: Path, **extra: Any) -> tuple[list[str], float] | Launch:
        """Check the launch's code out and write its intent, before anything starts: (argv, start time),
        or the launch failed at checkout."""
        rd.mkdir(parents=True, exist_ok=True)
        if self.target.judges is not None:
            try:
                verify(self.target.judges)
            except SealError as e:
                return launch.model_copy(update={"status": "failed", "reason": f"not started: {e}",
                                                 "ended_at": time.time()})
        failed = self._check_out(launch, rd)
        if failed is not None:
            return failed
        argv, started = self.argv(launch), time.time()
        write_json(self.intents / f"{launch.key}.json", {"key": launch.key, "argv": argv, "started_at": started, **extra})
        self.emit("launch.intent", key=launch.key)
        return argv, started

    def _check_out(self, launch: Launch, rd: Path) -> Launch | None:
        """Write a code proposal's commit to `rd/code` (its runs use exactly that code); the failed launch if it cannot."""
        if launch.commit and self.workspace is not None:
            try:
                self.workspace.checkout(launch.commit, rd / "code")
            except WorkspaceError as e:
                return launch.model_copy(update={"status": "failed", "reason": f"could not check out the code: {e}",
                                                 "ended_at": time.time()})
        return None

    def argv(self, launch: Launch) -> list[str]:
        rd, t = self.run_dir(launch.key), self.target
        # Tags go in as one `telemetry.tags` mapping rather than `--tag k=v`: the dotted tag names of
        # the telemetry contract (swarmrl.study) would otherwise be split into nested config keys.
        tags = {**_config_tags(launch.config_path), "swarmrl.study": t.study, "swarmrl.proposal": launch.proposal_id,
                "swarmrl.launch": launch.key, "swarmrl.seed": str(launch.seed)}
        contained: list[str] = []
        if t.judges is not None:
            contained += ["--set", f"server.judges_dir={t.judges}"]
        if launch.commit:
            tags["swarmrl.sandbox_version"] = launch.commit
            contained += ["--set", f"containment.clients={contain_mode(t.containment)}"]  # its clients run proposal code
        # A re-run of a dead run continues from that run's checkpoints (and its MLflow run).
        checkpoints = self.run_dir(launch.resumes or launch.key) / "checkpoints"
        return [*t.command, launch.config_path,
                "--set", f"trainer.seed={launch.seed}",
                "--set", "server.port=0",  # concurrent runs must not fight over one port
                "--set", f"trainer.checkpoint_dir={checkpoints}",
                "--set", f"telemetry.tags={json.dumps(tags)}", *contained,
                "--experiment", t.experiment, "--run-name", launch.key,
                "--run-id-file", str(rd / "run_id"), "--quiet", *(["--resume"] if launch.resumes else [])]

    def _intent(self, key: str) -> dict[str, Any] | None:
        path = self.intents / f"{key}.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def _marker(self, key: str) -> str:
        return str(self.run_dir(key) / "run_id")

    def find_run_id(self, client: MlflowClient, key: str) -> str | None:
        path = self.run_dir(key) / "run_id"
        if path.is_file() and path.read_text().strip():
            return path.read_text().strip()
        exp = client.get_experiment_by_name(self.target.experiment)
        if exp is None:
            return None
        runs = client.search_runs([exp.experiment_id], run_view_type=ViewType.ALL,
                                  filter_string=f"tags.`swarmrl.launch` = '{key}' AND "
                                                f"tags.`swarmrl.study` = '{self.target.study}'")
        return runs[0].info.run_id if runs else None

    def start(self, launch: Launch, client: MlflowClient) -> Launch:
        """Start the run, or adopt the one an earlier attempt started. Never starts it twice."""
        if launch.status in TERMINAL:
            return launch
        intent = self._intent(launch.key)
        if intent is not None:
            pid = intent.get("pid") or find_process(self._marker(launch.key))
            run_id = self.find_run_id(client, launch.key)
            if pid or run_id:
                log.info("launch %s: adopting what an earlier attempt started (pid %s, run %s)",
                         launch.key, pid, run_id)
                return launch.model_copy(update={"status": "running", "pid": pid, "run_id": run_id,
                                                 "started_at": intent.get("started_at") or time.time()})
        rd = self.run_dir(launch.key)
        prepared = self._record_intent(launch, rd)
        if isinstance(prepared, Launch):
            return prepared
        argv, started = prepared
        env = run_env(launch.commit, self.target.tracking_uri, self.target.warm, self.target.hidden)
        with open(rd / "run.log", "ab") as logfile:
            try:
                proc = subprocess.Popen(argv, cwd=self.target.workdir, stdout=logfile, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=env, start_new_session=True)
            except OSError as e:
                return launch.model_copy(update={"status": "failed", "reason": f"could not start {argv[0]}: {e}",
                                                 "log_path": str(rd / "run.log"), "ended_at": time.time()})
        write_json(self.intents / f"{launch.key}.json",
                    {"key": launch.key, "argv": argv, "started_at": started, "pid": proc.pid})
        self._children[launch.key] = proc
        self.emit("launch.spawned", key=launch.key, pid=proc.pid)
        return launch.model_copy(update={"status": "running", "pid": proc.pid, "started_at": started,
                                         "log_path": str(rd / "run.log")})

    def _alive(self, launch: Launch) -> tuple[bool, int | None]:
        """(alive, exit code when known)."""
        proc = self._children.get(launch.key)
        if proc is not None:
            code = proc.poll()
            return code is None, code
        pid = launch.pid or find_process(self._marker(launch.key))
        return (pid is not None and self._marker(launch.key) in _cmdline(pid)), None

    def poll(self, launch: Launch, client: MlflowClient) -> Launch:
        """Refresh a running launch: its MLflow run id, and whether and how it ended."""
        if launch.status != "running":
            return launch
        alive, code = self._alive(launch)
        run_id = launch.run_id or self.find_run_id(client, launch.key)
        update: dict[str, Any] = {"run_id": run_id, "log_path": str(self.run_dir(launch.key) / "run.log")}
        if alive:
            return launch.model_copy(update=update)
        intent = self._intent(launch.key) or {}
        mlflow_status = client.get_run(run_id).info.status if run_id else None
        update["ended_at"] = last_alive(launch, Path(update["log_path"]))
        if intent.get("stop_reason"):
            update.update(status=intent.get("stop_status", "stopped"), reason=intent["stop_reason"],
                          log_tail=log_tail(update["log_path"]))
        elif code == 0 or (code is None and mlflow_status == "FINISHED"):
            update.update(status="finished")
        else:
            why = f"exit code {code}" if code is not None else "the process is gone"
            update.update(status="failed", reason=f"{why}; MLflow run status {mlflow_status or '(no run)'}",
                          log_tail=log_tail(update["log_path"]))
        if run_id and mlflow_status == "RUNNING" and update.get("status") in ("stopped", "stalled", "failed"):
            # A run killed before it could close its MLflow run would read RUNNING forever. It ends at its
            # last sign of life, as the budget has it, not when a resumed study noticed (after a reboot: hours).
            client.set_terminated(run_id, status="FAILED" if update["status"] == "failed" else "KILLED",
                                  end_time=int(update["ended_at"] * 1000))
        self._children.pop(launch.key, None)
        return launch.model_copy(update=update)

    def stop(self, launch: Launch, reason: str, client: MlflowClient, status: str = "stopped") -> Launch:
        """Record why (and the status it ends with: `stopped` or `stalled`), then SIGTERM the run's
        process group; SIGKILL after the grace period."""
        if launch.status != "running":
            return launch
        intent = self._intent(launch.key) or {"key": launch.key}
        write_json(self.intents / f"{launch.key}.json", {**intent, "stop_reason": reason, "stop_status": status})
        alive, _ = self._alive(launch)
        pid = launch.pid or find_process(self._marker(launch.key))
        if alive and pid:
            self._signal(pid, signal.SIGTERM)
            deadline = time.monotonic() + self.grace_s
            while self._alive(launch)[0] and time.monotonic() < deadline:
                time.sleep(_STOP_POLL_S)
            if self._alive(launch)[0]:
                self._signal(pid, signal.SIGKILL)
                while self._alive(launch)[0]:
                    time.sleep(_STOP_POLL_S)
        return self.poll(launch, client)

    @staticmethod
    def _signal(pid: int, sig: signal.Signals) -> None:
        try:
            os.killpg(pid, sig)  # the run is its own session leader: this reaches its workers too
        except ProcessLookupError:
            pass


def stop_local(path: Path, intent: dict[str, Any], reason: str, grace_s: float) -> bool:
    """Stop the local run of one launch intent (for `researcher study stop --kill-runs`): the reason is
    written first, so the study reports the run as stopped when it resumes. False: it was not running."""
    marker = str(path.parent.parent / "runs" / intent["key"] / "run_id")
    pid = intent.get("pid") or find_process(marker)
    if not pid or marker not in _cmdline(pid):
        return False
    write_json(path, {**intent, "stop_reason": reason})
    Launcher._signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while marker in _cmdline(pid) and time.monotonic() < deadline:
        time.sleep(_STOP_POLL_S)
    if marker in _cmdline(pid):
        Launcher._signal(pid, signal.SIGKILL)
    return True


def last_alive(launch: Launch, log: Path) -> float:
    """When a run that is gone was last known to run: its log's last write (a run logs as it goes),
    so a run that died in a reboot does not bill the downtime before the study resumed and noticed."""
    try:
        seen = log.stat().st_mtime
    except OSError:
        seen = time.time()
    return max(launch.started_at if launch.started_at is not None else seen, min(seen, time.time()))
