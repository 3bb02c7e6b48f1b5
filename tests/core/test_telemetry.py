"""Telemetry against real MLflow stores: a sqlite file, and a real `mlflow server` over HTTP.

Also resuming at this level: reopening a run, settling one left RUNNING, the fallbacks to a new
linked run. `test_resume_mlflow.py` drives the same through `swarm run --resume`.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from mlflow.tracking import MlflowClient

from core.config import TelemetryConfig
from core.mlflow_history import canonical_uri, one_per_step
from core.records import Call, Episode
from core.run.telemetry import (
    MAX_PARAM_LENGTH,
    PROCESS_TAG,
    RESUMED_FROM_TAG,
    RESUMED_TAG,
    ResumePoint,
    RunOwner,
    Telemetry,
    TelemetryError,
)

SERVER_START_TIMEOUT_S = 120.0  # a cold `mlflow server` on a busy 2-core machine takes a while


def episode(i: int) -> Episode:
    call = Call(
        model="policy",
        version=3,
        messages=[{"role": "user", "content": f"task {i}"}],
        prompt_ids=[1, 2, 3],
        completion_ids=[4, 5],
        completion_logprobs=[-0.5, -0.25],
        reply={"role": "assistant", "content": "ok"},
    )
    return Episode(
        id=f"ep{i}", sandbox="math", task_id=f"t{i}", group_size=2, state="finished",
        opened_at=0.0, lease_expires_at=60.0, calls=[call, call], reward={"policy": float(i)},
    )


def history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def exercise(cfg: TelemetryConfig) -> tuple[MlflowClient, str]:
    """A short run: params, tags, three steps of metrics (one NaN), trajectories, FINISHED."""
    params = {"trainer.lr": "0.001", "models.0.name": "policy"}
    telemetry = Telemetry(cfg, params, {"swarmrl.kind": "core-run"})
    for step in (1, 2, 3):
        kl = float("nan") if step == 2 else 0.0
        telemetry.log(step, {"reward/mean": step / 10, "train/loss": 1.0 / step, "train/kl": kl})
    telemetry.log_trajectories(3, [episode(i) for i in range(10)])
    telemetry.close("FINISHED")
    return MlflowClient(tracking_uri=telemetry.tracking_uri), telemetry.run_id


@pytest.fixture(scope="module")
def sqlite_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One store for the module's sqlite tests: creating a store runs MLflow's migrations (seconds)."""
    return f"sqlite:///{tmp_path_factory.mktemp('store')}/m.db"


@pytest.fixture(autouse=True)
def _artifacts_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # a sqlite store puts artifacts under ./mlruns


def check_run(client: MlflowClient, run_id: str, tmp_path: Path) -> None:
    assert history(client, run_id, "reward/mean") == [(1, 0.1), (2, 0.2), (3, pytest.approx(0.3))]
    assert history(client, run_id, "train/kl") == [(1, 0.0), (3, 0.0)]  # the NaN was skipped, not stored
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"trainer.lr": "0.001", "models.0.name": "policy"}
    assert run.data.tags["swarmrl.kind"] == "core-run"
    assert run.data.tags["swarmrl.study"] == "s1"  # from the config's tags
    local = client.download_artifacts(run_id, "trajectories/step-00000003.jsonl", str(tmp_path))
    records = [json.loads(line) for line in Path(local).read_text().splitlines()]
    assert len(records) == 4  # trajectories_per_step
    first = records[0]
    assert first["reward"]["policy"] in range(10)
    assert (first["prompt_tokens"], first["completion_tokens"]) == (6, 4)
    assert first["calls"][0]["messages"][0]["content"].startswith("task")


def test_metrics_params_tags_and_trajectories_land_in_a_sqlite_store(sqlite_uri: str, tmp_path: Path):
    cfg = TelemetryConfig(tracking_uri=sqlite_uri, experiment="exp", tags={"swarmrl.study": "s1"})
    client, run_id = exercise(cfg)
    check_run(client, run_id, tmp_path)


@pytest.mark.slow
def test_the_store_comes_from_the_environment_then_the_default_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/env.db")
    from_env = Telemetry(TelemetryConfig(), {}, {})
    from_env.close()
    assert from_env.tracking_uri == f"sqlite:///{tmp_path}/env.db"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    default = Telemetry(TelemetryConfig(experiment="swarmrl"), {}, {})
    default.close()
    assert default.tracking_uri == "sqlite:///mlflow.db" and (tmp_path / "mlflow.db").is_file()


def test_runs_share_an_existing_experiment(sqlite_uri: str):
    cfg = TelemetryConfig(tracking_uri=sqlite_uri, experiment="shared", run_name="a")
    first, second = Telemetry(cfg, {}, {}), Telemetry(cfg, {}, {})
    assert first.experiment_id == second.experiment_id and first.run_id != second.run_id
    first.close(), second.close("KILLED")
    assert first.client.get_run(second.run_id).info.status == "KILLED"
    assert first.client.get_run(first.run_id).info.run_name == "a"


def test_bad_metrics_are_dropped_alone_and_long_params_are_cut(sqlite_uri: str, caplog: pytest.LogCaptureFixture):
    cfg = TelemetryConfig(tracking_uri=sqlite_uri)
    telemetry = Telemetry(cfg, {"clients.0.agent": "x" * (MAX_PARAM_LENGTH + 50)}, {})
    with caplog.at_level(logging.WARNING, logger="core.run.telemetry"):
        telemetry.log(1, {"reward/mean": 1.0, "bad name!": 2.0, "../escape": 3.0, "train/loss": "n/a", "train/kl": 0.5})
    assert "bad name!" in caplog.text and "../escape" in caplog.text
    run = telemetry.client.get_run(telemetry.run_id)
    assert run.data.metrics == {"reward/mean": 1.0, "train/kl": 0.5}
    assert len(run.data.params["clients.0.agent"]) == MAX_PARAM_LENGTH
    telemetry.close()


def test_closing_is_idempotent_and_checks_its_status(sqlite_uri: str):
    telemetry = Telemetry(TelemetryConfig(tracking_uri=sqlite_uri), {}, {})
    with pytest.raises(ValueError, match="run status must be one of"):
        telemetry.close("DONE")  # type: ignore[arg-type]
    telemetry.close("FAILED")
    telemetry.close("FINISHED")
    assert telemetry.client.get_run(telemetry.run_id).info.status == "FAILED"
    with pytest.raises(RuntimeError, match="closed"):
        telemetry.log(1, {"reward/mean": 1.0})


def test_a_failing_block_marks_the_run_failed(sqlite_uri: str):
    with pytest.raises(ZeroDivisionError):
        with Telemetry(TelemetryConfig(tracking_uri=sqlite_uri), {}, {}) as telemetry:
            1 / 0
    assert telemetry.client.get_run(telemetry.run_id).info.status == "FAILED"


# -- resuming -------------------------------------------------------------------------------------
def abandon(telemetry: Telemetry) -> None:
    """What `kill -9` leaves: the run RUNNING, its writing process gone (a real process that exited)."""
    proc = subprocess.Popen(["sleep", "60"])
    owner = RunOwner(host=socket.gethostname(), pid=proc.pid, started=psutil.Process(proc.pid).create_time())
    proc.kill()
    proc.wait()
    telemetry.client.set_tag(telemetry.run_id, PROCESS_TAG, owner.model_dump_json())


def at(telemetry: Telemetry, step: int) -> ResumePoint:
    return ResumePoint(step=step, run_id=telemetry.run_id, tracking_uri=telemetry.store_uri)


def steps_and_values(client: MlflowClient, run_id: str, key: str = "reward/mean") -> list[tuple[int, float]]:
    """The full history as stored: a step logged twice shows up twice."""
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_resume_reopens_the_run_and_keeps_one_value_per_step(sqlite_uri: str, caplog: pytest.LogCaptureFixture):
    cfg = TelemetryConfig(tracking_uri=sqlite_uri, experiment="resume")
    first = Telemetry(cfg, {"trainer.lr": "0.1"}, {})
    for step in range(1, 6):
        first.log(step, {"reward/mean": step / 10, "train/loss": 1.0})
    first.log(5, {"late/metric": 1.0})  # a key that exists only after the checkpoint
    abandon(first)  # checkpoint at step 3; steps 4 and 5 were logged, then the process died

    with caplog.at_level(logging.INFO, logger="core.run.telemetry"):
        second = Telemetry(cfg, {"trainer.lr": "0.1", "trainer.steps": "8"}, {}, resume=at(first, 3))
    assert second.run_id == first.run_id
    assert f"MLflow run {first.run_id} was left RUNNING by process" in caplog.text and "marked KILLED" in caplog.text
    run = second.client.get_run(second.run_id)
    assert run.info.status == "RUNNING"
    assert run.data.metrics == {"reward/mean": 0.3, "train/loss": 1.0}  # latest values rewound to step 3
    assert run.data.params == {"trainer.lr": "0.1", "trainer.steps": "8"}
    for step in (4, 5):
        second.log(step, {"reward/mean": step})
    second.close("KILLED")  # Ctrl-C at step 5, with a checkpoint there

    third = Telemetry(cfg, {"trainer.lr": "0.1"}, {}, resume=at(second, 5))
    third.log(6, {"reward/mean": 6.0})
    third.close()
    run = third.client.get_run(third.run_id)
    assert (third.run_id, run.info.status, run.data.tags[RESUMED_TAG]) == (first.run_id, "FINISHED", "3,5")
    assert steps_and_values(third.client, third.run_id) == [(1, 0.1), (2, 0.2), (3, pytest.approx(0.3)),
                                                            (4, 4.0), (5, 5.0), (6, 6.0)]
    assert steps_and_values(third.client, third.run_id, "late/metric") == []


def test_a_run_whose_process_still_lives_is_not_reopened(sqlite_uri: str):
    cfg = TelemetryConfig(tracking_uri=sqlite_uri, experiment="resume")
    live = Telemetry(cfg, {}, {})  # its process, this one, is alive
    live.log(1, {"reward/mean": 1.0})
    live.log(2, {"reward/mean": 2.0})
    with pytest.raises(TelemetryError, match=f"still being written by process {os.getpid()}"):
        Telemetry(cfg, {}, {}, resume=at(live, 1))
    assert live.client.get_run(live.run_id).info.status == "RUNNING"
    assert steps_and_values(live.client, live.run_id) == [(1, 1.0), (2, 2.0)]  # nothing was rewound
    live.close()


def test_a_deleted_run_is_continued_by_a_new_run_that_links_it_and_holds_its_history(
    sqlite_uri: str, caplog: pytest.LogCaptureFixture
):
    cfg = TelemetryConfig(tracking_uri=sqlite_uri, experiment="resume")
    old = Telemetry(cfg, {}, {})
    for step in (1, 2, 3):
        old.log(step, {"reward/mean": float(step)})
    old.close("KILLED")
    old.client.delete_run(old.run_id)
    with caplog.at_level(logging.WARNING, logger="core.run.telemetry"):
        new = Telemetry(cfg, {}, {}, resume=at(old, 2))
    new.log(3, {"reward/mean": 30.0})
    new.close()
    assert new.run_id != old.run_id
    assert f"is deleted in {old.store_uri}" in caplog.text and f"new MLflow run {new.run_id}" in caplog.text
    tags = new.client.get_run(new.run_id).data.tags
    assert (tags[RESUMED_FROM_TAG], tags[RESUMED_TAG]) == (old.run_id, "2")
    assert steps_and_values(new.client, new.run_id) == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_a_checkpoint_that_names_no_run_starts_a_new_one_at_its_step(sqlite_uri: str):
    new = Telemetry(TelemetryConfig(tracking_uri=sqlite_uri), {}, {}, resume=ResumePoint(4, None, None))
    new.close()
    tags = new.client.get_run(new.run_id).data.tags
    assert tags[RESUMED_TAG] == "4" and RESUMED_FROM_TAG not in tags


@pytest.mark.slow
def test_another_store_at_resume_gives_a_new_linked_run_and_settles_the_old_one(
    sqlite_uri: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    old = Telemetry(TelemetryConfig(tracking_uri=sqlite_uri, experiment="resume"), {}, {})
    for step in (1, 2, 3):
        old.log(step, {"reward/mean": float(step)})
    abandon(old)
    other = TelemetryConfig(tracking_uri=f"sqlite:///{tmp_path}/other.db", experiment="resume")
    with caplog.at_level(logging.WARNING, logger="core.run.telemetry"):
        new = Telemetry(other, {}, {}, resume=at(old, 2))
    new.close()
    assert f"is in {old.store_uri}, and this run logs to {new.store_uri}" in caplog.text
    assert new.client.get_run(new.run_id).data.tags[RESUMED_FROM_TAG] == old.run_id
    assert steps_and_values(new.client, new.run_id) == [(1, 1.0), (2, 2.0)]
    assert old.client.get_run(old.run_id).info.status == "KILLED"

    gone = ResumePoint(2, old.run_id, f"sqlite:///{tmp_path}/moved-away.db")
    orphan = Telemetry(other, {}, {}, resume=gone)
    orphan.close()
    assert steps_and_values(orphan.client, orphan.run_id) == []
    assert not (tmp_path / "moved-away.db").exists()  # looking for the old store did not create one


def test_a_relative_sqlite_store_is_recorded_by_its_absolute_path(tmp_path: Path):
    assert canonical_uri("sqlite:///mlflow.db") == f"sqlite:///{tmp_path}/mlflow.db"  # the test runs in tmp_path
    assert canonical_uri("sqlite:////abs/m.db") == "sqlite:////abs/m.db"
    assert canonical_uri("http://127.0.0.1:5000") == "http://127.0.0.1:5000"


# -- a real tracking server -----------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TrackingServer:
    """`mlflow server` on a loopback port, in its own process group so its workers end with it."""

    def __init__(self, root: Path):
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        mlflow = Path(sys.executable).with_name("mlflow")
        log_path = self.root / f"server-{time.time_ns()}.log"
        with open(log_path, "w") as log_file:  # the child keeps its own handle
            self.proc = subprocess.Popen(
                [str(mlflow), "server", "--host", "127.0.0.1", "--port", str(self.port),
                 "--backend-store-uri", f"sqlite:///{self.root}/m.db",
                 "--default-artifact-root", str(self.root / "art"), "--workers", "1"],
                stdout=log_file, stderr=subprocess.STDOUT, cwd=self.root, start_new_session=True,
            )
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {self.proc.returncode}: {log_path.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"mlflow server did not answer /health within {SERVER_START_TIMEOUT_S}s")

    def crash(self) -> None:
        self._signal(signal.SIGKILL)

    def stop(self) -> None:
        self._signal(signal.SIGTERM, grace_s=10)

    def _signal(self, sig: int, grace_s: float = 0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, sig)  # the group this fixture created, by its id
        try:
            self.proc.wait(timeout=grace_s or None)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture(scope="module")
def tracking_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TrackingServer]:
    server = TrackingServer(tmp_path_factory.mktemp("mlflow-server"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.slow
def test_metrics_reach_a_real_tracking_server_over_http(tracking_server: TrackingServer, tmp_path: Path):
    cfg = TelemetryConfig(tracking_uri=tracking_server.url, experiment="http", tags={"swarmrl.study": "s1"})
    client, run_id = exercise(cfg)
    check_run(client, run_id, tmp_path)


@pytest.mark.slow
def test_metrics_logged_while_the_server_is_down_arrive_once_it_is_back(
    tracking_server: TrackingServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    # Fail fast instead of MLflow's default minutes of retries; read by the client at each request.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    telemetry = Telemetry(TelemetryConfig(tracking_uri=tracking_server.url, experiment="outage"), {}, {})
    telemetry.log(1, {"reward/mean": 0.1})
    tracking_server.crash()
    telemetry.log(2, {"reward/mean": 0.2})  # refused: kept, and training goes on
    tracking_server.start()
    telemetry.log(3, {"reward/mean": 0.3})
    telemetry.close()
    assert history(telemetry.client, telemetry.run_id, "reward/mean") == [(1, 0.1), (2, 0.2), (3, pytest.approx(0.3))]


@pytest.mark.slow
def test_over_http_a_resume_keeps_the_old_values_and_readers_take_the_last_one(
    tracking_server: TrackingServer, caplog: pytest.LogCaptureFixture
):
    cfg = TelemetryConfig(tracking_uri=tracking_server.url, experiment="resume-http")
    first = Telemetry(cfg, {}, {})
    for step in (1, 2, 3):
        first.log(step, {"reward/mean": float(step)})
    abandon(first)
    with caplog.at_level(logging.WARNING, logger="core.run.telemetry"):
        second = Telemetry(cfg, {}, {}, resume=at(first, 1))
    assert second.run_id == first.run_id and "cannot delete metric values" in caplog.text
    for step in (2, 3):
        second.log(step, {"reward/mean": 10.0 * step})
    second.close()
    stored = second.client.get_metric_history(second.run_id, "reward/mean")
    assert sorted(m.step for m in stored) == [1, 2, 2, 3, 3]  # MLflow over HTTP cannot delete (mlflow#2973)
    assert [(m.step, m.value) for m in one_per_step(stored)] == [(1, 1.0), (2, 20.0), (3, 30.0)]
