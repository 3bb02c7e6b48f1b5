"""A run with `containment.clients` on starts its client processes contained: agent code sees none of the
run's credentials, under bubblewrap it writes its own working folder and nothing else, and the run still
trains. `required` on a machine without bwrap, or a client that cannot be contained, is a one-line error
before any model loads. Real runs of the tiny model with a sandbox written here; real processes."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from core.contain import contained as contain
from core.config_io import ConfigError, load_config
from core.run.loop import CoreRun
from core.run.plan import describe
from tests.researcher.test_contain import SECRETS
from tests.support import train_in_process

ROOT = Path(__file__).resolve().parents[2]
AGENT = """
import json, os, socket
from pathlib import Path

def tasks(split):
    for i in range(4):
        yield {{"id": f"{{split}}-{{i}}", "prompt": "say a"}}

def _put(name, value):
    # Every episode rewrites these: a rename, so the test never reads one half written.
    part = f"{{name}}.{{id(value)}}.part"  # one per call: a group's episodes run side by side
    Path(part).write_text(json.dumps(value))
    os.replace(part, name)

async def rollout(task, llm):
    _put("env.json", dict(os.environ))  # the cwd: the client's own working folder
    seen = {{}}
    for secret in {reads!r}:  # the admin token files this user could read
        try:
            seen[secret] = Path(secret).read_text()
        except OSError as e:
            seen[secret] = type(e).__name__
    _put("reads.json", seen)
    dialed = {{}}
    for port in {ports!r}:  # local ports that are not its server's: MLflow's, Ray's, any other
        try:
            socket.create_connection(("127.0.0.1", port), timeout=3).close()
            dialed[port] = "connected"
        except OSError as e:
            dialed[port] = type(e).__name__
    _put("net.json", dialed)
    tried = {{}}
    for target in {targets!r}:
        try:
            Path(target).write_text("planted")
            tried[target] = "wrote"
        except OSError as e:
            tried[target] = type(e).__name__
    _put("writes.json", tried)  # last: once it is there, so are the others
    reply = await llm.chat.completions.create(model=llm.model, messages=[{{"role": "user", "content": task["prompt"]}}],
                                              max_tokens=4)
    return float(len(reply.choices[0].message.content or "") % 3)
"""


def _sandbox(tmp_path: Path, targets: list[str], reads: list[str] = (), ports: list[int] = ()) -> Path:
    folder = tmp_path / "nosy"
    folder.mkdir()
    (folder / "agent.py").write_text(AGENT.format(targets=targets, reads=list(reads), ports=list(ports)))
    return folder


def _train(tmp_path: Path, sandbox: Path, mode: str, steps: int = 2) -> tuple[CoreRun, Path]:
    """A tiny run of `steps` steps with one isolated client of `sandbox`, contained per `mode`: (run, its working folder)."""
    cfg = load_config(ROOT / "configs" / "tiny.yaml", [
        f"trainer.steps={steps}", "trainer.batch_groups=1", "trainer.group_size=2",
        f"trainer.checkpoint_dir={tmp_path / 'run' / 'checkpoints'}", f"containment.clients={mode}",
        f"clients=[{{agent: '{sandbox}', concurrency: 2}}]"])
    core = CoreRun(cfg)
    train_in_process(core)
    return core, tmp_path / "run" / "clients" / f"0-{sandbox.name}"


@pytest.mark.slow
def test_a_contained_client_sees_no_credential_of_the_run_and_the_run_trains(tmp_path, monkeypatch):
    for k, v in SECRETS.items():
        monkeypatch.setenv(k, v)
    core, workdir = _train(tmp_path, _sandbox(tmp_path, []), "auto")
    assert core.step == 2 and core.failure is None
    assert core.server.registry.counters["trained"] >= 4  # two steps of one group of two episodes
    env = json.loads((workdir / "env.json").read_text())
    assert not set(SECRETS) & set(env), sorted(env)
    assert not any(v in json.dumps(env) for v in SECRETS.values())
    assert env["HOME"] != str(Path.home()) and "PATH" in env


@pytest.mark.slow
@pytest.mark.skipif(contain.bwrap() is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")
def test_under_bwrap_a_client_cannot_write_outside_its_working_folder_nor_dial_a_local_port_and_the_run_goes_on(
        tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    mlflow = socket.socket()  # a real listening port on the host's loopback, as `mlflow server` or Ray's would be
    mlflow.bind(("127.0.0.1", 0))
    mlflow.listen()
    port = mlflow.getsockname()[1]
    sandbox = _sandbox(tmp_path, [str(outside / "planted.txt"), str(tmp_path / "nosy" / "agent.py"),
                                  str(ROOT / "planted.txt")], reads=[str(tmp_path / "run" / "admin_token")],
                       ports=[port])
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "admin_token").write_text("the-runs-admin-token")  # as `swarm run` leaves it, 0600
    agent_text = (sandbox / "agent.py").read_text()
    try:
        core, workdir = _train(tmp_path, sandbox, "required", steps=1)
        assert core.step == 1 and core.failure is None
        # Its episodes are credited to the process the supervisor started (bwrap, the host pid the client ends
        # its id with), not to pid 2 of its namespace: a client that works is not counted as crash-looping.
        started = {c.proc.pid for c in core.supervisor.clients}
        credited = core.server.registry.finished_by()
        assert credited and all(cid.rsplit("-", 1)[1] in {str(p) for p in started} for cid in credited), credited
        tried = json.loads((workdir / "writes.json").read_text())
        assert len(tried) == 3 and "wrote" not in tried.values(), tried  # each write raised in the agent
        assert not (outside / "planted.txt").exists() and not (ROOT / "planted.txt").exists()
        assert (sandbox / "agent.py").read_text() == agent_text  # its own code is read-only too
        seen = json.loads((workdir / "reads.json").read_text())[str(tmp_path / "run" / "admin_token")]
        assert seen in ("", "PermissionError"), seen  # masked by /dev/null: never the token
        # It trained through its forwarder, yet no other port of this machine answers it: its own network namespace.
        assert json.loads((workdir / "net.json").read_text()) == {str(port): "ConnectionRefusedError"}
    finally:
        mlflow.close()
        (ROOT / "planted.txt").unlink(missing_ok=True)  # should containment fail, the project stays clean


def test_required_containment_without_bwrap_stops_swarm_run_before_any_model_loads(tmp_path):
    env = {"PATH": str(tmp_path), "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}  # a PATH without bwrap
    done = subprocess.run([sys.executable, "-m", "core.run.cli", "run", str(ROOT / "configs" / "tiny.yaml"),
                           "--set", "containment.clients=required", "--set", f"trainer.checkpoint_dir={tmp_path}"],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    message = " ".join(done.stderr.split())
    assert "containment.clients is required to run under bubblewrap" in message and \
           "apt-get install bubblewrap" in message, done.stderr
    assert "serving at" not in done.stderr + done.stdout


def test_required_containment_without_bwrap_is_refused_by_the_run_itself(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    cfg = load_config(overrides=["containment.clients=required", f"trainer.checkpoint_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"apt-get install bubblewrap"):
        CoreRun(cfg)


@pytest.mark.parametrize("mode", ["auto", "required"])
def test_a_client_that_cannot_be_contained_is_a_config_error_naming_it(mode):
    with pytest.raises(ConfigError, match=r"clients\.0\.isolate is false: a thread of the run cannot be contained"):
        load_config(overrides=[f"containment.clients={mode}", "clients=[{agent: 'sandbox:letters', isolate: false}]"])
    with pytest.raises(ConfigError, match=r"Ray actors cannot be"):
        load_config(overrides=[f"containment.clients={mode}", "placement.kind=ray", "clients=[{agent: 'sandbox:letters'}]"])
    assert load_config(overrides=["clients=[{agent: 'sandbox:letters', isolate: false}]"]).containment.clients == "off"
    # YAML reads a bare `off` as false: still the mode, not a type error
    assert load_config(overrides=["containment.clients=off"]).containment.clients == "off"


def test_a_drain_signal_reaches_the_contained_command_itself(tmp_path):
    """The supervisor drains a contained client by signalling its group: under bwrap the command is not
    bwrap's own process, so a signal to bwrap alone would never reach it (the stop would wait, then kill)."""
    code = ("import signal, sys, time, pathlib\n"
            "signal.signal(signal.SIGTERM, lambda *_: (pathlib.Path('drained').write_text('ok'), sys.exit(0)))\n"
            "pathlib.Path('ready').write_text('ok')\n"
            "time.sleep(60)\n")
    started = contain.popen_contained([sys.executable, "-c", code], tmp_path, writable=[tmp_path])
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "ready").exists():
            assert time.monotonic() < deadline and started.proc.poll() is None, "the contained command did not start"
            time.sleep(0.05)
        started.signal(signal.SIGTERM)
        assert started.proc.wait(timeout=20) == 0
    finally:
        started.close()
    assert (tmp_path / "drained").read_text() == "ok"


def test_the_dry_run_plan_says_which_clients_run_contained():
    shown = describe(load_config(ROOT / "configs" / "tiny.yaml", ["containment.clients=auto"]))
    assert "its own process (swarm client, contained: auto)" in shown
    assert "contained" not in describe(load_config(ROOT / "configs" / "tiny.yaml"))


def _swarm(*args: str, env: dict, cwd: Path = ROOT, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "core.run.cli", *args], cwd=cwd, env=env, text=True, **popen)


@pytest.mark.slow
@pytest.mark.skipif(contain.bwrap() is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")
def test_a_client_swapped_in_with_contain_sees_no_credential_and_writes_only_its_own_folder(tmp_path, live_server):
    """A study swaps proposal code into its live run with `swarm swap --ab --contain required`: the new
    client is detached from the swap (it serves on after the command exits) and still contained."""
    server = live_server()
    outside = tmp_path / "outside"
    outside.mkdir()
    for version in ("v1", "v2", "old-cwd"):
        (tmp_path / version).mkdir()
    old = _sandbox(tmp_path / "v1", [])  # the same sandbox (`nosy`) in two versions
    state = tmp_path / "state"
    token = state / "servers" / "4242.token"  # another server's, as `swarm serve` leaves it on this machine
    token.parent.mkdir(parents=True)
    token.write_text("another-servers-admin-token")
    new = _sandbox(tmp_path / "v2", [str(outside / "planted.txt"), str(tmp_path / "v2" / "nosy" / "agent.py"),
                                     str(ROOT / "planted.txt")], reads=[str(token)])
    env = {**os.environ, **SECRETS, "SWARMRL_STATE": str(state), "PYTHONPATH": str(ROOT)}
    # Eval episodes: a server without a trainer holds back train ones once two batches wait (back-pressure).
    old_client = _swarm("client", str(old), "--server", server.url, "--group-size", "2", "--kind", "eval", env=env,
                        cwd=tmp_path / "old-cwd", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    new_pid = None
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "old-cwd" / "writes.json").is_file():  # an episode done: it has registered
            assert time.monotonic() < deadline and old_client.poll() is None, "the old client did not start"
            time.sleep(0.2)
        swap = _swarm("swap", str(new), "--server", server.url, "--admin-token", server.admin_token, "--ab",
                      "--contain", "required", env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = swap.communicate(timeout=300)
        assert swap.returncode == 0, err[-3000:]
        found = re.search(r"new client (\S+) \(pid (\d+)", out)
        assert found, out
        client_id, new_pid = found.group(1), int(found.group(2))
        workdir = state / client_id
        assert (workdir / "writes.json").is_file(), sorted(p.name for p in state.iterdir())
        assert os.getpgid(new_pid) == new_pid  # alive after `swarm swap` exited: detached, its own group
        # It registered the pid its starter sees (bwrap's), not pid 2 of its own namespace: the pid a study
        # watches exit.
        admin = {"Authorization": f"Bearer {server.admin_token}"}  # other clients' ids: the admin token's to read
        [listed] = [c for c in httpx.get(f"{server.url}/swarm/v1/status", headers=admin, timeout=10).json()["clients"]
                    if c["client_id"] == client_id]
        assert listed["pid"] == new_pid
        seen = json.loads((workdir / "env.json").read_text())
        assert not set(SECRETS) & set(seen), sorted(seen)
        assert not any(v in json.dumps(seen) for v in SECRETS.values())
        assert seen["HOME"] == str(workdir / ".home")
        tried = json.loads((workdir / "writes.json").read_text())
        assert len(tried) == 3 and "wrote" not in tried.values(), tried
        assert not (outside / "planted.txt").exists() and not (ROOT / "planted.txt").exists()
        assert json.loads((workdir / "reads.json").read_text()) == {str(token): "FileNotFoundError"}  # masked
    finally:
        if new_pid is not None:
            os.killpg(new_pid, signal.SIGKILL)
        old_client.kill()
        old_client.wait()
        (ROOT / "planted.txt").unlink(missing_ok=True)


@pytest.mark.parametrize("mode, search_path, message", [
    ("required", "empty", "swarm swap --contain is required to run under bubblewrap"),
    ("sealed", "inherited", "--contain must be one of off, auto, required, not 'sealed'"),
])
def test_swarm_swap_refuses_a_containment_it_cannot_give_before_starting_anything(tmp_path, mode, search_path, message):
    env = {**os.environ, "SWARMRL_STATE": str(tmp_path / "state"), "PYTHONPATH": str(ROOT)}
    env["PATH"] = str(tmp_path) if search_path == "empty" else env["PATH"]  # empty: a PATH without bwrap
    swap = _swarm("swap", "sandbox:letters", "--server", "http://127.0.0.1:9", "--admin-token", "t", "--contain", mode,
                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = swap.communicate(timeout=120)
    assert swap.returncode == 2, err
    assert message in " ".join(err.split()), err
    assert not (tmp_path / "state").exists() or not list((tmp_path / "state").glob("*.log"))
