"""What the LLM is shown of the code: files never cut silently (over budget, whole files are left out
and named), edits checked against the full text, and a proposal on a parent sees the parent's files."""

from __future__ import annotations

from pathlib import Path

from researcher.planner.code_context import describe_code, edit_problems
from researcher.planner.types import PlanContext
from researcher.records import CodeVersion, Edit, ProposalDraft
from tests.researcher.helpers import judged_sandbox, make_brief

SPACE = "  code:\n    kind: code\n    paths: [sandboxes/s]\n    description: the sandbox"
SHORT = "def reward(x):\n    return 0.0\n"
LONG = "# a long helper module\n" + "".join(f"def f{i}():\n    return {i}\n" for i in range(200)) + "TAIL = 1\n"


def ctx(tmp_path: Path, context_chars: int, version_files=None, code=None) -> PlanContext:
    judged_sandbox(tmp_path / "sandboxes" / "s")
    brief = make_brief(tmp_path, SPACE, f"code:\n  editable: [sandboxes/s]\n  context_chars: {context_chars}")
    return PlanContext(brief=brief, base_values={}, base_steps=8, round=1, tokens_left=1000,
                       code_files={"sandboxes/s/agent.py": SHORT, "sandboxes/s/helpers.py": LONG},
                       version_files=version_files or {}, code=code or [])


def draft(edit: Edit, parent: str | None = None) -> ProposalDraft:
    return ProposalDraft(hypothesis="h h", rationale="r r", expected_effect="e e", needs_code_change=True,
                         code_change="code: x", edits=[edit], parent=parent)


def test_a_file_over_budget_is_left_out_whole_and_named_never_cut(tmp_path: Path) -> None:
    text = describe_code(ctx(tmp_path, context_chars=len(SHORT) + 10))
    assert SHORT in text  # the file that fits is shown whole
    assert "TAIL = 1" not in text and "# a long helper module" not in text  # none of the other, not its head
    assert f"left out whole to fit code.context_chars, not shown: sandboxes/s/helpers.py ({len(LONG)} chars)" in text
    everything = describe_code(ctx(tmp_path, context_chars=10_000))
    assert "TAIL = 1" in everything and "left out" not in everything


def test_an_edit_near_the_end_of_a_long_file_is_checked_against_its_full_text(tmp_path: Path) -> None:
    # The old prompt cut files at context_chars, and an edit matching the real file was refused.
    small = ctx(tmp_path, context_chars=100)
    assert edit_problems([draft(Edit(file="sandboxes/s/helpers.py", search="TAIL = 1", replace="TAIL = 2"))],
                         small) is None
    wrong = edit_problems([draft(Edit(file="sandboxes/s/helpers.py", search="TAIL = 9", replace="x"))], small)
    assert wrong is not None and "does not match" in wrong


def test_a_proposal_on_a_parent_sees_and_is_checked_against_the_parents_files(tmp_path: Path) -> None:
    parent_text = SHORT.replace("return 0.0", "return 1.0  # parent's change")
    version = CodeVersion(proposal_id="r1-1", parent_commit="base", passed=True, commit="abc123def4567")
    c = ctx(tmp_path, 10_000, {"r1-1": {"sandboxes/s/agent.py": parent_text, "sandboxes/s/helpers.py": LONG}},
            [version])
    text = describe_code(c)
    assert "# Files of r1-1 at abc123def456" in text and "return 1.0  # parent's change" in text
    assert text.count("TAIL = 1") == 1  # the parent's unchanged file is not repeated
    on_parent = Edit(file="sandboxes/s/agent.py", search="return 1.0  # parent's change", replace="return 2.0")
    assert edit_problems([draft(on_parent, parent="r1-1")], c) is None
    problem = edit_problems([draft(on_parent)], c)  # on the base that text is not there
    assert problem is not None and "does not match" in problem
    stale = edit_problems([draft(Edit(file="sandboxes/s/agent.py", search="return 0.0", replace="x"), "r1-1")], c)
    assert stale is not None and "at r1-1 does not match" in stale
