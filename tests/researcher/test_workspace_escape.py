"""The workspace cannot be escaped through symlinks: not by the base copy, not by an edit.

The reproduction of the reported escape: an editable sandbox holds `data -> ../outside/`, and an
edit changes `data/secret.py` and creates `data/new.py`. The folder outside must hash the same
afterwards, and the proposal (or the workspace) must fail with an error naming the link.
Real git and the real validator's apply step; nothing else runs.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from researcher.brief.loader import parse_brief
from researcher.code.workspace import Workspace, WorkspaceError
from researcher.records import Edit
from tests.researcher.test_workspace import BRIEF, ROOT, _hash, _proposal, _validator


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """The letters sandbox with `data -> ../outside/`; outside/ holds a secret.py that must not change."""
    folder = tmp_path / "project"
    shutil.copytree(ROOT / "sandboxes" / "letters", folder / "sandboxes" / "letters",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (folder / "base.yaml").write_text("trainer: {steps: 2}\n")
    outside = folder / "sandboxes" / "outside"
    outside.mkdir()
    (outside / "secret.py").write_text("SECRET = 1\n")
    return folder


def _workspace(project: Path, tmp_path: Path) -> Workspace:
    return Workspace(tmp_path / "study" / "workspace", parse_brief(BRIEF, workdir=project).code,  # type: ignore[arg-type]
                     project)


ESCAPE = [Edit(file="sandboxes/letters/data/secret.py", search="SECRET = 1", replace="SECRET = 2"),
          Edit(file="sandboxes/letters/data/new.py", search="", replace="print('planted')\n")]


def test_the_base_copy_refuses_a_symlink_leading_outside_the_editable_paths(project: Path, tmp_path: Path) -> None:
    (project / "sandboxes" / "letters" / "data").symlink_to("../outside/")
    ws = _workspace(project, tmp_path)
    with pytest.raises(WorkspaceError, match=r"sandboxes/letters/data: a symlink to \.\./outside/ .*leads outside "
                                             r"the editable paths"):
        ws.base()
    assert not ws.root.exists()  # no half-made workspace a resumed study would pick up
    assert not list(ws.root.parent.glob(".workspace-*"))


def test_a_symlink_inside_the_editable_paths_is_kept(project: Path, tmp_path: Path) -> None:
    (project / "sandboxes" / "letters" / "again.py").symlink_to("agent.py")
    ws = _workspace(project, tmp_path)
    ws.base()
    assert (ws.root / "sandboxes" / "letters" / "again.py").is_symlink()


def test_an_edit_through_a_symlink_changes_nothing_outside_and_fails_with_the_reason(project: Path,
                                                                                   tmp_path: Path) -> None:
    """The link arrives with the proposal (a patch may add one, and its edits then write through it)."""
    outside = project / "sandboxes" / "outside"
    ws = _workspace(project, tmp_path)
    base, before = ws.base(), _hash(outside)
    patch = ("diff --git a/sandboxes/letters/data b/sandboxes/letters/data\nnew file mode 120000\n"
             "--- /dev/null\n+++ b/sandboxes/letters/data\n@@ -0,0 +1 @@\n"
             f"+{outside}\n\\ No newline at end of file\n")
    (tmp_path / "trials").mkdir()
    version = _validator(ws, project, tmp_path).validate(_proposal("p1", ESCAPE, patch), base, lambda *a, **k: None)
    assert (version.passed, version.failed_step) == (False, "apply")
    assert "sandboxes/letters/data/secret.py: resolves to" in version.log() and "outside the workspace" in version.log()
    assert _hash(outside) == before and not (outside / "new.py").exists()
    assert ws.proposal_refs() == {}


def test_an_edit_through_an_inner_symlink_obeys_the_rules_of_its_real_path(project: Path, tmp_path: Path) -> None:
    ws = _workspace(project, tmp_path)
    tree = ws.checkout(ws.base(), tmp_path / "trial")
    (tree / "sandboxes" / "letters" / "alias.py").symlink_to("reward.py")  # reward.py is read-only by the brief
    with pytest.raises(WorkspaceError, match=r"alias\.py: resolves through a symlink to sandboxes/letters/reward\.py"
                                             r".*read-only"):
        ws.apply_edits(tree, [Edit(file="sandboxes/letters/alias.py", search="MIN_LENGTH = 12",
                                   replace="MIN_LENGTH = 1")])
    assert "MIN_LENGTH = 12" in (tree / "sandboxes" / "letters" / "reward.py").read_text()
