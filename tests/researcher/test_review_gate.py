"""With human approval nothing of a proposal executes before review: validation runs only the static
checks (apply, compile, contract), the executing ones (import, tests, smoke) wait until approval, and a
failure there ends the proposal invalid with its log and its commit dropped. Real git and processes;
the whole flow through a study: tests/researcher/test_code_study.py."""

from __future__ import annotations

from researcher.brief.loader import parse_brief
from researcher.records import EXECUTING_STEPS, STATIC_STEPS, Edit
from researcher.study.graph import _after_execute, _after_review
from tests.researcher.test_workspace import BRIEF, _proposal, _validator, project, ws  # noqa: F401 (fixtures)

RAN = "raise SystemExit('the proposal ran')"


def _edit(code: str) -> list[Edit]:
    return [Edit(file="sandboxes/letters/agent.py", search="MAX_TOKENS = 12", replace=f"MAX_TOKENS = 12\n{code}")]


def test_static_validation_runs_nothing_of_the_proposal_and_leaves_the_executing_steps_pending(
        ws, project, tmp_path) -> None:
    (tmp_path / "trials").mkdir()
    version = _validator(ws, project, tmp_path).validate(_proposal("p1", _edit(RAN)), ws.base(),
                                                         lambda *a, **k: None, execute=False)
    assert version.passed and version.commit == ws.commit_of("p1")  # it would have failed, had it run
    assert [s.step for s in version.steps] == list(STATIC_STEPS) and version.pending == list(EXECUTING_STEPS)
    assert "the proposal ran" not in version.log()
    assert version.checks() == ("checks run: apply ok, compile ok, contract ok; "
                                "to come after approval: import, tests, smoke")


def test_after_approval_a_failing_executing_step_ends_it_invalid_and_drops_its_commit(ws, project, tmp_path) -> None:
    (tmp_path / "trials").mkdir()
    validator = _validator(ws, project, tmp_path)
    static = validator.validate(_proposal("p1", _edit(RAN)), ws.base(), lambda *a, **k: None, execute=False)
    done = validator.execute(_proposal("p1", _edit(RAN)), static, lambda *a, **k: None)
    assert (done.passed, done.failed_step, done.commit, done.pending) == (False, "import", "", [])
    assert "the proposal ran" in done.log() and [s.step for s in done.steps] == [*STATIC_STEPS, "import"]
    assert ws.commit_of("p1") is None and not (tmp_path / "trials" / "p1").exists()


def test_the_contract_is_checked_by_reading_the_entry(ws, project, tmp_path) -> None:
    (tmp_path / "trials").mkdir()
    edits = [Edit(file="sandboxes/letters/agent.py", search="async def rollout(task, llm)",
                  replace="async def rollout(task, llm=None, extra=None)")]
    version = _validator(ws, project, tmp_path).validate(_proposal("p1", edits), ws.base(), lambda *a, **k: None,
                                                         execute=False)
    assert (version.passed, version.failed_step) == (False, "contract")
    assert "agent.py: rollout must take (task, llm)" in version.log()


def _state(pending: list[str], verdict: str | None) -> dict:
    return {"round": 1, "proposals": [_proposal("p1", _edit("X = 1")).model_dump()],
            "code": [{"proposal_id": "p1", "parent_commit": "x", "passed": True, "commit": "c", "pending": pending}],
            "decisions": [{"proposal_id": "p1", "verdict": verdict, "by": "a", "reason": ""}] if verdict else []}


def test_the_graph_runs_an_approved_proposals_pending_steps_before_prepare() -> None:
    assert _after_review(_state(["import"], None)) == "review"  # waits for the person
    assert _after_review(_state(["import"], "approved")) == "execute"
    assert _after_execute(_state(["import"], "approved")) == "execute"
    assert _after_execute(_state(["import"], "vetoed")) == "prepare"  # a vetoed proposal never runs
    assert _after_execute(_state([], "approved")) == "prepare"


def test_a_brief_may_opt_into_executing_before_review(project) -> None:
    assert parse_brief(BRIEF, workdir=project).code.execute_before_review is False  # type: ignore[union-attr]
    opted = BRIEF.replace("readonly: [sandboxes/letters/reward.py]}",
                          "readonly: [sandboxes/letters/reward.py], execute_before_review: true}")
    assert parse_brief(opted, workdir=project).code.execute_before_review is True  # type: ignore[union-attr]
