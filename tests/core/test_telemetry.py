"""Telemetry against real MLflow stores: a sqlite file, and a real `mlflow server` over HTTP."""

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
import pytest
from mlflow.tracking import MlflowClient

from core.config import TelemetryConfig
from core.records import Call, Episode
from core.telemetry import MAX_PARAM_LENGTH, Telemetry

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
    with caplog.at_level(logging.WARNING, logger="core.telemetry"):
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
