"""A file-level `code.editable` entry: the workspace keeps the rest of the sandbox folder (read-only),
so a run's checkout holds a whole sandbox that loads, and only the named file may change."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from core.clients.sandbox import load_agent
from researcher.brief.loader import parse_brief
from researcher.code.workspace import Workspace, WorkspaceError, sandbox_folders
from researcher.records import Edit

ROOT = Path(__file__).resolve().parents[2]
BRIEF = """---
objective: {metric: reward/mean}
run: {base_config: base.yaml}
search_space: {agent: {kind: code, paths: [sandboxes/letters/agent.py]}}
code: {editable: [sandboxes/letters/agent.py]}
---
"""


@pytest.fixture
def ws(tmp_path: Path) -> Workspace:
    project = tmp_path / "project"
    shutil.copytree(ROOT / "sandboxes" / "letters", project / "sandboxes" / "letters",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (project / "base.yaml").write_text("trainer: {steps: 2}\n")
    brief = parse_brief(BRIEF, workdir=project)
    return Workspace(tmp_path / "study" / "workspace", brief.code, project)  # type: ignore[arg-type]


def test_a_file_entry_keeps_its_sandbox_folders_other_files_and_the_checkout_loads(ws: Workspace,
                                                                                   tmp_path: Path) -> None:
    base = ws.base()
    original = sorted(p.name for p in (ws.project / "sandboxes" / "letters").iterdir() if p.is_file())
    assert "sandbox.toml" in original
    tree = ws.checkout(base, tmp_path / "run" / "code")
    copied = sorted(p.name for p in (tree / "sandboxes" / "letters").iterdir() if p.is_file())
    assert copied == original
    assert load_agent(str(tree / "sandboxes" / "letters")).name == "letters"  # a whole sandbox, as a run needs


def test_only_the_named_file_is_editable(ws: Workspace, tmp_path: Path) -> None:
    tree = ws.checkout(ws.base(), tmp_path / "trial")
    ws.apply_edits(tree, [Edit(file="sandboxes/letters/agent.py", search="MAX_TOKENS = 12", replace="MAX_TOKENS = 16")])
    assert ws.check_changes(tree) == [("M", "sandboxes/letters/agent.py")]
    with pytest.raises(WorkspaceError, match="sandboxes/letters/sandbox.toml: files outside the editable paths"):
        ws.check_path("sandboxes/letters/sandbox.toml", "modify")


def test_folder_entries_and_files_outside_sandboxes_bring_nothing_more(tmp_path: Path) -> None:
    (tmp_path / "sandboxes" / "a").mkdir(parents=True)
    (tmp_path / "sandboxes" / "a" / "agent.py").write_text("")
    (tmp_path / "tool.py").write_text("")
    assert sandbox_folders(["sandboxes/a/agent.py"], tmp_path) == ["sandboxes/a"]
    assert sandbox_folders(["sandboxes/a", "sandboxes/a/agent.py"], tmp_path) == []
    assert sandbox_folders(["tool.py"], tmp_path) == []
