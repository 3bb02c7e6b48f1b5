"""`sandbox:NAME` resolves against the config file's project, then the current folder; a missing one is a
one-line error naming where it looked (the real CLI, from another folder). A whole `swarm run` from
another folder: tests/core/test_run.py::test_swarm_run_exits_zero_and_logs_the_metric_contract."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from core.clients.sandbox import load_agent
from core.sandbox.folder import locate, sandbox_roots

AGENT = "def tasks(split):\n    yield {{'id': 't'}}\n\nasync def rollout(task, llm):\n    return {reward}\n"


def _sandbox(root: Path, name: str, reward: float) -> None:
    (root / "sandboxes" / name).mkdir(parents=True)
    (root / "sandboxes" / name / "agent.py").write_text(AGENT.format(reward=reward))


def test_the_configs_project_comes_first_then_the_current_folder(tmp_path, monkeypatch):
    project, here = tmp_path / "project", tmp_path / "here"
    _sandbox(project, "both", 1.0)
    _sandbox(here, "both", 2.0)
    _sandbox(here, "only_here", 3.0)
    (project / "configs" / "deep").mkdir(parents=True)
    config = project / "configs" / "deep" / "x.yaml"
    config.write_text("{}\n")
    monkeypatch.chdir(here)
    roots = sandbox_roots(config)
    assert roots == [project / "sandboxes", here / "sandboxes"]
    assert locate("sandbox:both", roots) == str(project / "sandboxes" / "both")
    assert locate("sandbox:only_here", roots) == str(here / "sandboxes" / "only_here")
    assert locate("some.module", roots) == "some.module"
    assert load_agent("sandbox:both", roots).name == "both"


def test_a_missing_sandbox_is_one_line_naming_where_it_looked(tmp_path):
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    _sandbox(project, "present", 1.0)
    (project / "configs").mkdir()
    (project / "configs" / "x.yaml").write_text("clients:\n  - agent: sandbox:present\n  - agent: sandbox:absent\n")
    elsewhere.mkdir()
    done = subprocess.run([sys.executable, "-m", "core.run.cli", "run", str(project / "configs" / "x.yaml")], cwd=elsewhere,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip() == (f"sandbox 'absent' not found: no agent.py in {project / 'sandboxes' / 'absent'}, "
                                   f"{elsewhere / 'sandboxes' / 'absent'}")
    assert "Traceback" not in done.stderr + done.stdout
