"""The `swarm run` and `swarm serve` processes: resume, telemetry, signals and the run's final status.

`run` wires one `CoreRun` into a process: it restores the latest checkpoint when asked and opens
the MLflow run (the checkpoint's run again on resume, `core.run.telemetry`), turns Ctrl-C and SIGTERM
into a stop after the current step, trains, checkpoints, and always ends the MLflow run with a
status: FINISHED, KILLED (stopped early) or FAILED (an exception, or the local clients crashed).
`serve` does the same around a foreground server with a trainer thread. Neither ever prints the admin
token: they print the path of the 0600 file holding it (stdout and logs are kept in world-readable
run logs; see `announce_admin_token`).
`run` also writes `<run folder>/server.json` (the folder holding `trainer.checkpoint_dir`): the URL
and the path of a 0600 admin-token file, for `swarm swap --server <run folder>` and the researcher;
removed when the run ends (`core.run.server_files.write_server_files`).

The RL loop itself lives in `core.run.loop`; this module adds no training logic.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from core.run import checkpoint
from core.episodes.auth import masked
from core.config import RunConfig
from core.config_io import flatten
from core.run.loop import CoreRun
from core.run.placement import core_run
from core.run.plan import PlacementError
from core.run.signals import on_signals
from core.serve.server import Server
from core.run.server_files import remove_server_files, write_server_files, write_token_file
from core.run.telemetry import ResumePoint, RunStatus, Telemetry, TelemetryError
from core.run.watchdog import run_folder

log = logging.getLogger(__name__)

TRAINER_JOIN_S = 60.0  # how long `swarm serve` waits for the trainer's current step when the server stops
EXIT_CODES: dict[RunStatus, int] = {"FINISHED": 0, "KILLED": 130, "FAILED": 1}  # 130: the shell's code for Ctrl-C
# `swarm serve`'s: being stopped (Ctrl-C, SIGTERM, /admin/shutdown) is how a server ends, not an error;
# a trainer that failed (too many failed steps in a row, or an exception) is.
SERVE_EXIT_CODES: dict[RunStatus, int] = {"FINISHED": 0, "KILLED": 0, "FAILED": 1}


def run(cfg: RunConfig, resume: bool = False, run_id_file: Path | None = None, progress: bool = True) -> int:
    """`swarm run`: returns the process exit code (0 done, 130 stopped early, 1 failed).

    The MLflow run ends FINISHED when every step is done; KILLED when Ctrl-C, SIGTERM or
    `/admin/shutdown` stopped it first (after the current step, with a checkpoint); FAILED on an
    exception, logged with its traceback. With `resume` it continues the checkpoint's MLflow run.
    """
    try:
        core = core_run(cfg)  # in this process, or models and clients as Ray actors (`core.run.placement`)
    except PlacementError as e:
        log.error("cannot place the run: %s", e)
        return 1
    try:
        point = _resume_point(core.resume()) if resume else None
    except checkpoint.CheckpointError as e:  # nothing has run yet: say why and stop
        log.error("cannot resume: %s", e)
        core.server.close()
        return 1
    status: RunStatus = "FAILED"
    advertised: list[Path] = []
    with on_signals(core.stop.set):  # a stop after the current step
        try:
            core.server.start()
            # <run folder>/server.json: where outside tools (`swarm swap`, the researcher) find the URL and token
            folder = run_folder(cfg.trainer.checkpoint_dir)
            advertised = write_server_files(core.server.url, core.server.admin_token, folder)
            announce_admin_token(core.server, advertised[1])
            print(f"swarm server file: {advertised[0]}", flush=True)
            log.info("serving at %s; training %d steps", core.server.url, cfg.trainer.steps)
            # Clients first, the MLflow run second: client processes take a second or two to import and
            # register, on the other core, while this one opens the run (start-up, bench/startup.py).
            # Their episodes wait in the registry; no step trains before the run exists.
            core.start_clients()
            try:
                tags = {"swarmrl.kind": "core-run", **cfg.telemetry.tags}
                core.telemetry = Telemetry(cfg.telemetry, flatten(cfg), tags, resume=point)
            except TelemetryError as e:  # no MLflow run to write a status to: say why and stop
                log.error("cannot %s: %s", "resume" if resume else "start", e)
                return 1
            if run_id_file is not None:  # the same id after a resume that reopened the run: one run per launch
                Path(run_id_file).parent.mkdir(parents=True, exist_ok=True)
                Path(run_id_file).write_text(core.telemetry.run_id)
            if progress:
                with _progress_bar(cfg.trainer.steps, core.step) as (bar, task):
                    core.train(on_step=lambda step, m: bar.update(task, completed=step, **_progress_fields(m)))
            else:
                core.train(on_step=lambda step, m: log.info("step %d reward %s", step, reward_text(m)))
            status = _outcome(core)
            core.checkpoint()  # also after a client crash: the trainer's state is sound; a fixed sandbox resumes here
        except Exception:
            log.exception("core run failed at step %d", core.step)
            status = "FAILED"
        finally:
            try:
                core.stop_clients()
                core.server.stop()
            finally:  # the run's status is written whatever happened above, so no run is left RUNNING
                remove_server_files(advertised)
                if core.telemetry is not None:
                    core.telemetry.close(status)
    return EXIT_CODES[status]


def announce_admin_token(server: Server, token_file: Path) -> None:
    """Say where the admin token is: the path of its 0600 file, never the token (a run's output is saved
    to logs others can read); masked when the config set it (the operator has it already)."""
    how = f" (from server.admin_token, {masked(server.admin_token)})" if server.cfg.server.admin_token else ""
    print(f"swarm admin token: in {token_file}, readable only by you{how}", file=sys.stdout, flush=True)


def _resume_point(saved: checkpoint.Checkpoint | None) -> ResumePoint | None:
    """Where the MLflow side of a resume starts: the checkpoint's step and run (None: a fresh start)."""
    if saved is None:
        return None
    ref = saved.mlflow
    return ResumePoint(saved.step, ref.run_id if ref else None, ref.tracking_uri if ref else None)


def _outcome(core: CoreRun) -> RunStatus:
    if core.failure is not None:
        log.error("core run failed at step %d: %s", core.step, core.failure)
        return "FAILED"
    if core.stop.is_set() and core.step < core.cfg.trainer.steps:
        log.info("stopped at step %d of %d", core.step, core.cfg.trainer.steps)
        return "KILLED"
    return "FINISHED"


def serve(cfg: RunConfig, train: bool) -> int:
    """`swarm serve`: the server in the foreground; with `train`, a trainer thread consumes finished groups.
    Returns the process exit code (`SERVE_EXIT_CODES`: 1 when its run ended FAILED, else 0).

    With a trainer, the MLflow run ends FINISHED when the trainer did all its steps before the server
    stopped; KILLED when Ctrl-C, SIGTERM or `/admin/shutdown` stopped the server first; FAILED when
    the trainer raised or `trainer.max_failed_steps` steps in a row failed (the server then stops too).
    """
    core = CoreRun(cfg, _serving_server) if train else None
    server = core.server if core is not None else Server(cfg)
    # This machine's record of the server, so `swarm swap --server URL` here finds the admin token
    # (port 0 is only known once serving: such a server gets a token file named by its pid, and is
    # swapped with --admin-token read from it).
    advertised = write_server_files(server.url, server.admin_token, None) if server.port else \
        [write_token_file(server.admin_token)]
    announce_admin_token(server, advertised[-1])
    try:
        return SERVE_EXIT_CODES[_serve(cfg, server, core)]
    finally:
        remove_server_files(advertised)


def _serving_server(cfg: RunConfig, *, on_shutdown: Callable[[], None], **hooks) -> Server:
    """The server of `swarm serve --train`: `/admin/shutdown` stops its trainer after the step and ends
    the serving too, not only the trainer."""
    def shutdown() -> None:
        on_shutdown()
        server.request_exit()

    server = Server(cfg, on_shutdown=shutdown, **hooks)
    return server


def _serve(cfg: RunConfig, server: Server, core: CoreRun | None) -> RunStatus:
    if core is None:
        # Our handler, so uvicorn's re-raised SIGTERM ends `serve_forever` and the server files go (`serve`).
        with on_signals(server.request_exit):
            server.serve_forever()
        return "KILLED"  # nothing trains: a server without a trainer only ever ends by being stopped
    core.telemetry = Telemetry(cfg.telemetry, flatten(cfg), {"swarmrl.kind": "serve", **cfg.telemetry.tags})

    def stop_serving() -> None:
        core.stop.set()
        server.request_exit()

    def train_until_stopped() -> None:
        try:
            core.train()
            if core.failure is not None:  # too many failed steps in a row: the run is over, FAILED
                server.request_exit()
            elif not core.stop.is_set():  # every step done: the server serves on, but trains nothing more
                server.registry.end_training(f"its trainer finished all {cfg.trainer.steps} steps")
                log.info("trainer done after %d steps; serving on (train episodes are refused from now)", core.step)
        except Exception as e:
            log.exception("trainer failed at step %d; stopping the server", core.step)
            core.failure = e
            server.request_exit()

    # uvicorn answers a signal by shutting down, then re-raises it to the handler it found: ours, so
    # a SIGTERM does not end the process before the run's status is written.
    thread = threading.Thread(target=train_until_stopped, daemon=True, name="trainer")
    status: RunStatus = "FAILED"
    with on_signals(stop_serving):
        try:
            thread.start()
            server.serve_forever()
            core.stop.set()
            thread.join(timeout=TRAINER_JOIN_S)
            status = _outcome(core)
        finally:
            core.stop.set()
            core.telemetry.close(status)
    return status


@contextmanager
def _progress_bar(total: int, done: int):
    columns = (TextColumn("step {task.completed}/{task.total}"), BarColumn(), TextColumn("reward {task.fields[reward]}"),
               TextColumn("{task.fields[eps]} ep/s"), TextColumn("ETA"), TimeRemainingColumn())
    with Progress(*columns) as bar:
        yield bar, bar.add_task("train", total=total, completed=done, reward="-", eps="-")


def _progress_fields(m: dict[str, float]) -> dict[str, str]:
    return {"reward": reward_text(m), "eps": f"{m.get('rollout/episodes_per_s', 0):.1f}"}


def reward_text(m: dict[str, float]) -> str:
    """A step's mean reward: `0.412`, or one per model (`drafter 0.41 reviewer 0.12`) in multi-model runs."""
    if "reward/mean" in m:
        return f"{m['reward/mean']:.3f}"
    per_model = [(k.removesuffix("/reward/mean"), v) for k, v in m.items() if k.endswith("/reward/mean")
                 and k.count("/") == 2]
    return " ".join(f"{name} {v:.3f}" for name, v in per_model) or "nan"

