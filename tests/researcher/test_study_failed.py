"""A study that cannot go on ends `failed`, says why, and is never shown as still running at the node that
raised: a real `researcher study start` on a project whose editable sandbox holds a symlink leading out of it
(the workspace node refuses it), then `status`, `status --json`, `list` and `report` from the CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from tests.researcher.harness import BIN, ROOT, empty_store

BRIEF = """---
title: a workspace that is refused
objective: {metric: reward/mean, direction: maximize}
budget: {max_runs: 2, max_rounds: 1}
run:
  base_config: configs/tiny.yaml
  overrides: {trainer.steps: 2}
search_space:
  agent: {kind: code, paths: [sandboxes/letters/agent.py]}
code:
  editable: [sandboxes/letters/]
seeds: [0]
---
Its editable sandbox holds a link out of it.
"""
WHY = "failed in workspace: WorkspaceError: sandboxes/letters/data: a symlink"


def _cli(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{folder / 'mlflow.db'}", "COLUMNS": "400"}
    return subprocess.run([str(BIN / "researcher"), "study", "--studies-dir", str(folder / "studies"), *args],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=600)


def test_a_study_whose_workspace_is_refused_ends_failed_with_the_reason_everywhere(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "sandboxes" / "letters", tmp_path / "sandboxes" / "letters",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    (tmp_path / "outside").mkdir()
    (tmp_path / "sandboxes" / "letters" / "data").symlink_to("../../outside/")
    shutil.copyfile(empty_store(), tmp_path / "mlflow.db")
    (tmp_path / "brief.md").write_text(BRIEF)

    started = _cli(tmp_path, "start", "brief.md", "--name", "refused", "--planner", "heuristic")
    assert started.returncode == 2, started.stdout + started.stderr
    assert WHY in started.stdout and "Traceback" not in started.stdout + started.stderr, started.stdout + started.stderr

    status = _cli(tmp_path, "status", "refused")
    assert WHY in status.stdout and "not running" in status.stdout, status.stdout
    assert "phase workspace" not in status.stdout
    as_json = json.loads(_cli(tmp_path, "status", "refused", "--json").stdout)
    assert as_json["phase"].startswith(WHY) and as_json["running"] is False
    listed = _cli(tmp_path, "list").stdout
    assert listed.startswith("refused: " + WHY) and "workspace, round 0" not in listed, listed
    report = _cli(tmp_path, "report", "refused")
    assert report.returncode == 0, report.stdout + report.stderr
    assert f"Status: {WHY}" in (tmp_path / "studies" / "refused" / "report.md").read_text()
