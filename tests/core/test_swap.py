"""Hot swap through the server: the client table's rules, and one real `swarm run` swapped live.

The end-to-end test runs `swarm run` (tiny model) with one isolated client of a copied `letters`
sandbox, then `swarm swap`s in a copy whose reward function returns a constant. One live run serves
every assertion: a swap to code that fails to import and a swap with a wrong admin token are refused
and leave the old client serving; the real swap keeps `--kind`/`--group-size`, drains the old client
(which exits on its own), loses no episode, is tagged on the MLflow run, and every trained episode
after it carries the new version and the new reward in the per-version metrics. The swap process
gets an empty `SWARMRL_STATE`: it needs nothing local about the old client, only the run's server file.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from mlflow.tracking import MlflowClient

from core.episodes.client_table import CLIENT_TTL_S, ClientTable
from core.episodes.errors import Refusal
from core.clients.sandbox import load_agent
from core.episodes.wire import DrainClients, RegisterClient

ROOT = Path(__file__).resolve().parents[2]
NEW_REWARD = 0.75  # the swapped-in reward function returns this for every reply


def _reg(cid: str, sandbox: str = "letters", version: str = "v1") -> RegisterClient:
    return RegisterClient(client_id=cid, sandbox=sandbox, version=version, pid=1, host="h", group_size=2)


def test_the_client_table_keys_heartbeats_drains_named_clients_for_a_successor_and_forgets_the_silent():
    now = [1000.0]
    swaps = []
    table = ClientTable(clock=lambda: now[0], on_swap=swaps.append)
    key = table.register(_reg("old"), "").key
    assert table.register(_reg("old"), key).drain is False
    with pytest.raises(Refusal) as e:
        table.register(_reg("old"), "wrong")  # someone else cannot renew (or un-drain) a client
    assert e.value.status == 401
    with pytest.raises(Refusal) as e:
        table.drain(DrainClients(sandbox="letters", client_ids=["old"], successor="nobody"))
    assert e.value.status == 409 and not table.register(_reg("old"), key).drain  # nothing was marked
    with pytest.raises(Refusal) as e:
        table.drain(DrainClients(sandbox="other", client_ids=["old"]))
    assert e.value.status == 404
    table.register(_reg("new", version="v2"), "")
    record = table.drain(DrainClients(sandbox="letters", client_ids=["old"], successor="new"))
    assert (record.n, record.from_versions, record.to_version, record.drained) == (1, ["v1"], "v2", ["old"])
    assert swaps == [record]
    assert table.register(_reg("old"), key).drain is True  # the order sticks to the id
    assert [c["state"] for c in table.listing()] == ["draining", "serving"]
    now[0] += CLIENT_TTL_S + 1
    assert table.listing() == []  # silent clients (SIGKILLed, machine gone) are dropped


def _sandbox_copy(dest: Path, reward_body: str | None = None) -> Path:
    """letters, unjudged: this test tells the versions apart by the reward each one's own code returns (a judged
    sandbox's score is the server's, whatever code runs: tests/core/test_judge.py)."""
    folder = dest / "letters"
    shutil.copytree(ROOT / "sandboxes" / "letters", folder, ignore=shutil.ignore_patterns("__pycache__", "tests"))
    toml = folder / "sandbox.toml"
    toml.write_text("".join(line for line in toml.read_text().splitlines(keepends=True) if not line.startswith("judge")))
    if reward_body is not None:
        text = (folder / "reward.py").read_text()
        start, end = text.index("def reward("), text.index("def tasks(")
        (folder / "reward.py").write_text(text[:start] + f"def reward(text: str) -> float:\n    {reward_body}\n\n\n"
                                          + text[end:])
    return folder


def _swap(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "core.run.cli", "swap", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_swarm_swap_replaces_a_live_runs_client_through_the_server(tmp_path: Path):
    old_code = _sandbox_copy(tmp_path / "v1")
    new_code = _sandbox_copy(tmp_path / "v2", f"return {NEW_REWARD}")
    broken = _sandbox_copy(tmp_path / "broken")
    (broken / "agent.py").write_text("import no_such_module_anywhere\n")
    raises = _sandbox_copy(tmp_path / "raises", 'raise RuntimeError("new code that fails every episode")')
    old_version, new_version = load_agent(str(old_code)).version, load_agent(str(new_code)).version
    assert old_version != new_version
    run_dir = tmp_path / "run"
    config = {
        "models": [{"name": "policy", "source": "tiny"}],
        "engine": {"max_batch": 16, "default_max_tokens": 8},
        "server": {"port": 0},
        "trainer": {"steps": 10_000, "batch_groups": 1, "group_size": 4, "lr": 0.003,
                    "checkpoint_dir": str(run_dir / "checkpoints"), "checkpoint_every": 0},
        "clients": [{"agent": str(old_code), "isolate": True, "group_size": 2, "concurrency": 4}],
        "telemetry": {"experiment": "swap-test", "trajectories_per_step": 0},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "SWARMRL_STATE": str(tmp_path / "run-state")}
    run = subprocess.Popen([sys.executable, "-m", "core.run.cli", "run", str(tmp_path / "run.yaml"), "--quiet",
                            "--run-id-file", str(run_dir / "run_id")], cwd=ROOT, env=env,
                           stdout=open(tmp_path / "run.log", "wb"), stderr=subprocess.STDOUT)
    swap_env = {**os.environ, "SWARMRL_STATE": str(tmp_path / "swap-state")}  # nothing local about the old client
    try:
        server = json.loads(_wait(lambda: (run_dir / "server.json").is_file() and (run_dir / "server.json").read_text(),
                                  300, "the run's server file"))
        url, token = server["url"], Path(server["admin_token_file"]).read_text().strip()
        assert (Path(server["admin_token_file"]).stat().st_mode & 0o777) == 0o600

        def status() -> dict:
            # other clients' ids and versions, and the swaps: the admin token's to read
            return httpx.get(f"{url}/swarm/v1/status", headers={"Authorization": f"Bearer {token}"}, timeout=10).json()

        def letters() -> list[dict]:
            return [c for c in status()["clients"] if c["sandbox"] == "letters"]

        _wait(lambda: status()["models"]["policy"]["step"] >= 2 and letters(), 300, "two steps of the old client")
        [old] = letters()
        assert (old["version"], old["group_size"], old["kind"], old["concurrency"]) == (old_version, 2, "train", 4)

        # Refused swaps start nothing and leave the old client serving.
        bad = _swap(str(broken), "--server", str(run_dir), env=swap_env)
        assert bad.returncode == 2 and "failed to import" in bad.stderr and "left alone" in bad.stderr, bad.stderr
        wrong = _swap(str(new_code), "--server", url, "--admin-token", "wrong", env=swap_env)
        assert wrong.returncode == 2 and "refused the admin token (401)" in wrong.stderr, wrong.stderr
        raw = httpx.post(f"{url}/swarm/v1/admin/drain", json={"sandbox": "letters", "client_ids": [old["client_id"]]},
                         headers={"Authorization": "Bearer wrong"}, timeout=10)
        assert raw.status_code == 401
        # New code that imports but fails every episode never replaces working code: it is stopped.
        failing = _swap(str(raises), "--server", str(run_dir), env=swap_env)
        assert failing.returncode == 1, failing.stderr
        assert re.search(r"the new client failed \d+ episodes and finished none; it was stopped and the old client "
                         r"keeps serving", failing.stderr), failing.stderr
        assert "new code that fails every episode" in failing.stderr  # its log tail says why
        _wait(lambda: [c["client_id"] for c in letters()] == [old["client_id"]], 60, "the failed new client to go")
        assert letters()[0]["state"] == "serving"
        before = status()["episodes"]

        done = _swap(str(new_code), "--server", str(run_dir), env=swap_env)
        assert done.returncode == 0, done.stderr[-3000:]
        assert f"swapped letters: {old_version} -> {new_version}" in done.stdout
        [new] = letters()  # swap waited for the old client to drain and leave
        assert (new["version"], new["group_size"], new["kind"], new["concurrency"]) == (new_version, 2, "train", 4)
        assert new["client_id"] != old["client_id"]
        _wait(lambda: not _alive(old["pid"]), 30, "the drained old client to exit on its own")
        [record] = status()["swaps"]
        assert (record["from_versions"], record["to_version"], record["drained"]) == ([old_version], new_version,
                                                                                      [old["client_id"]])
        swap_step = record["step"]
        _wait(lambda: status()["models"]["policy"]["step"] >= swap_step + 4, 300, "four steps after the swap")
        counters = status()["episodes"]  # the drain lost no episode: nothing aborted or expired since the swap
        assert (counters["aborted"], counters["expired"]) == (before["aborted"], before["expired"])
        httpx.post(f"{url}/swarm/v1/admin/shutdown", headers={"Authorization": f"Bearer {token}"}, timeout=10)
        assert run.wait(timeout=180) == 130  # stopped before its steps: KILLED
        assert not (run_dir / "server.json").exists()
    finally:
        if run.poll() is None:
            run.send_signal(signal.SIGINT)
            run.wait(timeout=60)
        _stop_swap_clients(tmp_path / "swap-state")
    tail = (tmp_path / "run.log").read_text(errors="replace")[-3000:]
    assert not _alive(new["pid"]), "the swapped-in client must end with the run (drained at shutdown)\n" + tail
    mlflow = MlflowClient()
    run_id = (run_dir / "run_id").read_text().strip()
    tag = json.loads(mlflow.get_run(run_id).data.tags["swarmrl.sandbox_swap.1"])
    assert (tag["step"], tag["to_version"], tag["from_versions"]) == (swap_step, new_version, [old_version])
    after = mlflow.get_metric_history(run_id, f"reward/letters/version/{new_version}")
    before = mlflow.get_metric_history(run_id, f"reward/letters/version/{old_version}")
    # The new version trains after the swap, every one of its episodes scored by the new reward function.
    # (It may also train a little before: it serves from registration, a settle time before the drain.)
    assert after and all(m.value == NEW_REWARD for m in after) and max(m.step for m in after) > swap_step
    assert before and min(m.step for m in before) <= swap_step
    assert any(m.value != NEW_REWARD for m in before)  # the old reward function scored the old version's episodes


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").is_file() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def _stop_swap_clients(state: Path) -> None:
    """Clients `swarm swap` started are detached from the test: SIGINT any that outlived the run."""
    for pid_file in state.glob("*.pid"):
        pid = json.loads(pid_file.read_text())["pid"]
        if _alive(pid):
            os.kill(pid, signal.SIGINT)
