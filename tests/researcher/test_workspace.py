"""The code workspace and the validation steps before the smoke run, on a copy of the letters sandbox.

Real git, real subprocesses (import check, the sandbox's own pytest). Every refused or failing edit
must name its path or step, leave no commit and no trial worktree, and change nothing outside the
workspace: the project folder's files hash the same before and after.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from researcher.brief.loader import parse_brief
from researcher.code.validation import Validator
from researcher.code.workspace import EditError, Workspace, WorkspaceError
from researcher.records import Edit, Proposal

ROOT = Path(__file__).resolve().parents[2]
BRIEF = """---
objective: {metric: reward/mean}
run: {base_config: base.yaml}
search_space: {agent: {kind: code, paths: [sandboxes/letters/agent.py]}}
code: {editable: [sandboxes/letters/], readonly: [sandboxes/letters/reward.py]}
---
"""


def _hash(folder: Path) -> str:
    digest = hashlib.sha256()
    for f in sorted(p for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        digest.update(str(f.relative_to(folder)).encode() + f.read_bytes())
    return digest.hexdigest()


@pytest.fixture
def project(tmp_path: Path) -> Path:
    folder = tmp_path / "project"
    shutil.copytree(ROOT / "sandboxes" / "letters", folder / "sandboxes" / "letters",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (folder / "base.yaml").write_text("trainer: {steps: 2}\n")
    return folder


@pytest.fixture
def ws(project: Path, tmp_path: Path) -> Workspace:
    brief = parse_brief(BRIEF, workdir=project)
    return Workspace(tmp_path / "study" / "workspace", brief.code, project)  # type: ignore[arg-type]


def _proposal(pid: str, edits: list[Edit] | None = None, patch: str | None = None) -> Proposal:
    return Proposal(id=pid, round=1, planner="test", hypothesis="an edit", rationale="test", expected_effect="test",
                    edits=edits or [], patch=patch)


def _validator(ws: Workspace, project: Path, tmp_path: Path) -> Validator:
    brief = parse_brief(BRIEF, workdir=project)
    return Validator(ws, brief, project, tmp_path / "trials", Path(sys.executable).parent / "swarm")


def test_base_commit_holds_copies_of_the_editable_paths_and_is_stable(ws: Workspace, project: Path) -> None:
    base = ws.base()
    assert ws.base() == base  # a second call (a resumed study) finds the same base
    assert (ws.root / "sandboxes" / "letters" / "agent.py").read_text() == \
        (project / "sandboxes" / "letters" / "agent.py").read_text()
    assert ws.entry_files() == {"sandboxes/letters/agent.py"}


@pytest.mark.parametrize("rel, action, why", [
    ("/etc/passwd", "modify", "absolute paths are refused"),
    ("sandboxes/letters/../../core/run/loop.py", "modify", "'..' are refused"),
    ("sandboxes/letters/reward.py", "modify", "read-only by the brief"),
    ("sandboxes/other/agent.py", "add", "new files outside the editable paths"),
    ("sandboxes/letters/agent.py", "delete", "deleting a sandbox's entry file"),
])
def test_path_rules_refuse_with_the_path_named(ws: Workspace, rel: str, action: str, why: str) -> None:
    ws.base()
    with pytest.raises(WorkspaceError) as err:
        ws.check_path(rel, action)
    assert rel.split("/")[0] in str(err.value) and why in str(err.value)


def test_a_symlink_pointing_out_of_the_workspace_is_refused(ws: Workspace, tmp_path: Path) -> None:
    tree = ws.checkout(ws.base(), tmp_path / "trial")
    (tree / "sandboxes" / "letters" / "leak.py").symlink_to("/etc/hostname")
    with pytest.raises(WorkspaceError, match=r"sandboxes/letters/leak.py: a symlink pointing outside"):
        ws.check_changes(tree)


def test_search_block_must_match_exactly_once_and_the_error_carries_the_file(ws: Workspace, tmp_path: Path) -> None:
    tree = ws.checkout(ws.base(), tmp_path / "trial")
    with pytest.raises(EditError) as err:
        ws.apply_edits(tree, [Edit(file="sandboxes/letters/agent.py", search="MAX_TOKENS = 99", replace="x")])
    assert "does not match" in str(err.value) and "MAX_TOKENS = 12" in err.value.current
    with pytest.raises(EditError, match=r"matches \d+ times"):
        ws.apply_edits(tree, [Edit(file="sandboxes/letters/agent.py", search="import", replace="x")])


def test_valid_edit_commits_on_its_parent_and_recommits_to_the_same_id(ws: Workspace, project: Path,
                                                                       tmp_path: Path) -> None:
    base = ws.base()
    tree = ws.checkout(base, tmp_path / "trial")
    ws.apply_edits(tree, [Edit(file="sandboxes/letters/agent.py", search="MAX_TOKENS = 12", replace="MAX_TOKENS = 16")])
    assert ws.check_changes(tree) == [("M", "sandboxes/letters/agent.py")]
    first = ws.commit_trial(tree, "r1-1", "r1-1: longer replies")
    ws.remove(tree)
    tree = ws.checkout(base, tmp_path / "again")  # a validation killed after its commit, done again
    ws.apply_edits(tree, [Edit(file="sandboxes/letters/agent.py", search="MAX_TOKENS = 12", replace="MAX_TOKENS = 16")])
    ws.check_changes(tree)
    assert ws.commit_trial(tree, "r1-1", "r1-1: longer replies") == first
    assert ws.proposal_refs() == {"r1-1": first}
    assert "+MAX_TOKENS = 16" in ws.diff(base, first)
    assert subprocess.run(["git", "rev-parse", f"{first}^"], cwd=ws.root, capture_output=True,
                          text=True).stdout.strip() == base


BAD_EDITS = [
    ("no-match", [Edit(file="sandboxes/letters/agent.py", search="MAX_TOKENS = 99", replace="1")], "apply"),
    ("readonly", [Edit(file="sandboxes/letters/reward.py", search="MIN_LENGTH = 12", replace="MIN_LENGTH = 1")],
     "apply"),
    ("dotdot", [Edit(file="sandboxes/letters/../../base.yaml", search="steps", replace="x")], "apply"),
    ("syntax", [Edit(file="sandboxes/letters/agent.py", search="MAX_TOKENS = 12", replace="MAX_TOKENS = (")],
     "compile"),
    ("import", [Edit(file="sandboxes/letters/agent.py", search="MAX_TOKENS = 12",
                     replace="MAX_TOKENS = 12\nimport no_such_module_anywhere")], "import"),
    ("contract", [Edit(file="sandboxes/letters/agent.py", search="async def rollout(task, llm)",
                       replace="async def roll_out(task, llm)")], "contract"),  # caught by reading, not running
    # the sandbox's own tests require the prompt to be the user's turn
    ("test", [Edit(file="sandboxes/letters/agent.py", search='[{"role": "user", "content": task["prompt"]}]',
                   replace='[{"role": "system", "content": task["prompt"]}]')], "tests"),
]


@pytest.mark.slow
def test_each_bad_edit_fails_at_its_step_and_leaves_nothing_behind(ws: Workspace, project: Path,
                                                                    tmp_path: Path) -> None:
    base, before = ws.base(), _hash(project)
    validator = _validator(ws, project, tmp_path)
    (tmp_path / "trials").mkdir()
    for pid, edits, step in BAD_EDITS:
        version = validator.validate(_proposal(pid, edits), base, lambda *a, **k: None)
        assert (pid, version.passed, version.failed_step) == (pid, False, step), version.log()
        assert version.commit == ""
    assert ws.proposal_refs() == {}
    assert not (tmp_path / "trials" / "test").exists()
    worktrees = subprocess.run(["git", "worktree", "list"], cwd=ws.root, capture_output=True, text=True).stdout
    assert len(worktrees.splitlines()) == 1  # only the workspace itself
    assert subprocess.run(["git", "status", "--porcelain"], cwd=ws.root, capture_output=True, text=True).stdout == ""
    assert _hash(project) == before
