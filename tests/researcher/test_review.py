"""The review surface on a real MLflow store: SCHEDULED proposal runs, decisions, the audit trail."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from researcher.brief.loader import load_brief
from researcher.records import CodeVersion, Decision, Proposal, StepResult, Summary
from researcher.review.mlflow_review import ReviewBoard, ReviewError
from researcher.study.nodes.base import StudyContext
from researcher.study.nodes.reviewing import ReviewNode
from researcher.study.store import study_paths
from tests.researcher.harness import ROOT


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> MlflowClient:
    """One store for the module: creating an MLflow sqlite database costs seconds; each test has a study of its own."""
    return MlflowClient(f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}")


@pytest.fixture
def board(client: MlflowClient) -> ReviewBoard:
    study = uuid.uuid4().hex[:8]
    return ReviewBoard(client, f"study-{study}", study)


BASE = {"trainer.lr": "1e-05", "trainer.steps": "8"}  # a flattened base config, as the review node passes it


def proposal(pid: str = "r1-1") -> Proposal:
    return Proposal(id=pid, round=1, planner="heuristic", hypothesis="higher lr learns faster",
                    rationale="lr 1e-5 is tiny", overrides={"trainer.lr": 0.001}, expected_effect="reward up")


def test_published_proposal_is_a_scheduled_run_with_review_tags(board: ReviewBoard) -> None:
    run_id = board.publish(proposal(), BASE)
    run = board.client.get_run(run_id)
    assert run.info.status == "SCHEDULED"
    tags = run.data.tags
    assert tags["swarmrl.proposal"] == "r1-1" and tags["review.status"] == "pending"
    assert tags["review.hypothesis"] == "higher lr learns faster"
    assert tags["review.diff"] == "trainer.lr: 1e-05 -> 0.001"
    assert "higher lr learns faster" in tags["mlflow.note.content"]
    assert run.data.params == {"trainer.lr": "0.001"}
    assert board.publish(proposal(), BASE) == run_id  # idempotent
    assert len(board.board()) == 1


def _note(board: ReviewBoard, run_id: str) -> str:
    return board.client.get_run(run_id).data.tags["mlflow.note.content"]


def test_the_note_shows_the_config_diff_as_a_table_of_base_and_proposed_values(board: ReviewBoard) -> None:
    p = proposal().model_copy(update={"overrides": {"trainer.lr": 0.001, "trainer.steps": 8, "trainer.beta": "a|b"}})
    note = _note(board, board.publish(p, BASE))
    lines = note.splitlines()
    header = lines.index("| key | base value | proposed value |")
    assert lines[header + 1] == "|---|---|---|"
    # Only what changes, sorted; a key the base lacks says so; a `|` in a value cannot split its cell.
    assert lines[header + 2:header + 4] == ["| `trainer.beta` | (unset) | a\\|b |", "| `trainer.lr` | 1e-05 | 0.001 |"]
    assert lines[header + 4] == ""
    for part in ("**Hypothesis:** higher lr learns faster", "**Rationale:** lr 1e-5 is tiny",
                 "**Expected effect:** reward up"):
        assert part in note


def test_the_note_says_how_to_approve_or_veto_in_the_ui_and_with_the_cli(board: ReviewBoard) -> None:
    note = _note(board, board.publish(proposal(), BASE))
    assert "set `review.status` to `approved` or `vetoed`" in note and "first add `review.reason`" in note
    assert f"`researcher study approve {board.study} r1-1`" in note
    assert f"`researcher study veto {board.study} r1-1 --reason \"...\"`" in note


def test_a_baseline_note_says_it_changes_no_config(board: ReviewBoard) -> None:
    p = proposal().model_copy(update={"overrides": {"trainer.lr": "1e-05"}})  # the base value: no change
    note = _note(board, board.publish(p, BASE))
    assert "No config change." in note and "| key |" not in note


def test_cli_decision_is_recorded_with_who_when_why_and_is_final(board: ReviewBoard) -> None:
    board.publish(proposal(), BASE)
    board.decide(Decision(proposal_id="r1-1", verdict="vetoed", by="ada", reason="too risky"))
    tags = board.client.get_run(board.find("r1-1").info.run_id).data.tags
    assert (tags["review.status"], tags["review.by"], tags["review.reason"]) == ("vetoed", "ada", "too risky")
    assert tags["review.at"]
    assert board.find("r1-1").info.status == "KILLED"
    with pytest.raises(ReviewError, match="already vetoed by ada; a decision is final"):
        board.decide(Decision(proposal_id="r1-1", verdict="approved", by="bob"))
    [d] = board.collect(["r1-1"])
    assert (d.verdict, d.by, d.reason, d.source) == ("vetoed", "ada", "too risky", "cli")


def test_unknown_proposal_cannot_be_decided(board: ReviewBoard) -> None:
    with pytest.raises(ReviewError, match="r9-9 is not on the review board"):
        board.decide(Decision(proposal_id="r9-9", verdict="approved", by="ada"))


def test_a_tag_edited_as_in_the_ui_is_a_decision(board: ReviewBoard) -> None:
    run_id = board.publish(proposal(), BASE)
    assert board.collect(["r1-1"]) == []
    board.client.set_tag(run_id, "review.status", "Approved ")
    [d] = board.collect(["r1-1"])
    assert (d.verdict, d.by, d.source) == ("approved", "mlflow-ui", "mlflow")
    assert d.at_poll_time  # no review.at on the run: the time is when the study saw it, and says so
    board.client.set_tag(run_id, "review.by", "ada")
    board.client.set_tag(run_id, "review.at", "2026-11-30T09:00:00+00:00")
    [d] = board.collect(["r1-1"])
    assert (d.by, d.at, d.at_poll_time) == ("ada", "2026-11-30T09:00:00+00:00", False)


def test_a_mistyped_status_is_flagged_on_the_run_and_stays_pending(board: ReviewBoard) -> None:
    run_id = board.publish(proposal(), BASE)
    board.client.set_tag(run_id, "review.status", "aproved")
    assert board.collect(["r1-1"]) == []
    assert "unknown review.status 'aproved'" in board.client.get_run(run_id).data.tags["review.error"]


def test_closing_logs_the_summary_and_finishes_the_run(board: ReviewBoard) -> None:
    run_id = board.publish(proposal(), BASE)
    board.close("r1-1", Summary(n=2, mean=0.5, std=0.1, ci_low=0.4, ci_high=0.6))
    run = board.client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.metrics["study/objective_mean"] == 0.5 and run.data.metrics["study/seeds"] == 2


def test_a_later_edit_of_a_decided_tag_is_recorded_as_ignored_and_changes_nothing(board: ReviewBoard) -> None:
    run_id = board.publish(proposal(), BASE)
    board.publish(proposal("r1-2"), BASE)
    board.decide(Decision(proposal_id="r1-1", verdict="approved", by="ada", reason="worth a look"))
    board.client.set_tag(board.find("r1-2").info.run_id, "review.status", "vetoed")  # a UI decision, no by/at
    taken = board.collect(["r1-1", "r1-2"])  # what the study took up
    assert [d.verdict for d in taken] == ["approved", "vetoed"] and taken[1].at_poll_time
    assert board.audit(taken) == [] and board.ignored() == []  # tags that agree with the decisions: nothing
    board.client.set_tag(run_id, "review.status", "vetoed")  # edited in the UI after the decision
    board.client.set_tag(run_id, "review.by", "mallory")
    board.client.set_tag(run_id, "review.at", "2026-12-01T08:00:00+00:00")
    [change] = board.audit(taken)
    assert (change.proposal_id, change.decided, change.changed_to, change.by, change.at, change.at_poll_time) == \
        ("r1-1", "approved", "vetoed", "mallory", "2026-12-01T08:00:00+00:00", False)
    tags = board.client.get_run(run_id).data.tags  # the decision's tags are back: it stands
    assert (tags["review.status"], tags["review.by"], tags["review.reason"]) == ("approved", "ada", "worth a look")
    assert board.audit(taken) == []  # recorded once
    board.client.set_tag(run_id, "review.status", "pending")  # no by/at of its own this time
    [again] = board.audit(taken)
    assert (again.changed_to, again.by, again.at_poll_time) == ("pending", "mlflow-ui", True)
    assert [(c.proposal_id, c.changed_to) for c in board.ignored()] == [("r1-1", "vetoed"), ("r1-1", "pending")]
    assert [d.verdict for d in board.collect(["r1-1", "r1-2"])] == ["approved", "vetoed"]  # decisions unchanged
    with pytest.raises(ReviewError, match="already approved by ada"):
        board.decide(Decision(proposal_id="r1-1", verdict="vetoed", by="mallory"))


def _code_proposal(pid: str) -> Proposal:
    return Proposal(id=pid, round=1, planner="llm:scripted", hypothesis="a shorter reply scores higher",
                    rationale="the reward is per letter", expected_effect="reward up", needs_code_change=True,
                    code_change="agent: reply length",
                    edits=[{"file": "sandboxes/letters/agent.py", "search": "MAX_TOKENS", "replace": "MAX_TOKENS"}])


def _review_node(board: ReviewBoard, client: MlflowClient, approval: str, tmp_path):
    """The real review node over a real board, for a brief whose validated code changes are `approval`."""
    text = (ROOT / "studies/tiny-code.md").read_text().replace("code_change: human", f"code_change: {approval}")
    (tmp_path / "brief.md").write_text(text)
    brief = load_brief(tmp_path / "brief.md", ROOT)
    events: list[tuple[str, dict]] = []
    ctx = StudyContext(name=board.study, brief=brief, paths=study_paths(tmp_path, "s"), workdir=ROOT, client=client,
                       board=board, launcher=None, planner=None, emit=lambda kind, **kw: events.append((kind, kw)))
    return ReviewNode(ctx), events


def _validated(pid: str, passed: bool) -> dict:
    return CodeVersion(proposal_id=pid, parent_commit="base", passed=passed, commit="c0ffee" if passed else "",
                       failed_step=None if passed else "import",
                       steps=[StepResult(step="apply", passed=True), StepResult(step="import", passed=passed)]).model_dump()


def test_a_brief_may_auto_approve_validated_code_changes_but_never_invalid_ones(board: ReviewBoard, client: MlflowClient,
                                                                             tmp_path) -> None:
    node, events = _review_node(board, client, "auto", tmp_path)
    good, bad = _code_proposal("r1-1"), _code_proposal("r1-2")
    state = {"round": 1, "proposals": [good.model_dump(), bad.model_dump()],
             "code": [_validated("r1-1", True), _validated("r1-2", False)]}
    decisions = [Decision.model_validate(d) for d in node.review(state)["decisions"]]
    assert [(d.proposal_id, d.verdict, d.by) for d in decisions] == [("r1-1", "approved", "policy")]
    assert "validated code change" in decisions[0].reason
    assert client.get_run(board.find("r1-1").info.run_id).data.tags["review.status"] == "approved"
    assert client.get_run(board.find("r1-2").info.run_id).data.tags["review.status"] == "invalid"
    assert not [e for e in events if e[0] == "review.pending"]  # nothing left for a person


def test_a_code_proposal_carries_its_diff_and_validation_log_as_named_artifacts(board: ReviewBoard, tmp_path) -> None:
    code = CodeVersion.model_validate({**_validated("r1-1", True), "diff": "-MAX_TOKENS = 12\n+MAX_TOKENS = 16\n"})
    run_id = board.publish(_code_proposal("r1-1"), BASE, code)
    listed = {a.path for a in board.client.list_artifacts(run_id, "proposal")}
    assert listed == {"proposal/code.diff", "proposal/validation.log"}
    diff = Path(board.client.download_artifacts(run_id, "proposal/code.diff", str(tmp_path))).read_text()
    assert diff == code.diff
    note = _note(board, run_id)
    assert "artifact `proposal/code.diff`" in note and "`proposal/validation.log`" in note
    assert "```diff\n-MAX_TOKENS = 12\n+MAX_TOKENS = 16\n" in note and "No config change." in note


def test_an_invalid_code_proposal_asks_nobody_to_decide(board: ReviewBoard) -> None:
    note = _note(board, board.publish(_code_proposal("r1-2"), BASE, CodeVersion.model_validate(_validated("r1-2", False))))
    assert "INVALID at step import" in note and "How to decide" not in note
