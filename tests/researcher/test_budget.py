"""Budget: compute is the time runs ran, a downtime with nothing running is free, and the live run counts."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from mlflow.tracking import MlflowClient

from researcher.budget import Spent
from researcher.records import Launch
from researcher.runs.launcher import Launcher, LaunchTarget, last_alive
from tests.researcher.harness import empty_store


def launch(key: str, start: float, end: float | None, steps: int = 10, status: str = "finished") -> dict:
    return Launch(key=key, proposal_id=key, seed=0, steps=steps, status=status, started_at=start,
                  ended_at=end).model_dump()


def test_a_downtime_in_which_nothing_ran_costs_no_compute():
    # A round began at 0; the machine was down from 100 to 1000; the resumed study ran one more run.
    state = {"launches": [launch("a", 0, 100), launch("b", 1000, 1100)], "round_started": 0.0, "compute_s": 0.0}
    assert Spent.of(state, now=1100).wall_s == 200


def test_runs_side_by_side_count_their_time_once():
    state = {"launches": [launch("a", 0, 100), launch("b", 50, 120), launch("c", 200, None, status="running")]}
    assert Spent.of(state, now=230).wall_s == 120 + 30


def test_the_live_runs_steps_and_time_count_against_the_budget():
    live = {**launch("live", 500, None, steps=10_000, status="running"), "steps_done": 42}
    state = {"launches": [launch("a", 0, 100)], "live": live}
    spent = Spent.of(state, now=600)
    assert spent.wall_s == 200 and spent.steps == 10 + 42


def test_a_run_found_gone_after_a_reboot_ends_at_its_last_log_write(tmp_path: Path):
    log = tmp_path / "run.log"
    log.write_text("step 3\n")
    written = time.time() - 3600  # the run last logged an hour ago, then the machine went down
    os.utime(log, (written, written))
    gone = Launch(key="a", proposal_id="a", seed=0, steps=10, status="running", started_at=written - 60)
    assert abs(last_alive(gone, log) - written) < 1
    assert last_alive(gone, tmp_path / "missing.log") >= time.time() - 5  # no log: now, the best we know


def test_a_run_killed_in_a_reboot_is_closed_in_mlflow_at_its_last_log_write(tmp_path: Path):
    # Found building bench/soak.py's books: MLflow ended such a run when the resumed study noticed, not when it died,
    # so its MLflow run time included the downtime the budget rightly leaves out.
    shutil.copyfile(empty_store(), tmp_path / "mlflow.db")
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = client.create_run(client.create_experiment("study-s")).info.run_id
    target = LaunchTarget(command=["swarm", "run"], workdir=tmp_path, tracking_uri="", experiment="study-s", study="s")
    launcher = Launcher(target, tmp_path / ".study", grace_s=0, emit=lambda *a, **k: None)
    log = launcher.run_dir("a") / "run.log"
    log.parent.mkdir(parents=True)
    log.write_text("step 1\n")
    written = time.time() - 3600
    os.utime(log, (written, written))
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs the launch
    gone = Launch(key="a", proposal_id="a", seed=0, steps=10, status="running", started_at=written - 60,
                  pid=dead.pid, run_id=run_id)
    polled = launcher.poll(gone, client)
    assert polled.status == "failed" and abs(polled.ended_at - written) < 1
    closed = client.get_run(run_id).info
    assert closed.status == "FAILED" and abs(closed.end_time / 1000 - written) < 1
