"""Sandbox names are confined: `sandbox:NAME` is a folder directly under sandboxes/, a sandbox.toml `name`
is a plain name, and the pid and log files built from names stay in the state folder.

Code from elsewhere runs only when the config names its folder as a path (that is the person's choice,
kept working here). The `swarm run` refusal goes through the real CLI.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from core.clients.pid_file import PidFile, client_stem
from core.sandbox.folder import SandboxNotFound, locate, safe_name
from core.clients.sandbox import load_agent

AGENT = "def tasks(split):\n    yield {'id': 't'}\n\nasync def rollout(task, llm):\n    return 1.0\n"


def _folder(path: Path, toml: str | None = None) -> Path:
    path.mkdir(parents=True)
    (path / "agent.py").write_text(AGENT)
    if toml is not None:
        (path / "sandbox.toml").write_text(toml)
    return path


@pytest.mark.parametrize("name", ["../outside", "../../outside", "ABSOLUTE", "a/b", "..", "."])
def test_a_sandbox_name_that_is_not_a_plain_name_is_refused(tmp_path: Path, name: str) -> None:
    outside = _folder(tmp_path / "outside")
    _folder(tmp_path / "project" / "sandboxes" / "a" / "b")
    roots = [tmp_path / "project" / "sandboxes"]
    name = str(outside) if name == "ABSOLUTE" else name
    with pytest.raises(SandboxNotFound, match=r"sandbox name .* is refused: `sandbox:NAME` names a folder directly"):
        locate(f"sandbox:{name}", roots)
    with pytest.raises(SandboxNotFound):
        load_agent(f"sandbox:{name}", roots)


def test_a_folder_the_config_names_as_a_path_still_loads(tmp_path: Path) -> None:
    outside = _folder(tmp_path / "outside")
    assert locate(str(outside)) == str(outside)
    assert load_agent(str(outside)).name == "outside"


@pytest.mark.parametrize("bad", ["../../../tmp/x", "a/b", "a\\\\b", ".."])
def test_a_sandbox_toml_name_with_a_path_separator_is_refused(tmp_path: Path, bad: str) -> None:
    folder = _folder(tmp_path / "sneaky", f'name = "{bad}"\n')
    with pytest.raises(ValueError, match=r"sandbox.toml: name .* is refused; a sandbox's name must be a plain name"):
        load_agent(str(folder))


def test_pid_and_log_file_names_are_built_from_sanitized_names(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SWARMRL_STATE", str(tmp_path / "state"))
    pid = PidFile.create("../../../tmp/x", "http://127.0.0.1:8000")
    try:
        assert pid.path.parent == tmp_path / "state" and pid.path.is_file()
    finally:
        pid.remove()
    assert "/" not in client_stem("a/../b", "http://h:1") and not safe_name("..hidden").startswith(".")


def test_swarm_run_refuses_a_sandbox_name_leaving_sandboxes(tmp_path: Path) -> None:
    project = tmp_path / "project"
    _folder(project / "sandboxes" / "ok")
    _folder(tmp_path / "outside")
    (project / "configs").mkdir()
    (project / "configs" / "x.yaml").write_text("clients:\n  - agent: sandbox:../../outside\n")
    done = subprocess.run([sys.executable, "-m", "core.run.cli", "run", str(project / "configs" / "x.yaml"),
                           "--dry-run"], cwd=project, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "sandbox name '../../outside' is refused" in done.stderr and "Traceback" not in done.stderr
