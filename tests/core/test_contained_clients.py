"""A run with `containment.clients` on starts its client processes contained: agent code sees none of the
run's credentials, under bubblewrap it writes its own working folder and nothing else, and the run still
trains. `required` on a machine without bwrap, or a client that cannot be contained, is a one-line error
before any model loads. Real runs of the tiny model with a sandbox written here; real processes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core.clients import contain
from core.config import ConfigError, load_config
from core.run.loop import CoreRun
from core.run.plan import describe
from tests.researcher.test_contain import SECRETS

ROOT = Path(__file__).resolve().parents[2]
AGENT = """
import json, os
from pathlib import Path

def tasks(split):
    for i in range(4):
        yield {{"id": f"{{split}}-{{i}}", "prompt": "say a"}}

async def rollout(task, llm):
    Path("env.json").write_text(json.dumps(dict(os.environ)))  # the cwd: the client's own working folder
    tried = {{}}
    for target in {targets!r}:
        try:
            Path(target).write_text("planted")
            tried[target] = "wrote"
        except OSError as e:
            tried[target] = type(e).__name__
    Path("writes.json").write_text(json.dumps(tried))
    reply = await llm.chat.completions.create(model=llm.model, messages=[{{"role": "user", "content": task["prompt"]}}],
                                              max_tokens=4)
    return float(len(reply.choices[0].message.content or "") % 3)
"""


def _sandbox(tmp_path: Path, targets: list[str]) -> Path:
    folder = tmp_path / "nosy"
    folder.mkdir()
    (folder / "agent.py").write_text(AGENT.format(targets=targets))
    return folder


def _train(tmp_path: Path, sandbox: Path, mode: str, steps: int = 2) -> tuple[CoreRun, Path]:
    """A tiny run of `steps` steps with one isolated client of `sandbox`, contained per `mode`: (run, its working folder)."""
    cfg = load_config(ROOT / "configs" / "tiny.yaml", [
        f"trainer.steps={steps}", "trainer.batch_groups=1", "trainer.group_size=2",
        f"trainer.checkpoint_dir={tmp_path / 'run' / 'checkpoints'}", f"containment.clients={mode}",
        f"clients=[{{agent: '{sandbox}', concurrency: 2}}]"])
    core = CoreRun(cfg)
    core.server.start()
    try:
        core.start_clients()
        core.train()
    finally:
        core.stop_clients()
        core.server.stop()
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
def test_under_bwrap_a_client_cannot_write_outside_its_working_folder_and_the_run_goes_on(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    sandbox = _sandbox(tmp_path, [str(outside / "planted.txt"), str(tmp_path / "nosy" / "agent.py"),
                                  str(ROOT / "planted.txt")])
    agent_text = (sandbox / "agent.py").read_text()
    try:
        core, workdir = _train(tmp_path, sandbox, "required", steps=1)
        assert core.step == 1 and core.failure is None
        tried = json.loads((workdir / "writes.json").read_text())
        assert len(tried) == 3 and "wrote" not in tried.values(), tried  # each write raised in the agent
        assert not (outside / "planted.txt").exists() and not (ROOT / "planted.txt").exists()
        assert (sandbox / "agent.py").read_text() == agent_text  # its own code is read-only too
    finally:
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
