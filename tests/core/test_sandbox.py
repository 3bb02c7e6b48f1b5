"""Clients as their own processes: `swarm client` runs a sandbox, backs off and gives up when every episode
fails, stops within a bound on SIGTERM whether the server is up or gone; `swarm swap` finds clients through the
server, never through pid files, and signals no process it did not start."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core.clients.retries import BACKOFF_MAX_S, BACKOFF_START_S, backoff_delay
from core.clients.sdk import model_to_call
from core.clients.failures import FailureGate
from core.clients.sandbox import load_agent

ROOT = Path(__file__).resolve().parents[2]
# A client that must stop "at once" or "within one lease" gets this long before the test calls it stuck:
# process start-up on a loaded 2-core machine takes seconds, the bounds under test are far below.
STOP_BOUND_S = 45

AGENT = '''
import asyncio

def tasks(split):
    for i in range(4):
        yield {{"id": f"t{{i}}"}}

async def rollout(task, llm):
{body}
'''
WRONG_MODEL = '    await llm.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}], max_tokens=2)\n    return 1.0'
HANGS = '    await llm.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)\n    await asyncio.sleep(3600)\n    return 1.0'


def _sandbox(tmp_path: Path, name: str, body: str) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "agent.py").write_text(AGENT.format(body=body))
    return folder


STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _kill_leftover_clients():
    """A test that fails mid-way must not leave its client processes running."""
    yield
    while STARTED:
        proc = STARTED.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _client(url: str, spec: str = "sandbox:letters", *extra: str, env=None, group_size: str | None = "2") -> subprocess.Popen:
    cmd = [sys.executable, "-m", "core.run.cli", "client", spec, "--server", url, *extra]
    cmd += ["--group-size", group_size] if group_size else []
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env or os.environ.copy(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    STARTED.append(proc)
    return proc


def _wait_for(predicate, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, "timed out waiting for the condition"
        time.sleep(0.1)


def _pid_files(env: dict) -> list[Path]:
    return sorted(Path(env["SWARMRL_STATE"]).glob("*.pid"))


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


def test_the_model_to_call_is_the_single_served_one_and_several_need_a_name():
    assert model_to_call(("tiny",)) == "tiny"
    with pytest.raises(ValueError, match=r"several models \['a', 'b'\]: pass model= explicitly"):
        model_to_call(("b", "a"))
    with pytest.raises(ValueError, match="not bound to a swarm episode"):
        model_to_call(())


def test_backoff_doubles_up_to_its_cap_and_honours_retry_after():
    for attempt in range(8):
        bound = min(BACKOFF_MAX_S, BACKOFF_START_S * 2**attempt)
        assert bound / 2 <= backoff_delay(attempt) <= bound
    assert backoff_delay(3, retry_after="7") == 7.0
    assert backoff_delay(10**6) <= BACKOFF_MAX_S  # no overflow on a client that failed for days


def test_a_failing_gate_admits_one_episode_at_a_time_and_a_success_reopens_it():
    async def peak_concurrency(gate: FailureGate, episodes: int, fail: bool) -> int:
        stop, active, peak = asyncio.Event(), 0, 0

        async def episode() -> None:
            nonlocal active, peak
            async with gate.admit(stop):
                active += 1
                peak = max(peak, active)
                await asyncio.sleep(0.01)
                active -= 1
                gate.failed(RuntimeError("boom")) if fail else gate.succeeded()

        await asyncio.gather(*(episode() for _ in range(episodes)))
        return peak

    gate = FailureGate(limit=5)
    assert asyncio.run(peak_concurrency(gate, 4, fail=False)) == 4  # healthy: all in flight together
    gate.failed(RuntimeError("boom"))
    assert asyncio.run(peak_concurrency(gate, 4, fail=True)) == 1  # failing: one at a time
    assert gate.consecutive == 5 and gate.exhausted
    gate.succeeded()
    assert not gate.exhausted and asyncio.run(peak_concurrency(gate, 3, fail=False)) == 3


@pytest.mark.slow
def test_client_process_runs_its_episodes_and_exits(live_server):
    server = live_server()
    proc = _client(server.url, "sandbox:letters", "--episodes", "6", "--concurrency", "3")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-2000:]
    counters = server.status()["episodes"]
    assert counters["finished"] == 6 and counters["aborted"] == 0


@pytest.mark.slow
def test_a_wrong_model_name_gives_up_with_one_line_listing_the_served_models(live_server, tmp_path):
    server = live_server()
    folder = _sandbox(tmp_path, "wrongmodel", WRONG_MODEL)
    proc = _client(server.url, str(folder), "--concurrency", "2", "--max-consecutive-failures", "3")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, out[-2000:]
    last = out.strip().splitlines()[-1]
    assert "client wrongmodel gave up after 3 consecutive failed episodes" in last
    assert "404 model 'nope' is not served here; served: ['policy']" in last
    assert "Likely fix:" in last and "model=llm.model" in last
    counters = server.status()["episodes"]
    assert counters["opened"] == counters["aborted"] <= 2 + 3  # no hot loop: the burst, then one at a time


@pytest.mark.slow
def test_a_client_whose_server_is_gone_gives_up_with_exit_2(live_server, tmp_path):
    env = {**os.environ, "SWARMRL_STATE": str(tmp_path / "state")}
    server = live_server()
    proc = _client(server.url, "sandbox:letters", "--concurrency", "2", "--max-consecutive-failures", "2", env=env)
    _wait_for(lambda: server.status()["episodes"]["finished"] >= 2)
    server.stop()
    out, _ = proc.communicate(timeout=STOP_BOUND_S + 30)
    assert proc.returncode == 2, out[-2000:]
    last = out.strip().splitlines()[-1]
    # Both in-flight episodes may fail together when the server dies, so the count can pass the limit
    # by at most the episodes already in flight (concurrency - 1), never more.
    gave_up = re.search(r"client letters gave up after (\d+) consecutive failed episodes", last)
    assert gave_up is not None, last
    assert 2 <= int(gave_up.group(1)) <= 2 + 1
    assert "Likely fix: start the swarm server" in last
    assert _pid_files(env) == []


@pytest.mark.slow
def test_a_client_against_no_server_fails_at_once_with_exit_2(tmp_path):
    proc = _client("http://127.0.0.1:9", "sandbox:letters", group_size=None)  # port 9 (discard): nothing listens
    out, _ = proc.communicate(timeout=STOP_BOUND_S)
    assert proc.returncode == 2, out[-2000:]
    assert "client letters cannot start" in out and "unreachable" in out


@pytest.mark.slow
def test_sigterm_drains_for_at_most_one_lease_then_aborts_and_exits(live_server, tmp_path):
    env = {**os.environ, "SWARMRL_STATE": str(tmp_path / "state")}
    server = live_server(server__lease_s=3.0)
    proc = _client(server.url, str(_sandbox(tmp_path, "hangs", HANGS)), "--concurrency", "2", env=env)
    _wait_for(lambda: server.status()["throughput"]["calls"] >= 2)  # both episodes are inside their rollout
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=STOP_BOUND_S)
    assert proc.returncode == 0, out[-2000:]
    assert "2 episode(s) still in flight after 3s; aborting them" in out
    assert server.status()["episodes"]["aborted"] == 2
    assert _pid_files(env) == []


@pytest.mark.slow
def test_sigterm_with_the_server_gone_exits_within_the_bound(live_server, tmp_path):
    env = {**os.environ, "SWARMRL_STATE": str(tmp_path / "state")}
    server = live_server(server__lease_s=3.0)
    proc = _client(server.url, str(_sandbox(tmp_path, "hangs", HANGS)), "--concurrency", "2", env=env)
    _wait_for(lambda: server.status()["throughput"]["calls"] >= 2)
    server.stop()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=STOP_BOUND_S)
    assert proc.returncode == 0, out[-2000:]
    assert _pid_files(env) == []


@pytest.mark.slow
@pytest.mark.parametrize("signals, code", [((signal.SIGTERM, signal.SIGTERM), 143), ((signal.SIGINT,), 130)])
def test_a_second_sigterm_or_a_sigint_exits_at_once(live_server, tmp_path, signals, code):
    env = {**os.environ, "SWARMRL_STATE": str(tmp_path / "state")}
    server = live_server(server__lease_s=600.0)  # a drain would take ten minutes: only exiting at once passes
    proc = _client(server.url, str(_sandbox(tmp_path, "hangs", HANGS)), "--concurrency", "2", env=env)
    _wait_for(lambda: server.status()["throughput"]["calls"] >= 2)
    assert len(_pid_files(env)) == 1
    for sig in signals:
        proc.send_signal(sig)
        time.sleep(0.5)
    out, _ = proc.communicate(timeout=STOP_BOUND_S)
    assert proc.returncode == code, out[-2000:]
    assert "exiting now" in out
    assert _pid_files(env) == []


@pytest.mark.slow
def test_swap_goes_through_the_server_and_never_signals_a_process_it_did_not_start(live_server, tmp_path):
    """A pid file naming a foreign process (or an unverifiable bare pid) is not a client: swap asks the
    server, finds no registered client of the sandbox, and refuses without starting or signalling
    anything. The swap itself is tested end to end in tests/core/test_swap.py."""
    server = live_server()
    env = {**os.environ, "SWARMRL_STATE": str(tmp_path / "state")}
    state = Path(env["SWARMRL_STATE"])
    state.mkdir()
    port = server.url.rsplit(":", 1)[-1]
    foreign = subprocess.Popen(["sleep", "120"])  # holds a pid a dead client's pid file might name
    try:
        (state / f"letters-{port}-{foreign.pid}.pid").write_text(
            json.dumps({"pid": foreign.pid, "cmdline": [sys.executable, "-m", "core.run.cli", "client", "sandbox:letters"]}))
        (state / f"letters-{port}-1.pid").write_text(str(foreign.pid))  # an unverifiable bare pid
        swap = subprocess.run([sys.executable, "-m", "core.run.cli", "swap", "sandbox:letters", "--server", server.url,
                               "--admin-token", server.admin_token], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=120)
        assert swap.returncode == 2, swap.stderr[-2000:]
        assert "no client of sandbox 'letters' is registered" in swap.stderr
        assert foreign.poll() is None  # still alive: not signalled
        assert not list(state.glob("*.log"))  # no new client was started
    finally:
        foreign.kill()
