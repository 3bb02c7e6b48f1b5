"""`researcher study show` views and people's proposals, from hand-made study states (no processes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from researcher.records import CodeVersion, Decision, ExperimentResult, Launch, Proposal, StepResult, Summary
from researcher.review.views import proposal_diff, proposal_view
from researcher.study import inbox


def _state(**parts: list) -> dict:
    p = Proposal(id="p1", round=1, planner="person:ann", hypothesis="longer replies", rationale="from a person",
                 expected_effect="reward rises", patch="--- a/x\n+++ b/x\n")
    return {"proposals": [p.model_dump()], **{k: [x.model_dump() for x in v] for k, v in parts.items()}}


VALID = CodeVersion(proposal_id="p1", parent_commit="b" * 40, passed=True, commit="c" * 40, diff="+x\n",
                    steps=[StepResult(step="apply", passed=True, log="M x")])
APPROVED = Decision(proposal_id="p1", verdict="approved", by="ann")


@pytest.mark.parametrize("parts, status", [
    ({}, "validating"),
    ({"code": [CodeVersion(proposal_id="p1", parent_commit="b", passed=False, failed_step="compile",
                           steps=[StepResult(step="compile", passed=False, log="SyntaxError")])]}, "invalid"),
    ({"code": [VALID]}, "pending"),
    ({"code": [VALID], "decisions": [Decision(proposal_id="p1", verdict="vetoed", by="ann")]}, "vetoed"),
    ({"code": [VALID], "decisions": [APPROVED]}, "approved"),
    ({"code": [VALID], "decisions": [APPROVED],
      "launches": [Launch(key="p1-s0", proposal_id="p1", seed=0, steps=2, status="running", commit="c" * 40)]},
     "running"),
    ({"code": [VALID], "decisions": [APPROVED],
      "results": [ExperimentResult(proposal_id="p1", status="ok", summary=Summary(n=1, mean=0.5, std=0, ci_low=0.5,
                                                                                   ci_high=0.5))]}, "done"),
    ({"code": [VALID], "decisions": [APPROVED], "results": [ExperimentResult(proposal_id="p1", status="failed")]},
     "failed"),
])
def test_status_follows_the_proposal_through_its_life(parts: dict, status: str) -> None:
    view = proposal_view(_state(**parts), "p1")
    assert view is not None and view.status == status and view.kind == "code"


def test_view_carries_validation_commit_runs_and_score() -> None:
    launch = Launch(key="p1-s0", proposal_id="p1", seed=0, steps=2, status="finished", run_id="abc", commit="c" * 40)
    result = ExperimentResult(proposal_id="p1", status="ok", summary=Summary(n=1, mean=0.25, std=0, ci_low=0.25,
                                                                             ci_high=0.25))
    view = proposal_view(_state(code=[VALID], decisions=[APPROVED], launches=[launch], results=[result]), "p1")
    assert view is not None
    assert (view.validation.passed, view.validation.step, view.commit, view.score) == (True, None, "c" * 40, 0.25)
    assert [(r.mlflow_run_id, r.status) for r in view.runs] == [("abc", "finished")]
    assert "== apply: passed" in view.validation.log
    assert proposal_diff(_state(code=[VALID]), "p1") == "+x\n"
    assert proposal_view(_state(), "p9") is None and proposal_diff(_state(), "p1") is None


def test_people_get_distinct_ids_and_the_study_takes_each_up_once(tmp_path: Path) -> None:
    folder = tmp_path / "inbox"
    first = inbox.add(folder, {"hypothesis": "longer replies", "patch": "diff", "by": "ann"})
    second = inbox.add(folder, {"hypothesis": "higher lr", "overrides": {"trainer.lr": 0.01}, "by": "bob"})
    assert [first.id, second.id] == ["p1", "p2"]
    assert [x.id for x in inbox.pending(folder, set())] == ["p1", "p2"]
    assert [x.id for x in inbox.pending(folder, {"p1"})] == ["p2"]
    (folder / "p3.json").write_text("")  # being written by a concurrent `propose`: skipped, not fatal
    assert [x.id for x in inbox.pending(folder, {"p1", "p2"})] == []
    assert inbox.add(folder, {"hypothesis": "again", "by": "ann"}).id == "p4"
    with pytest.raises(ValueError):
        inbox.add(folder, {"hypothesis": "x", "by": "ann"})  # too short to say anything
