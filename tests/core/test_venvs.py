"""Sandbox venvs: a sandbox's own dependency lives in a cached venv of its own, never in the project's,
and an isolated client of that sandbox runs there, in a working folder of its own."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core.contain import venvs
from core.config_io import load_config
from core.run.loop import CoreRun
from core.sandbox.folder import sandbox_meta, sandbox_requirements
from core.contain.venvs import VenvError, client_python, ensure_venv

ROOT = Path(__file__).resolve().parents[2]
ROMAN = ROOT / "sandboxes" / "roman"


def test_the_dependency_is_in_the_sandbox_venv_only_and_the_venv_is_cached(monkeypatch):
    assert importlib.util.find_spec("roman") is None  # not one of the project's dependencies
    python = client_python(str(ROMAN))  # builds it on a fresh machine (uv, PyPI), else reuses it
    assert python != sys.executable and Path(python).is_relative_to(venvs.venvs_root())
    probe = "import roman, core.clients.runner, sys; print(roman.__file__); print('torch' in sys.modules)"
    out = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr
    roman_file, torch_loaded = out.stdout.split()
    assert Path(roman_file).is_relative_to(Path(python).parents[1])  # the venv's own copy
    assert torch_loaded == "False"  # the client imports no torch; it sees the project's, never installs one

    ready = Path(python).parents[1] / "ready"
    before = ready.stat().st_mtime_ns

    def no_build(*args, **kwargs):
        raise AssertionError("a cached venv was rebuilt")

    monkeypatch.setattr(venvs, "_call", no_build)
    assert client_python(str(ROMAN)) == python  # second start: same venv, nothing built
    assert ready.stat().st_mtime_ns == before


def test_bad_requirements_are_errors_naming_the_sandbox(tmp_path):
    (tmp_path / "sandbox.toml").write_text('requirements = "roman"\n')
    with pytest.raises(ValueError, match=r"sandbox.toml: requirements must be a list"):
        sandbox_requirements(tmp_path, sandbox_meta(tmp_path))
    with pytest.raises(VenvError, match=r"venv of my-sandbox: `uv pip install ...` failed: .*roman=="):
        ensure_venv(["roman=="], label="my-sandbox", root=tmp_path / "venvs")  # not a requirement: uv refuses
    assert not any((tmp_path / "venvs").iterdir())  # no half-built venv left to be taken as ready
    assert client_python("core.nonexistent.module") == sys.executable  # module agents run on the project's python


@pytest.mark.slow
def test_an_isolated_client_runs_in_its_sandbox_venv_and_own_folder(tmp_path):
    cfg = load_config(ROOT / "configs" / "tiny.yaml", [
        "trainer.steps=1", "trainer.batch_groups=1", f"trainer.checkpoint_dir={tmp_path / 'run' / 'checkpoints'}",
        "clients=[{agent: 'sandbox:roman', group_size: 2, concurrency: 2}]"])
    assert cfg.clients[0].isolate  # the default
    core = CoreRun(cfg)
    core.server.start()
    try:
        core.start_clients()
        [pid] = core.supervisor.pids()
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert argv[0].decode() == client_python(str(ROMAN))
        workdir, deadline = str(tmp_path / "run" / "clients" / "0-roman"), time.time() + 60
        while os.readlink(f"/proc/{pid}/cwd") != workdir:  # it moves there first thing, once Python is up
            assert time.time() < deadline, os.readlink(f"/proc/{pid}/cwd")
            time.sleep(0.1)
        core.train()
    finally:
        core.stop_clients()
        core.server.stop()
    assert core.step == 1 and core.failure is None
    assert core.server.registry.counters["trained"] >= 2
