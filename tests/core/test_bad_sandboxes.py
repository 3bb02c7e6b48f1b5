"""Bad sandbox code, each in a real `swarm client` process against one live server: a clear error naming
the file and function, and the server unaffected (it keeps serving, and records no bad reward)."""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core.clients import deadline
from core.clients.deadline import EpisodeTimeout, within_limit
from core.clients.runner import EPISODE_ATTEMPTS, run_agent
from core.clients.sandbox import SandboxError, checked_outcome, load_agent

ROOT = Path(__file__).resolve().parents[2]
HEADER = "import time\n\ndef tasks(split):\n    for i in range(4):\n        yield {'id': f't{i}'}\n\n"
CALL = "    await llm.chat.completions.create(model=llm.model, messages=[{'role': 'user', 'content': 'hi'}], max_tokens=2)\n"
BAD = {
    "bad_import": "import not_a_module_anywhere\n" + HEADER + "async def rollout(task, llm):\n    return 1.0\n",
    "raises": HEADER + "async def rollout(task, llm):\n" + CALL + "    return score(task)\n\n\ndef score(task):\n    return 1 / 0\n",
    "nan_reward": HEADER + "async def rollout(task, llm):\n" + CALL + "    return float('nan')\n",
    "text_reward": HEADER + "async def rollout(task, llm):\n" + CALL + "    return 'good'\n",
    # Blocks its event loop, heartbeats included: its episodes must expire by lease on the server.
    "hangs": HEADER + "async def rollout(task, llm):\n" + CALL + "    time.sleep(3600)\n    return 1.0\n",
    # Hangs while awaiting, so it keeps heartbeating: the client's episode deadline must cancel it.
    "hangs_awaiting": "import asyncio\n" + HEADER + "async def rollout(task, llm):\n" + CALL
                      + "    await asyncio.sleep(3600)\n    return 1.0\n",
}
EXTRA = {"hangs_awaiting": ("--episode-timeout", "2")}


def _client(url: str, spec: str, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "core.run.cli", "client", spec, "--server", url, "--group-size", "1", "--concurrency", "1",
           "--max-consecutive-failures", "2", *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=os.environ.copy(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


@pytest.mark.slow
def test_bad_sandboxes_fail_clearly_and_the_server_serves_on(live_server, tmp_path):
    # A 4 s lease: the blocked client expires soon, and the 2 s episode deadline aborts first even when a busy
    # machine delays heartbeats.
    server = live_server(engine__kind="instant", server__lease_s=4.0)
    folders = {}
    for name, code in BAD.items():
        folders[name] = tmp_path / name
        folders[name].mkdir()
        (folders[name] / "agent.py").write_text(code)
    procs = {name: _client(server.url, str(folder), *EXTRA.get(name, ())) for name, folder in folders.items()}
    try:
        deadline = time.time() + 120
        while server.status()["episodes"]["expired"] < 1:  # the hung client's episode, by its lease
            assert time.time() < deadline, "the hung sandbox's episode never expired"
            time.sleep(0.2)
        outs = {name: procs[name].communicate(timeout=120)[0] for name in BAD if name != "hangs"}
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
    for name, out in outs.items():
        assert procs[name].returncode == 2, (name, out[-2000:])
    agent_py = {name: str(folders[name] / "agent.py") for name in BAD}
    assert f"{agent_py['bad_import']} failed to import: ModuleNotFoundError" in outs["bad_import"]
    assert f"{agent_py['raises']}:13 in score(): ZeroDivisionError: division by zero" in outs["raises"]
    assert f"{agent_py['nan_reward']} in rollout() returned a reward of nan" in outs["nan_reward"]
    assert f"{agent_py['text_reward']} in rollout() returned 'good' (str)" in outs["text_reward"]
    timeout = f"{agent_py['hangs_awaiting']} in rollout() ran past the 2 s episode limit"
    assert timeout in outs["hangs_awaiting"] and "gave up after 2 consecutive failed episodes" in outs["hangs_awaiting"]
    ended = list(server.registry._ended.values())
    assert any(ep.state == "expired" for ep in ended if ep.client_id.startswith("hangs-"))  # blocked: by lease
    # Awaiting: both of its episodes were aborted on the server (not left open, not expired), with that reason.
    hung = [(ep.state, ep.abort_reason or "") for ep in ended if ep.client_id.startswith("hangs_awaiting-")]
    assert [(state, why.startswith(f"EpisodeTimeout: {timeout}")) for state, why in hung] == [("aborted", True)] * 2, \
        hung

    # The server is unaffected: a good client runs its episodes, and no bad reward was ever recorded.
    good = _client(server.url, "sandbox:letters", "--episodes", "2")
    out, _ = good.communicate(timeout=120)
    assert good.returncode == 0, out[-2000:]
    counters = server.status()["episodes"]
    assert counters["finished"] == 2 and counters["expired"] >= 1 and counters["aborted"] >= len(hung)
    assert counters["opened"] == counters["finished"] + counters["aborted"] + counters["expired"] + server.status()["open_episodes"]


def test_a_rollouts_return_value_is_checked_and_errors_name_file_line_and_function(tmp_path):
    assert checked_outcome(1, "x").reward == 1.0 and checked_outcome({"a": 0.5}, "x").reward == {"a": 0.5}
    for bad, what in ((math.inf, "reward of inf"), (True, "(bool)"), ({"a": "1"}, "(str)"), (None, "(NoneType)")):
        with pytest.raises(SandboxError, match=what.replace("(", r"\(").replace(")", r"\)")):
            checked_outcome(bad, "agent.py in rollout()")
    (tmp_path / "agent.py").write_text("def tasks(split):\n    yield {'id': 1}\n    raise KeyError('x')\n\n"
                                       "async def rollout(task, llm):\n    return llm['missing']\n")
    agent = load_agent(str(tmp_path))
    with pytest.raises(SandboxError, match=rf"{tmp_path / 'agent.py'}:3 in tasks\(\): KeyError"):
        list(agent.tasks("train"))
    with pytest.raises(SandboxError, match=rf"{tmp_path / 'agent.py'}:6 in rollout\(\): KeyError"):
        asyncio.run(agent.rollout({}, {}))


def test_a_rollout_past_its_deadline_is_cancelled_and_the_client_carries_on(live_server, tmp_path, monkeypatch):
    """In one client, an awaiting hang on one task costs that task its episodes (each aborted, each a failure
    that is retried) while the other tasks' episodes finish; a rollout that even swallows its cancellation
    is left behind after the grace period."""
    server = live_server(engine__kind="instant")
    (tmp_path / "agent.py").write_text(
        "import asyncio\n\ndef tasks(split):\n    for i in range(3):\n        yield {'id': f't{i}'}\n\n"
        "async def rollout(task, llm):\n    if task['id'] == 't0':\n        await asyncio.Event().wait()\n"
        "    return 1.0\n")
    agent = load_agent(str(tmp_path))
    stats = asyncio.run(asyncio.wait_for(run_agent(  # without a deadline, t0 would hang the runner: fail instead
        agent, server.url, concurrency=2, group_size=1, max_tasks=3, max_consecutive_failures=0,
        episode_timeout_s=0.5), timeout=60))
    assert (stats.finished, stats.failed) == (2, EPISODE_ATTEMPTS)
    counters = server.status()["episodes"]
    assert (counters["finished"], counters["aborted"], counters["expired"]) == (2, EPISODE_ATTEMPTS, 0)
    aborted = [ep for ep in server.registry._ended.values() if ep.state == "aborted"]
    assert {ep.task_id for ep in aborted} == {"t0"}
    limit = f"EpisodeTimeout: {tmp_path / 'agent.py'} in rollout() ran past the 0.5 s episode limit"
    assert all(ep.abort_reason.startswith(limit) for ep in aborted)

    async def stubborn():  # ignores its first cancellation for far longer than the grace period
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            await asyncio.sleep(3600)

    async def main():  # the runner moves on after the grace period instead of waiting for the rollout
        with pytest.raises(EpisodeTimeout, match=r"x\.py in rollout\(\) ran past the 0\.1 s"):
            await within_limit(stubborn(), 0.1, "x.py")

    monkeypatch.setattr(deadline, "CANCEL_GRACE_S", 0.1)
    asyncio.run(asyncio.wait_for(main(), timeout=30))  # a TimeoutError here: it waited for the stubborn rollout
