"""The study's watch of its live run (researcher/runs/live_watch.py) on recorded histories, with the real launcher.

The decision is tested on recorded metric histories: a NaN loss is a divergence, a step that stops
moving for `monitor.stall_s` is a stall, spent steps or wall-clock stop the run but its being one
of `max_runs` does not. Then the watch acts, through the real `Launcher` on a real process standing
for `swarm run` (its command line carries the launch's marker): a stalled live run is stopped as
`stalled` and its still-RUNNING MLflow run closed KILLED; and a live run that died while the study
was down is billed to its log's last write, not to the moment the resumed study looked. MLflow is
a recorded history (`RecordedMlflow`), the one thing stood in for.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from mlflow.tracking import MlflowClient

from researcher.brief.schema import Brief
from researcher.budget import Spent
from researcher.records import Launch
from researcher.review.mlflow_review import ReviewBoard
from researcher.runs.launcher import Launcher, LaunchTarget, find_process
from researcher.runs.live_watch import LiveWatch, ended, in_review, progressed, trouble
from researcher.study.runner import wait_for_decisions


class RecordedMlflow:
    """MLflow as the watch reads it: recorded metric histories, a run status, and the closes asked for."""

    def __init__(self, history: dict[str, list[tuple[int, float]]], status: str = "RUNNING"):
        self.history, self.status, self.terminated = history, status, []

    def get_metric_history(self, run_id: str, metric: str):
        return [SimpleNamespace(step=s, value=v, timestamp=s) for s, v in self.history.get(metric, [])]

    def get_run(self, run_id: str):
        return SimpleNamespace(info=SimpleNamespace(status=self.status), data=SimpleNamespace(tags={}))

    def set_terminated(self, run_id: str, status: str, end_time: int | None = None) -> None:
        self.terminated.append(status)
        self.status, self.end_time = status, end_time


def brief(**sections) -> Brief:
    return Brief.model_validate({"objective": {"metric": "reward/mean"},
                                 "run": {"base_config": "base.yaml", "live": True},
                                 "search_space": {"lr": {"kind": "choice", "values": [1e-5]}}, **sections})


def healthy(steps: int) -> dict[str, list[tuple[int, float]]]:
    return {"reward/mean": [(s, 0.1 * s) for s in range(1, steps + 1)],
            "train/loss": [(s, 1.0 / s) for s in range(1, steps + 1)]}


def running(started_at: float, **update) -> Launch:
    return Launch(key="live", proposal_id="live", seed=0, steps=100_000, status="running", started_at=started_at,
                  run_id="run", **update)


def test_a_live_run_whose_loss_went_nan_is_diverged():
    now = time.time()
    history = healthy(5)
    history["train/loss"][2] = (3, math.nan)
    spent = Spent.of({"live": running(now - 60).model_dump()}, now=now)
    assert trouble(running(now - 60), history, spent, brief(), now) == "divergence: train/loss = nan at step 3"
    assert trouble(running(now - 60), healthy(5), spent, brief(), now) is None


def test_a_live_run_that_stops_logging_is_stalled_once_stall_s_passes():
    start = 1000.0
    live = progressed(running(start), last_step=7, now=start + 10)
    assert (live.steps_done, live.progress_at) == (7, start + 10)
    assert progressed(live, last_step=7, now=start + 50) == live  # no new step: progress_at stays
    watched = brief(monitor={"stall_s": 30})
    spent = Spent.of({}, now=start)
    assert trouble(live, healthy(7), spent, watched, now=start + 39) is None
    reason = trouble(live, healthy(7), spent, watched, now=start + 41)
    assert reason is not None and reason.startswith("stalled: no new metric for 31 s") and "last step 7" in reason
    assert trouble(live, healthy(7), spent, brief(), now=start + 10_000) is None  # no stall_s: no stall check


def test_a_spent_step_or_wall_clock_budget_stops_the_live_run_but_being_one_of_max_runs_does_not():
    tight = brief(budget={"max_runs": 1, "max_total_steps": 50, "wall_clock": 100})
    live = running(0.0, steps_done=30).model_dump()
    done = Launch(key="a", proposal_id="a", seed=0, steps=20, status="finished", started_at=0.0,
                  ended_at=10.0).model_dump()
    alone = Spent.of({"live": live}, now=60.0)
    assert alone.runs == 1 and alone.compute_exhausted(tight) is None  # its one run is spent, and may go on
    assert alone.exhausted(tight, llm=False) == "budget: 1 of 1 runs used"  # but no other run may start
    assert Spent.of({"live": live, "launches": [done]}, now=60.0).compute_exhausted(tight) == (
        "budget: 50 of 50 trainer steps used")
    assert Spent.of({"live": live}, now=100.0).compute_exhausted(tight) == "budget: 100 s of 100 s wall-clock used"


@pytest.fixture
def launcher(tmp_path: Path) -> Launcher:
    target = LaunchTarget(command=["swarm", "run"], workdir=tmp_path, tracking_uri="sqlite:///unused.db",
                          experiment="study-x", study="x")
    return Launcher(target, tmp_path / "state", grace_s=10, emit=lambda *a, **k: None)


@pytest.fixture
def live_process(launcher: Launcher):
    """A process standing for the live `swarm run`: its own session, its command line the launch's marker."""
    marker = str(launcher.run_dir("live") / "run_id")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", marker],
                            start_new_session=True)
    deadline = time.monotonic() + 30
    while find_process(marker) != proc.pid:  # /proc shows the new command line a moment after the spawn
        assert time.monotonic() < deadline and proc.poll() is None, "the stand-in run did not start"
        time.sleep(0.05)
    yield proc
    proc.kill()
    proc.wait()


def test_the_study_stops_a_stalled_live_run_and_closes_its_mlflow_run(launcher, live_process, tmp_path):
    started = time.time() - 120
    live = running(started, pid=live_process.pid, steps_done=7, progress_at=started + 20)
    mlflow = RecordedMlflow(healthy(7))
    watched = LiveWatch(launcher, mlflow, brief(monitor={"stall_s": 60}), emit=lambda *a, **k: None).check(live, {})
    assert live_process.wait(timeout=30) is not None  # the study stopped it
    assert watched.status == "stalled" and watched.reason.startswith("stalled: no new metric for ")
    assert "(monitor.stall_s 60 s; last step 7)" in watched.reason
    assert mlflow.terminated == ["KILLED"]
    assert ended(watched).startswith("the live run stalled: no new metric")


def test_a_resumed_study_bills_a_live_run_gone_in_a_downtime_only_to_its_last_log_write(launcher, tmp_path):
    log = launcher.run_dir("live") / "run.log"
    log.parent.mkdir(parents=True)
    log.write_text("step 40\n")
    last_write = time.time() - 3600  # it logged until an hour ago, then the machine went down
    os.utime(log, (last_write, last_write))
    gone = subprocess.Popen(["true"])
    gone.wait()
    live = running(last_write - 600, pid=gone.pid, steps_done=40, progress_at=last_write)
    state = {"live": live.model_dump()}
    assert Spent.of(state).wall_s > 4000  # what it would bill, read as still running
    mlflow = RecordedMlflow(healthy(40))
    after = LiveWatch(launcher, mlflow, brief(), emit=lambda *a, **k: None).check(live, state)
    assert after.status == "failed" and abs(after.ended_at - last_write) < 1
    assert abs(Spent.of({"live": after.model_dump()}).wall_s - 600) < 1
    assert mlflow.terminated == ["FAILED"]


def _wait_in_review(tmp_path: Path, watch, stop: threading.Event, limit_s: float):
    """The study's review wait on a real (empty) review board: nobody decides, so only `stop` ends it."""
    board = ReviewBoard(MlflowClient(f"sqlite:///{tmp_path}/mlflow.db"), "study-x", "x")
    timer = threading.Timer(limit_s, stop.set)  # a watch that never acts fails the test, never hangs it
    timer.start()
    try:
        return wait_for_decisions(board, ["r1-1"], 0.1, stop, [], lambda *a, **k: None, watch)
    finally:
        timer.cancel()


def test_a_live_run_that_stalls_while_the_study_waits_for_a_person_is_stopped_in_the_wait(
        launcher, live_process, tmp_path):
    started = time.time() - 120
    live = running(started, pid=live_process.pid, steps_done=7, progress_at=started + 20)
    stop, events = threading.Event(), []

    def emit(kind: str, **fields) -> None:
        events.append(kind)
        if kind == "live.ended":
            stop.set()

    watch = in_review(LiveWatch(launcher, RecordedMlflow(healthy(7)), brief(monitor={"stall_s": 60}), emit),
                      {"live": live.model_dump()}, every_s=0.1)
    assert _wait_in_review(tmp_path, watch, stop, limit_s=60) is None
    assert "live.ended" in events and live_process.wait(timeout=30) is not None
    after = launcher.poll(live, RecordedMlflow(healthy(7)))  # what the first node after the review reads
    assert after.status == "stalled" and after.reason.startswith("stalled: no new metric for ")


def test_a_live_run_that_trains_on_during_a_long_review_is_left_running(launcher, live_process, tmp_path):
    # The state frozen at the interrupt says step 7, 100 s ago (past stall_s); MLflow shows step 9 now.
    started = time.time() - 600
    live = running(started, pid=live_process.pid, steps_done=7, progress_at=time.time() - 100)
    events = []
    watch = in_review(LiveWatch(launcher, RecordedMlflow(healthy(9)), brief(monitor={"stall_s": 60}),
                                lambda kind, **f: events.append(kind)), {"live": live.model_dump()}, every_s=0.1)
    assert _wait_in_review(tmp_path, watch, threading.Event(), limit_s=2) is None
    assert live_process.poll() is None and "live.stopping" not in events
    assert in_review(LiveWatch(launcher, RecordedMlflow({}), brief(), lambda *a, **k: None), {}, 1.0) is None
