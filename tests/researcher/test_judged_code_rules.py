"""A study that edits code decides on a judge's scores, so it needs a judged sandbox, and no proposal may touch
the judge: its sandbox.toml, the judge file, what it imports (read with ast), or a new file of a name it imports."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from researcher.brief.judges import judge_paths
from researcher.brief.schema import BriefError
from researcher.code.workspace import Workspace, WorkspaceError
from researcher.records import Edit
from tests.researcher.helpers import judged_sandbox, make_brief

ROOT = Path(__file__).resolve().parents[2]
SPACE = "  agent:\n    kind: code\n    paths: [sandboxes/toy/agent.py]"


def _code(editable: str) -> str:
    return f"code:\n  editable: [{editable}]"


def test_a_code_study_of_an_unjudged_sandbox_is_refused_naming_the_sandbox(tmp_path: Path) -> None:
    toy = tmp_path / "sandboxes" / "toy"
    toy.mkdir(parents=True)
    (toy / "agent.py").write_text("")
    with pytest.raises(BriefError, match=r"code.editable: sandbox sandboxes/toy has no judge: a study that edits "
                                         r"code decides only on scores its judge computes"):
        make_brief(tmp_path, SPACE, _code("sandboxes/toy/"))
    (tmp_path / "notes").mkdir()
    with pytest.raises(BriefError, match=r"code.editable: notes holds no sandbox"):
        make_brief(tmp_path, SPACE, _code("notes"))
    (toy / "sandbox.toml").write_text('name = "toy"\njudge = "gone.py"\n')
    with pytest.raises(BriefError, match=r"its judge gone.py \(named in sandbox.toml\) does not exist"):
        make_brief(tmp_path, SPACE, _code("sandboxes/toy/agent.py"))
    judged_sandbox(toy)
    assert make_brief(tmp_path, SPACE, _code("sandboxes/")).code is not None  # every sandbox under it is judged


def test_the_judges_files_are_its_toml_its_file_and_what_it_imports_or_reads(tmp_path: Path) -> None:
    box = judged_sandbox(tmp_path / "box")
    (box / "judge.py").write_text("import json\nfrom scoring import points\nFAILURE = 0.0\n"
                                  "TASKS = json.loads(open('tasks.json').read())\n")
    (box / "scoring.py").write_text("from helpers.maths import mean\n")
    (box / "helpers").mkdir()
    (box / "helpers" / "maths.py").write_text("import statistics\n")
    (box / "tasks.json").write_text("[]")
    (box / "agent.py").write_text("")
    paths = judge_paths(box)
    for protected in ("sandbox.toml", "judge.py", "scoring.py", "helpers", "tasks.json", "json.py", "statistics.py"):
        assert protected in paths, protected
    assert "agent.py" not in paths
    assert judge_paths(tmp_path) == []  # no sandbox.toml: nothing judged


@pytest.fixture
def ws(tmp_path: Path) -> Workspace:
    project = tmp_path / "project"
    shutil.copytree(ROOT / "sandboxes" / "letters", project / "sandboxes" / "letters",
                    ignore=shutil.ignore_patterns("__pycache__"))
    brief = make_brief(project, "  agent:\n    kind: code\n    paths: [sandboxes/letters/agent.py]",
                       _code("sandboxes/letters/"))
    workspace = Workspace(tmp_path / "workspace", brief.code, project)
    workspace.base()
    return workspace


@pytest.mark.parametrize("edit", [
    Edit(file="sandboxes/letters/judge.py", search="FAILURE = 0.0", replace="FAILURE = 1.0"),
    Edit(file="sandboxes/letters/reward.py", search="MIN_LENGTH = 12", replace="MIN_LENGTH = 1"),  # the judge imports it
    Edit(file="sandboxes/letters/sandbox.toml", search='judge = "judge.py"', replace=""),  # unjudge the sandbox
    Edit(file="sandboxes/letters/string.py", search="", replace="ascii_lowercase = ''"),  # shadow what reward.py imports
])
def test_an_edit_of_the_judge_is_refused_before_review_with_the_reason(ws: Workspace, tmp_path: Path,
                                                                        edit: Edit) -> None:
    tree = ws.checkout(ws.base(), tmp_path / "trial")
    with pytest.raises(WorkspaceError, match=r"part of the judge of sandboxes/letters .* no proposal may change it"):
        ws.apply_edits(tree, [edit])
    ws.apply_edits(tree, [Edit(file="sandboxes/letters/agent.py", search="MAX_TOKENS = 12", replace="MAX_TOKENS = 8")])
    assert ws.check_changes(tree) == [("M", "sandboxes/letters/agent.py")]  # the agent stays editable


def test_a_patch_that_deletes_the_judge_is_refused(ws: Workspace, tmp_path: Path) -> None:
    tree = ws.checkout(ws.base(), tmp_path / "trial")
    (tree / "sandboxes" / "letters" / "judge.py").unlink()
    with pytest.raises(WorkspaceError, match=r"sandboxes/letters/judge.py: part of the judge"):
        ws.check_changes(tree)


def _binary_patch(ws: Workspace, tmp_path: Path, files: dict[str, bytes]) -> str:
    """A person's `git diff --binary` that adds `files` on the base (what `researcher code propose --patch` takes)."""
    author = ws.checkout(ws.base(), tmp_path / "author")
    for rel, data in files.items():
        (author / rel).parent.mkdir(parents=True, exist_ok=True)
        (author / rel).write_bytes(data)
    subprocess.run(["git", "add", "-A", "-f"], cwd=author, check=True)
    return subprocess.run(["git", "diff", "--cached", "--binary"], cwd=author, check=True, capture_output=True,
                          text=True).stdout


@pytest.mark.parametrize("rel", [
    "sandboxes/letters/__pycache__/judge.cpython-311.pyc",  # an unchecked-hash pyc is believed over judge.py
    "sandboxes/letters/__pycache__/agent.cpython-311.pyc",  # any cache: the rule does not guess what it holds
    "sandboxes/letters/reward.cpython-311-x86_64-linux-gnu.so",  # an extension is imported before reward.py
    "sandboxes/letters/reward.so",
    "sandboxes/letters/string.abi3.so",  # shadows the stdlib module reward.py imports
    "sandboxes/letters/reward.pyc",
    "sandboxes/letters/evil.pth",
    "sandboxes/letters/reward/__init__.py",  # a package folder of an imported name
])
def test_a_binary_patch_adding_anything_python_could_import_as_the_judge_is_refused_before_review(
        ws: Workspace, tmp_path: Path, rel: str) -> None:
    patch = _binary_patch(ws, tmp_path, {rel: b"\x00\x01 not what the source says \xff"})
    assert "GIT binary patch" in patch or rel.endswith((".py", ".pth"))
    tree = ws.checkout(ws.base(), tmp_path / "trial")
    ws.apply_patch(tree, patch)
    with pytest.raises(WorkspaceError, match=rf"{rel}: part of the judge of sandboxes/letters .*__pycache__/, .pth"):
        ws.check_changes(tree)


def test_a_compiled_file_of_a_name_the_judge_does_not_import_stays_a_normal_edit(ws: Workspace, tmp_path: Path) -> None:
    patch = _binary_patch(ws, tmp_path, {"sandboxes/letters/fastagent.so": b"\x00agent's own extension"})
    tree = ws.checkout(ws.base(), tmp_path / "trial")
    ws.apply_patch(tree, patch)
    assert ws.check_changes(tree) == [("A", "sandboxes/letters/fastagent.so")]
