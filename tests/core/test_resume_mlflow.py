"""`swarm run --resume` and `swarm serve` as users run them: one MLflow run per run, and the right final status.

Each test drives the real CLI in subprocesses with the tiny model and a few steps, then reads the
MLflow store the way the researcher does: the full metric history, step by step.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from mlflow import MlflowClient

from core.run import checkpoint
from core.run.telemetry import RESUMED_FROM_TAG, RESUMED_TAG

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")
LINE_WAIT_S = 300.0  # start-up plus a few steps on a busy 2-core machine
EXIT_WAIT_S = 120.0  # a stopped run finishes its step, drains its clients and checkpoints
# Metrics logged at every step; each must hold steps 1..N exactly once.
EVERY_STEP = ("reward/mean", "train/loss", "rollout/episodes_per_s", "episodes/aborted")


def swarm(*args: str) -> list[str]:
    return [sys.executable, "-m", "core.run.cli", *args]


@pytest.fixture
def start() -> Iterator[Callable[[list[str]], subprocess.Popen[str]]]:
    """Starts CLI processes; any still running when the test ends (a failed assertion) is killed."""
    started: list[subprocess.Popen[str]] = []

    def spawn(argv: list[str]) -> subprocess.Popen[str]:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        started.append(proc)
        return proc

    yield spawn
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def read_until(proc: subprocess.Popen[str], pattern: str) -> tuple[re.Match[str], str]:
    """Read output until a line matches `pattern`: (the match, all output so far); fails if it exits first."""
    deadline = time.monotonic() + LINE_WAIT_S
    seen: list[str] = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise AssertionError(f"exited ({proc.returncode}) before {pattern!r}:\n{''.join(seen)[-3000:]}")
        seen.append(line)
        if found := re.search(pattern, line):
            return found, "".join(seen)
    raise AssertionError(f"no {pattern!r} within {LINE_WAIT_S}s:\n{''.join(seen)[-3000:]}")


def post_when_up(url: str, **kwargs) -> httpx.Response:
    """POST once the server accepts connections: it logs its address just before it binds."""
    deadline = time.monotonic() + LINE_WAIT_S
    while True:
        try:
            return httpx.post(url, timeout=30, **kwargs)
        except httpx.ConnectError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def steps(client: MlflowClient, run_id: str, key: str) -> list[int]:
    """Every step stored for `key`, in order, duplicates included."""
    return sorted(m.step for m in client.get_metric_history(run_id, key))


@pytest.mark.slow
def test_a_killed_run_resumes_into_the_same_mlflow_run_until_it_finishes(tmp_path: Path, start):
    """kill -9 after the checkpoint, --resume, Ctrl-C, --resume to the end: one run, each step once, FINISHED."""
    ckpt, run_id_file = tmp_path / "ckpt", tmp_path / "run_id"
    run = swarm("run", TINY, "--quiet", "--experiment", "resume-kill", "--run-id-file", str(run_id_file),
                "--set", f"trainer.checkpoint_dir={ckpt}", "--set", "trainer.checkpoint_every=2")
    client = MlflowClient()

    first = start([*run, "--set", "trainer.steps=1000"])
    read_until(first, r"step 3 reward")  # logged after the checkpoint at step 2
    first.kill()
    first.communicate(timeout=EXIT_WAIT_S)
    run_id = run_id_file.read_text()
    killed_at = checkpoint.load_latest(ckpt).step
    assert client.get_run(run_id).info.status == "RUNNING"  # what kill -9 leaves behind
    assert max(steps(client, run_id, "reward/mean")) > killed_at  # steps past the checkpoint are in MLflow

    second = start([*run, "--set", "trainer.steps=1000", "--resume"])
    _, log = read_until(second, r"step \d+ reward")
    second.send_signal(signal.SIGINT)
    out, _ = second.communicate(timeout=EXIT_WAIT_S)
    log += out
    assert second.returncode == 130, log[-3000:]
    assert f"MLflow run {run_id} was left RUNNING by process {first.pid}" in log and "marked KILLED" in log
    assert f"reopened MLflow run {run_id} at step {killed_at}" in log
    assert run_id_file.read_text() == run_id
    assert client.get_run(run_id).info.status == "KILLED"
    stopped_at = checkpoint.load_latest(ckpt).step

    final = subprocess.run([*run, "--set", f"trainer.steps={stopped_at + 1}", "--resume"],
                           cwd=ROOT, capture_output=True, text=True, timeout=LINE_WAIT_S)
    assert final.returncode == 0, final.stderr[-3000:]
    assert run_id_file.read_text() == run_id
    finished = client.get_run(run_id)
    assert finished.info.status == "FINISHED"
    assert finished.data.tags[RESUMED_TAG] == f"{killed_at},{stopped_at}"
    for key in EVERY_STEP:
        assert steps(client, run_id, key) == list(range(1, stopped_at + 2)), key


@pytest.mark.slow
def test_an_exception_in_a_sandboxs_tasks_fails_the_run_with_the_error_in_the_log(tmp_path: Path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "agent.py").write_text(
        "def tasks(split):\n"
        "    raise RuntimeError('task source unreachable: /data/tasks.jsonl')\n"
        "\n"
        "async def rollout(task, llm):\n"
        "    return 0.0\n"
    )
    run_id_file = tmp_path / "run_id"
    done = subprocess.run(
        swarm("run", TINY, "--quiet", "--experiment", "resume-failed", "--run-id-file", str(run_id_file),
              "--set", f"clients.0.agent={broken}", "--set", "clients.0.isolate=false", "--set", "trainer.steps=3",
              "--set", f"trainer.checkpoint_dir={tmp_path / 'ckpt'}"),
        cwd=ROOT, capture_output=True, text=True, timeout=LINE_WAIT_S,
    )
    assert done.returncode == 1, done.stderr[-3000:]
    assert "RuntimeError: task source unreachable: /data/tasks.jsonl" in done.stderr
    assert MlflowClient().get_run(run_id_file.read_text()).info.status == "FAILED"


@pytest.mark.slow
def test_a_new_tracking_store_at_resume_gives_a_new_run_linked_to_the_old_one(tmp_path: Path):
    ckpt, run_id_file = tmp_path / "ckpt", tmp_path / "run_id"
    run = swarm("run", TINY, "--quiet", "--experiment", "resume-store", "--run-id-file", str(run_id_file),
                "--set", f"trainer.checkpoint_dir={ckpt}", "--set", "trainer.checkpoint_every=2")
    first = subprocess.run([*run, "--set", "trainer.steps=2"], cwd=ROOT, capture_output=True, text=True,
                           timeout=LINE_WAIT_S)
    assert first.returncode == 0, first.stderr[-3000:]
    old_id = run_id_file.read_text()

    new_store = f"sqlite:///{tmp_path}/moved.db"
    second = subprocess.run([*run, "--set", "trainer.steps=3", "--resume"], cwd=ROOT, capture_output=True, text=True,
                            timeout=LINE_WAIT_S, env={**os.environ, "MLFLOW_TRACKING_URI": new_store})
    assert second.returncode == 0, second.stderr[-3000:]
    new_id = run_id_file.read_text()
    assert new_id != old_id and f"new MLflow run {new_id}" in second.stderr
    moved = MlflowClient(new_store)
    tags = moved.get_run(new_id).data.tags
    assert (tags[RESUMED_FROM_TAG], tags[RESUMED_TAG]) == (old_id, "2")
    assert steps(moved, new_id, "reward/mean") == [1, 2, 3]  # steps 1-2 copied from the old store
    assert MlflowClient().get_run(old_id).info.status == "FINISHED"


@pytest.mark.slow
def test_swarm_serve_stopped_by_sigterm_or_admin_shutdown_ends_its_run_killed(tmp_path: Path, start):
    token = "test-admin-token"
    serve = swarm("serve", TINY, "--set", f"server.admin_token={token}",
                  "--set", f"trainer.checkpoint_dir={tmp_path / 'ckpt'}")
    client = MlflowClient()
    client.search_experiments()  # create the store here: two processes migrating a new sqlite file at once collide
    # Both at once: they wait on start-up, not on each other.
    by_signal = start([*serve, "--set", "telemetry.experiment=serve-sigterm"])
    by_admin = start([*serve, "--set", "telemetry.experiment=serve-shutdown"])
    read_until(by_signal, r"serving .* at http")
    url = read_until(by_admin, r"serving .* at (http://\S+)")[0].group(1)

    by_signal.send_signal(signal.SIGTERM)
    answer = post_when_up(f"{url}/swarm/v1/admin/shutdown", headers={"Authorization": f"Bearer {token}"})
    assert answer.status_code == 200, answer.text
    for proc, experiment in ((by_signal, "serve-sigterm"), (by_admin, "serve-shutdown")):
        out, _ = proc.communicate(timeout=EXIT_WAIT_S)
        assert proc.returncode == 0, out[-3000:]  # a graceful exit, not the re-raised signal ending the process
        exp = client.get_experiment_by_name(experiment)
        runs = client.search_runs([exp.experiment_id])
        assert [r.info.status for r in runs] == ["KILLED"], out[-3000:]


def test_swarm_serve_after_its_last_step_serves_on_and_refuses_train_episodes_with_a_409(tmp_path: Path, start,
                                                                                         monkeypatch):
    # The feeder is a person's `swarm client`, opening with the admin token (a training server takes no anonymous
    # opens), given here because a port-0 server is not in this machine's index.
    serve = start(swarm("serve", TINY, "--set", "trainer.steps=2", "--set", "server.port=0",
                        "--set", "server.admin_token=serve-person-token",
                        "--set", f"trainer.checkpoint_dir={tmp_path / 'ckpt'}", "--set", "telemetry.experiment=serve-done"))
    url = read_until(serve, r"serving .* at (http://\S+)")[0].group(1)
    monkeypatch.setenv("SWARMRL_ADMIN_TOKEN", "serve-person-token")  # the feeder's: start() passes our environment
    feeder = start(swarm("client", "sandbox:letters", "--server", url))
    read_until(serve, r"trainer done after 2 steps")
    # letters is judged: its episodes open without a task_id and the server deals the task (core.sandbox.dealer)
    person = {"Authorization": "Bearer serve-person-token"}  # a training server takes no anonymous opens
    refused = httpx.post(f"{url}/swarm/v1/episodes", json={"sandbox": "letters"}, headers=person, timeout=30)
    assert refused.status_code == 409, refused.text  # at once: no back-pressure wait that could never end
    assert "takes no more train episodes" in refused.json()["error"]["message"]
    evaluated = httpx.post(f"{url}/swarm/v1/episodes", json={"sandbox": "letters", "kind": "eval"}, headers=person,
                           timeout=30)
    assert evaluated.status_code == 200, evaluated.text  # the server serves on
    assert serve.poll() is None
    feeder.kill()
