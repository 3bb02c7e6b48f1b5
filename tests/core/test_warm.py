"""`swarm warm`: `swarm run` forked from a process with its imports done behaves as a cold one does.

Real processes throughout: a `swarm warm` process, `swarm run` launchers on the tiny config, and the
forked runs, whose pids the warm process logs. The launcher's exit code, its relayed Ctrl-C, its death
and the fallback to a cold start are each checked against what a cold `swarm run` does.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from core.run import checkpoint, warm

ROOT = Path(__file__).resolve().parents[2]
SWARM = Path(sys.executable).parent / "swarm"
TINY = str(ROOT / "configs" / "tiny.yaml")


@dataclass
class Warm:
    socket: Path
    log: Path

    def forked_pids(self) -> list[int]:
        return [int(p) for p in re.findall(r"forked pid (\d+)", self.log.read_text())]

    def forked_since(self, before: list[int]) -> int:
        """The one run forked since `before` was read (a run that started cold fails here)."""
        new = self.forked_pids()[len(before):]
        assert len(new) == 1, self.log.read_text()[-2000:]
        return new[0]


@pytest.fixture(scope="module")
def warm_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Warm]:
    """One warm process for the module (its imports cost a cold start); tests count the forks they caused."""
    folder = tmp_path_factory.mktemp("warm")
    path, log = folder / "warm.sock", folder / "warm.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(SWARM), "warm", "--socket", str(path)], cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        while not path.exists():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        yield Warm(path, log)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert not path.exists(), "a stopped warm process removes its socket"


def _run(tmp_path: Path, warm_socket: Path | str, *args: str, **env: str) -> subprocess.Popen[str]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    cmd = [str(SWARM), "run", TINY, "--quiet", "--set", f"trainer.checkpoint_dir={tmp_path / 'ckpt'}", *args]
    return subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "SWARMRL_WARM": str(warm_socket),
                                 "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}", **env})


def _wait_for(proc: subprocess.Popen[str], text: str, timeout: float = 240) -> str:
    seen, deadline = "", time.monotonic() + timeout
    while text not in seen:
        line = proc.stdout.readline()
        assert (line or proc.poll() is None) and time.monotonic() < deadline, seen[-3000:]
        seen += line
    return seen


def _gone(pid: int, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/status").read_text()
        except FileNotFoundError:
            return True
        if "State:\tZ" in state:
            return True
        time.sleep(0.1)
    return False


def test_a_run_forked_from_the_warm_process_trains_logs_and_exits_zero_after_a_garbage_request(
        warm_process: Warm, tmp_path: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as peer:  # no descriptors, no header: refused
        peer.connect(str(warm_process.socket))
        peer.sendall(b"not a request\n")
        assert b"refused" in peer.recv(4096)
    before = warm_process.forked_pids()
    proc = _run(tmp_path, warm_process.socket, "--set", "trainer.steps=2")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert "starting cold" not in out and "step 2 reward" in out, out[-3000:]
    warm_process.forked_since(before)
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    [run] = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "FINISHED" and "reward/mean" in run.data.metrics
    assert checkpoint.load_latest(tmp_path / "ckpt").step == 2


def test_ctrl_c_to_the_launcher_reaches_the_forked_run_which_checkpoints_and_exits_130(
        warm_process: Warm, tmp_path: Path) -> None:
    before = warm_process.forked_pids()
    proc = _run(tmp_path, warm_process.socket, "--set", "trainer.steps=1000")
    _wait_for(proc, "step 2 ")
    forked = warm_process.forked_since(before)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-3000:]  # what a cold `swarm run` exits with (test_run.py)
    assert checkpoint.load_latest(tmp_path / "ckpt").step >= 2
    assert _gone(forked)


def test_a_killed_launcher_takes_its_forked_run_with_it_and_a_killed_run_its_launcher(
        warm_process: Warm, tmp_path: Path) -> None:
    before = warm_process.forked_pids()
    first = _run(tmp_path / "a", warm_process.socket, "--set", "trainer.steps=1000")
    _wait_for(first, "step 1 ")
    forked = warm_process.forked_since(before)
    first.kill()
    first.wait(timeout=30)
    assert _gone(forked), f"forked run {forked} outlived its killed launcher"
    before = warm_process.forked_pids()
    second = _run(tmp_path / "b", warm_process.socket, "--set", "trainer.steps=1000")
    _wait_for(second, "step 1 ")
    os.kill(warm_process.forked_since(before), signal.SIGKILL)
    second.communicate(timeout=60)
    assert second.returncode == -signal.SIGKILL  # the launcher dies of its run's signal, as a cold run would


def test_a_second_warm_process_on_a_live_socket_refuses_to_start(warm_process: Warm) -> None:
    done = subprocess.run([str(SWARM), "warm", "--socket", str(warm_process.socket)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "another warm process listens at" in done.stderr, done.stderr
    assert warm_process.socket.exists()


def test_a_launcher_whose_import_time_environment_differs_starts_cold_and_says_which_variable(
        warm_process: Warm, tmp_path: Path) -> None:
    before = warm_process.forked_pids()
    proc = _run(tmp_path, warm_process.socket, "--set", "trainer.steps=1", HF_HUB_DISABLE_TELEMETRY="1")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert "a different $HF_HUB_DISABLE_TELEMETRY); starting cold" in out and "step 1 reward" in out, out[-3000:]
    assert warm_process.forked_pids() == before


def test_no_warm_process_at_the_socket_means_a_cold_start_with_a_warning(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("SWARMRL_WARM", str(tmp_path / "nobody.sock"))
    assert warm.delegate() is None
    assert "did not answer" in capsys.readouterr().err
    monkeypatch.delenv("SWARMRL_WARM")
    assert warm.delegate() is None  # not asked for: nothing said


def test_the_source_stamp_changes_with_any_edit_addition_or_removal(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("x = 1\n")
    first = warm.source_stamp(tmp_path)
    os.utime(tmp_path / "a.py", ns=(time.time_ns(), time.time_ns() + 10**9))
    edited = warm.source_stamp(tmp_path)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.py").write_text("")
    added = warm.source_stamp(tmp_path)
    (tmp_path / "sub" / "b.py").unlink()
    assert len({first, edited, added}) == 3 and warm.source_stamp(tmp_path)[0] == first[0]
