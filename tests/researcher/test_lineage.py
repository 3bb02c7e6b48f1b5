"""A code proposal's parent must be approved and executed, a child is reviewed whole, and a parent that can never
be built on takes its pending children with it (researcher/code/lineage.py, the review node, the review board).
Real git workspace and validation steps, a real MLflow store, the real review node."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from researcher.cli.code import reviewed_diff
from researcher.code.lineage import chain_of, lineage, parent_ended, parent_problem
from researcher.records import CodeVersion, Decision, Edit, Proposal, StepResult
from researcher.review.mlflow_review import BASE_DIFF_ARTIFACT, ReviewBoard
from researcher.study.store import StudyPaths
from tests.researcher.test_review import _review_node
from tests.researcher.test_workspace import _proposal, _validator, project, ws  # noqa: F401 (fixtures)

AGENT = "sandboxes/letters/agent.py"


def _code(pid: str, parent: str | None = None) -> Proposal:
    return Proposal(id=pid, round=1, planner="test", hypothesis="an edit", rationale="test", expected_effect="test",
                    patch="+x", parent=parent)


def _version(pid: str, passed: bool = True, pending: list[str] | None = None) -> CodeVersion:
    return CodeVersion(proposal_id=pid, parent_commit="base", passed=passed, commit="c0ffee" if passed else "",
                       failed_step=None if passed else "import", pending=pending or [],
                       steps=[StepResult(step="apply", passed=True)])


def _decided(pid: str, verdict: str) -> Decision:
    return Decision(proposal_id=pid, verdict=verdict, by="ada", reason="why not")  # type: ignore[arg-type]


@pytest.mark.parametrize("decisions, code, why", [
    ([], [_version("p1", pending=["import"])],
     "parent p1 is not approved (it awaits review): build on it once it is approved and executed"),
    ([_decided("p1", "vetoed")], [_version("p1", pending=["import"])], "parent p1 was vetoed by ada (why not)"),
    ([_decided("p1", "approved")], [_version("p1", pending=["import", "tests"])],
     "parent p1 is approved but its code has not run its validation steps yet"),
    ([_decided("p1", "approved")], [_version("p1", passed=False)], "parent p1 failed validation at step import"),
    ([_decided("p1", "approved")], [_version("p1")], None),
])
def test_a_parent_must_be_approved_and_executed(decisions, code, why) -> None:
    proposals = [_code("p1"), _code("p2", parent="p1")]
    assert parent_problem("p1", proposals, decisions, code) == why
    assert parent_ended("p1", decisions, code) == (why is not None and ("vetoed" in why or "failed" in why))


def test_only_a_code_proposal_of_the_study_can_be_a_parent() -> None:
    config = Proposal(id="c1", round=1, planner="test", hypothesis="a lower lr", rationale="test", expected_effect="test")
    assert parent_problem("c1", [config], [_decided("c1", "approved")], []) == (
        "parent c1 is a config proposal: only a code proposal's version can be built on")
    assert parent_problem("p9", [config], [], []) == "parent p9 is not a proposal of this study"
    assert chain_of("p3", [_code("p1"), _code("p2", "p1"), _code("p3", "p2")]) == ["p1", "p2"]
    assert chain_of("p2", [_code("p1", "p2"), _code("p2", "p1")]) == ["p1"]  # a cycle ends the chain


def test_a_child_is_reviewed_as_its_chain_with_the_cumulative_diff(ws, project, tmp_path: Path) -> None:  # noqa: F811
    (tmp_path / "trials").mkdir()
    validator = _validator(ws, project, tmp_path)
    base = ws.base()
    emit = lambda *a, **k: None  # noqa: E731
    first = validator.validate(_proposal("p1", [Edit(file=AGENT, search="MAX_TOKENS = 12", replace="MAX_TOKENS = 16")]),
                               base, emit, execute=False)
    child = _proposal("p2", [Edit(file=AGENT, search="MAX_TOKENS = 16", replace="MAX_TOKENS = 20")])
    child = child.model_copy(update={"parent": "p1"})
    second = validator.validate(child, first.commit, emit, execute=False)
    assert first.passed and second.passed, second.log()
    proposals = [_proposal("p1"), child]
    chained = lineage("p2", proposals, second, ws.root, base)
    assert chained.chain == ["p1"]
    assert "-MAX_TOKENS = 12" in chained.base_diff and "+MAX_TOKENS = 20" in chained.base_diff
    assert "MAX_TOKENS = 16" not in chained.base_diff  # the whole change against the base, not p2's step

    # `study diff` / `review`: the chain, the whole change, then the proposal's own step.
    values = {"proposals": [p.model_dump() for p in proposals], "code": [first.model_dump(), second.model_dump()],
              "decisions": [], "workspace_base": base}
    shown = reviewed_diff(StudyPaths(ws.root.parent), values, "p2")
    assert shown is not None and shown.startswith("# chain: base -> p1 -> p2; approving it approves all of this code")
    whole, own = shown.split("# p2's own change on p1:")
    assert "+MAX_TOKENS = 20" in whole and "-MAX_TOKENS = 12" in whole
    assert "-MAX_TOKENS = 16" in own and "+MAX_TOKENS = 20" in own
    assert reviewed_diff(StudyPaths(ws.root.parent), values, "p1") == first.diff  # no parent: its own diff

    # The MLflow note: built on the chain, with the cumulative diff; the artifact holds it whole.
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    study = uuid.uuid4().hex[:8]
    board = ReviewBoard(client, f"study-{study}", study, tmp_path / "artifacts")
    run_id = board.publish(child, {}, second, chained)
    tags = client.get_run(run_id).data.tags
    assert tags["review.chain"] == "base -> p1 -> p2"
    note = tags["mlflow.note.content"]
    assert "**Built on:** base → p1 → p2" in note and "cumulative diff against the base commit" in note
    assert "-MAX_TOKENS = 12" in note and "+MAX_TOKENS = 20" in note
    saved = Path(client.download_artifacts(run_id, BASE_DIFF_ARTIFACT, str(tmp_path / "got"))).read_text()
    assert saved == chained.base_diff


def test_a_vetoed_parent_ends_its_children_and_refuses_their_approval(tmp_path: Path) -> None:
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    study = uuid.uuid4().hex[:8]
    board = ReviewBoard(client, f"study-{study}", study, tmp_path / "artifacts")
    node, events = _review_node(board, client, "human", tmp_path)
    # A state from before the parent rule: children validated while their parent still waited.
    parent, approved, waiting = _code("p1"), _code("p2", "p1"), _code("p3", "p1")
    state = {"round": 1, "proposals": [p.model_dump() for p in (parent, approved, waiting)],
             "code": [_version(p, pending=["import"]).model_dump() for p in ("p1", "p2", "p3")]}
    for p in (parent, approved, waiting):
        board.publish(p, {}, _version(p.id, pending=["import"]))
    board.decide(Decision(proposal_id="p1", verdict="vetoed", by="ada", reason="plants a print", source="cli"))
    board.decide(Decision(proposal_id="p2", verdict="approved", by="mallory", source="cli"))
    decided = {d["proposal_id"]: d for d in node.review(state)["decisions"]}
    assert {pid: (d["verdict"], d["by"]) for pid, d in decided.items()} == {
        "p1": ("vetoed", "ada"), "p2": ("vetoed", "study"), "p3": ("vetoed", "study")}
    assert decided["p2"]["reason"] == "its approval is refused: parent p1 was vetoed by ada (plants a print)"
    assert decided["p3"]["reason"] == "it ends: parent p1 was vetoed by ada (plants a print)"
    refused = client.get_run(board.find("p2").info.run_id)
    assert refused.data.tags["review.status"] == "vetoed" and refused.info.status == "KILLED"
    assert refused.data.tags["review.refused"].startswith("approved by mallory at ")
    assert not [e for e in events if e[0] == "review.pending"]
