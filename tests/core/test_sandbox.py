"""Clients as their own processes: `swarm client` runs a sandbox; `swarm swap` replaces it live."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core.sandbox import load_agent

ROOT = Path(__file__).resolve().parents[2]


def _client(url: str, *extra: str, env=None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "core.cli", "client", "sandbox:letters", "--server", url, "--group-size", "2", *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=env or os.environ.copy(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_sandboxes_load_with_their_code_version():
    agent = load_agent("sandbox:letters", ROOT / "sandboxes")
    assert agent.name == "letters" and agent.version
    assert len(list(agent.tasks("train"))) == 8
    with pytest.raises(ValueError, match="no agent.py"):
        load_agent("sandbox:nope", ROOT / "sandboxes")


def test_a_broken_sandbox_is_a_clear_error(tmp_path):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "agent.py").write_text("def tasks(split):\n    return []\n")
    with pytest.raises(ValueError, match="must define rollout"):
        load_agent(str(tmp_path / "bad"))
    (tmp_path / "bad" / "agent.py").write_text("this is not python")
    with pytest.raises(ValueError, match="failed to import"):
        load_agent(str(tmp_path / "bad"))


@pytest.mark.slow
def test_client_process_runs_its_episodes_and_exits(live_server):
    server = live_server()
    proc = _client(server.url, "--episodes", "6", "--concurrency", "3")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-2000:]
    counters = server.status()["episodes"]
    assert counters["finished"] == 6 and counters["aborted"] == 0


@pytest.mark.slow
def test_hot_swap_drains_the_old_client_and_loses_no_episode(live_server, tmp_path):
    server = live_server(trainer__batch_groups=100)  # no trainer here: room for many ready groups
    env = {**os.environ, "SWARMRL_STATE": str(tmp_path / "state")}
    old = _client(server.url, "--concurrency", "2", env=env)
    deadline = time.time() + 60
    while server.status()["episodes"]["finished"] < 4 and time.time() < deadline:
        time.sleep(0.2)
    swap = subprocess.run([sys.executable, "-m", "core.cli", "swap", "sandbox:letters", "--server", server.url,
                           "--concurrency", "2"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert swap.returncode == 0, swap.stderr[-2000:]
    out, _ = old.communicate(timeout=60)  # the old client drains its in-flight episodes and exits cleanly
    assert old.returncode == 0, out[-2000:]
    before = server.status()["episodes"]["finished"]
    while server.status()["episodes"]["finished"] < before + 4 and time.time() < deadline + 60:
        time.sleep(0.2)
    status = server.status()["episodes"]
    assert status["finished"] >= before + 4  # the new process took over
    assert status["aborted"] == 0 and status["expired"] == 0
    for f in (tmp_path / "state").glob("*.pid"):
        os.kill(int(f.read_text()), 15)
