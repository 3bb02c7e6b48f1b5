"""A waiting study resumes when a person sets `review.status` through MLflow's REST API, as the UI does.

Runs a real `mlflow server` on a free loopback port and a real study process against it.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.researcher.harness import BIN, ROOT, Project, write_brief
from tests.researcher.helpers import wait_until_up
from tests.researcher.scripted_llm import free_port

pytestmark = pytest.mark.slow


@pytest.fixture
def mlflow_server(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
                             "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
                             "--default-artifact-root", str(tmp_path / "artifacts"), "--workers", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until_up(f"{url}/health", "mlflow server", 120)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def _pending_runs(url: str, study: str) -> dict[str, str]:
    exp = httpx.get(f"{url}/api/2.0/mlflow/experiments/get-by-name", params={"experiment_name": f"study-{study}"})
    if exp.status_code != 200:
        return {}
    found = httpx.post(f"{url}/api/2.0/mlflow/runs/search", json={
        "experiment_ids": [exp.json()["experiment"]["experiment_id"]],
        "filter": "tags.`review.status` = 'pending'"}).json()
    return {next(t["value"] for t in r["data"]["tags"] if t["key"] == "swarmrl.proposal"): r["info"]["run_id"]
            for r in found.get("runs", [])}


def test_tag_set_through_rest_resumes_the_waiting_study(tmp_path: Path, mlflow_server: str) -> None:
    project = Project(tmp_path)
    brief = write_brief(tmp_path, approval="human", rounds=1)
    study = subprocess.Popen([str(BIN / "researcher"), "study", "--studies-dir", str(project.studies), "start",
                              str(brief), "--name", "rest", "--planner", "heuristic"], cwd=ROOT,
                             env=project.env(MLFLOW_TRACKING_URI=mlflow_server), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while len(pending := _pending_runs(mlflow_server, "rest")) < 2:
            assert time.monotonic() < deadline and study.poll() is None, "the study never asked for review"
            time.sleep(1)
        time.sleep(2)
        assert study.poll() is None  # it waits, as long as it takes
        for pid, verdict in (("r1-1", "vetoed"), ("r1-2", "approved")):
            reply = httpx.post(f"{mlflow_server}/api/2.0/mlflow/runs/set-tag",
                               json={"run_id": pending[pid], "key": "review.status", "value": verdict})
            assert reply.status_code == 200
        out, _ = study.communicate(timeout=600)
    finally:
        if study.poll() is None:
            study.kill()
    assert study.returncode == 0, out
    assert "is done" in out
    values, _, _ = project.state("rest")
    assert [(d["proposal_id"], d["verdict"], d["by"], d["source"]) for d in values["decisions"]] == \
        [("r1-1", "vetoed", "mlflow-ui", "mlflow"), ("r1-2", "approved", "mlflow-ui", "mlflow")]
    assert [x["key"] for x in values["launches"]] == ["r1-2-s0"]
