"""The review surface on a real MLflow store: SCHEDULED proposal runs, decisions, the audit trail."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from researcher.records import Decision, Proposal, Summary
from researcher.review import ReviewBoard, ReviewError


@pytest.fixture
def board(tmp_path: Path) -> ReviewBoard:
    return ReviewBoard(MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}"), "study-t", "t")


def proposal(pid: str = "r1-1") -> Proposal:
    return Proposal(id=pid, round=1, planner="heuristic", hypothesis="higher lr learns faster",
                    rationale="lr 1e-5 is tiny", overrides={"trainer.lr": 0.001}, expected_effect="reward up")


def test_published_proposal_is_a_scheduled_run_with_review_tags(board: ReviewBoard) -> None:
    run_id = board.publish(proposal(), "trainer.lr: 1e-05 -> 0.001")
    run = board.client.get_run(run_id)
    assert run.info.status == "SCHEDULED"
    tags = run.data.tags
    assert tags["swarmrl.proposal"] == "r1-1" and tags["review.status"] == "pending"
    assert tags["review.hypothesis"] == "higher lr learns faster"
    assert tags["review.diff"] == "trainer.lr: 1e-05 -> 0.001"
    assert "higher lr learns faster" in tags["mlflow.note.content"]
    assert run.data.params == {"trainer.lr": "0.001"}
    assert board.publish(proposal(), "trainer.lr: 1e-05 -> 0.001") == run_id  # idempotent
    assert len(board.board()) == 1


def test_cli_decision_is_recorded_with_who_when_why_and_is_final(board: ReviewBoard) -> None:
    board.publish(proposal(), "d")
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
    run_id = board.publish(proposal(), "d")
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
    run_id = board.publish(proposal(), "d")
    board.client.set_tag(run_id, "review.status", "aproved")
    assert board.collect(["r1-1"]) == []
    assert "unknown review.status 'aproved'" in board.client.get_run(run_id).data.tags["review.error"]


def test_closing_logs_the_summary_and_finishes_the_run(board: ReviewBoard) -> None:
    run_id = board.publish(proposal(), "d")
    board.close("r1-1", Summary(n=2, mean=0.5, std=0.1, ci_low=0.4, ci_high=0.6))
    run = board.client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.metrics["study/objective_mean"] == 0.5 and run.data.metrics["study/seeds"] == 2
