"""One typed view of a study (issue 37, item 5): the state's records validated once, and `next_stage`, `owed` and
`conclusion` asked of the view answer as the evidence functions do when handed the same records one by one."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from researcher.brief.schema import Objective
from researcher.budget import Spent
from researcher.evidence import analysis, confirmation, stages
from researcher.evidence.study_records import StudyRecords, StudyStateError
from researcher.evidence.study_view import Study
from researcher.records import CodeVersion, Decision, ExperimentResult, Launch, Proposal
from tests.researcher.helpers import make_brief

UP = Objective(metric="reward/mean", direction="maximize", window=1)
BASE = {"trainer.lr": 1.0e-5}
STEPS = 8


def arm(pid: str, lr: float, round_: int = 1) -> Proposal:
    return Proposal(id=pid, round=round_, planner="heuristic", hypothesis="h h", rationale="r r",
                    expected_effect="e e", overrides={"trainer.lr": lr, "trainer.steps": STEPS})


def scored(p: Proposal, values: list[float], first_seed: int = 0) -> ExperimentResult:
    seeds = range(first_seed, first_seed + len(values))
    launches = [Launch(key=f"{p.id}-s{s}", proposal_id=p.id, seed=s, steps=STEPS, status="finished") for s in seeds]
    return analysis.experiment_result(p.id, launches, {f"{p.id}-s{s}": analysis.RunScore(v)
                                                       for s, v in zip(seeds, values)})


def state_of(proposals: list[Proposal], results: list[ExperimentResult], **rest: object) -> dict:
    """The study's state as the checkpoint holds it: records dumped to dicts."""
    return {"round": max(p.round for p in proposals), "proposals": [p.model_dump() for p in proposals],
            "results": [r.model_dump() for r in results], **rest}


def search(brief_dir: Path, candidate: list[float]):
    """One candidate (lr 0.03) against the base on seeds 0-2 -> brief, proposals, judged results."""
    brief = make_brief(brief_dir, "  trainer.lr:\n    kind: choice\n    values: [0.03]", "seeds: [0, 1, 2]")
    proposals = [arm("r1-1", 1.0e-5), arm("r1-2", 0.03)]
    results = [scored(proposals[0], [1.0, 1.0, 1.0]), scored(proposals[1], candidate)]
    return brief, proposals, analysis.judge(results, proposals, BASE, STEPS, UP)


def test_a_bad_record_fails_when_the_view_is_built_naming_the_field_that_broke() -> None:
    good = arm("r1-1", 0.03).model_dump()
    with pytest.raises(StudyStateError, match=r"proposals\[1\]\.round"):
        StudyRecords.read({"proposals": [good, {**good, "id": "r1-2", "round": "many"}]})


def test_a_state_without_a_live_run_has_none_and_an_empty_state_has_no_records() -> None:
    records = StudyRecords.read({"live": {}})
    assert records.live is None and records.proposals == () and records.round == 0


def test_the_view_is_a_snapshot_that_later_edits_of_the_state_do_not_reach(tmp_path: Path) -> None:
    brief, proposals, results = search(tmp_path, [1.2, 1.1, 1.3])
    state = state_of(proposals, results)
    study = Study.of(state, brief, BASE, STEPS)
    state["proposals"].append(arm("r2-1", 0.5, round_=2).model_dump())
    assert [p.id for p in study.proposals] == ["r1-1", "r1-2"]
    with pytest.raises(ValidationError):
        study.base_steps = 4  # type: ignore[misc]


def test_the_rounds_proposals_decisions_and_code_versions_are_read_by_id(tmp_path: Path) -> None:
    old, new = arm("r1-1", 1.0e-5), arm("r2-1", 0.03, round_=2)
    approved = Decision(proposal_id="r2-1", verdict="approved", by="ann")
    version = CodeVersion(proposal_id="r2-1", parent_commit="b" * 40, passed=True, commit="c" * 40)
    records = StudyRecords.read(state_of([old, new], [], decisions=[approved.model_dump()],
                                         code=[version.model_dump()]))
    assert [p.id for p in records.current] == ["r2-1"]
    assert records.verdicts == {"r2-1": approved} and records.versions == {"r2-1": version}
    assert records.proposal("r9-9") is None and records.result_of("r1-1") is None


def test_what_the_view_spent_is_what_the_state_spent() -> None:
    launches = [Launch(key="r1-1-s0", proposal_id="r1-1", seed=0, steps=8, status="finished", started_at=10.0,
                       ended_at=70.0),
                Launch(key="r1-1-s1", proposal_id="r1-1", seed=1, steps=8, status="queued")]
    live = Launch(key="live", proposal_id="live", seed=0, steps=100, status="running", started_at=40.0, steps_done=30)
    state = {"launches": [x.model_dump() for x in launches], "live": live.model_dump(), "tokens_used": 500}
    spent = StudyRecords.read(state).spent(gpus=2, now=100.0)
    assert spent == Spent.of(state, now=100.0, gpus=2)
    assert (spent.runs, spent.steps, spent.tokens, spent.wall_s) == (2, 38, 500, 90.0)


def test_next_stage_on_the_view_is_the_stage_the_evidence_function_owes(tmp_path: Path) -> None:
    # Better on every seed but not decided on three: an inconclusive comparison pointing up buys seeds.
    brief, proposals, results = search(tmp_path, [1.6, 0.9, 1.4])
    study = Study.of(state_of(proposals, results), brief, BASE, STEPS)
    verdict = study.result_of("r1-2").verdict  # type: ignore[union-attr]
    assert verdict is not None and verdict.result == "inconclusive"
    expected = stages.next_stage(proposals, results, brief, BASE, STEPS, 2, 10**6, 10**9)
    assert expected is not None and study.next_stage(2, 10**6, 10**9) == expected
    assert study.stage_owed() and study.evidence_owed() and study.owed() is None
    assert study.next_stage(2, 1, 10**9) is None  # the budget left pays no stage


def test_owed_on_the_view_is_the_pick_the_confirmation_still_needs(tmp_path: Path) -> None:
    brief, proposals, results = search(tmp_path, [2.0, 2.2, 2.1])
    study = Study.of(state_of(proposals, results), brief, BASE, STEPS)
    pick = study.owed()
    assert pick is not None and pick == confirmation.owed(proposals, results, STEPS, brief) and pick.id == "r1-2"
    assert study.next_stage(2, 10**6, 10**9) is None  # something is better: the confirmation is owed, not a stage
    fresh = study.confirmation_round(pick, 2, None)
    assert fresh == confirmation.proposals_for(pick, results[1], proposals, brief, BASE, STEPS, 2)
    assert [p.seeds for p in fresh] == [[3, 4, 5], [3, 4, 5]]


def test_the_conclusion_is_one_recommendation_rendered_as_text(tmp_path: Path) -> None:
    brief, proposals, results = search(tmp_path, [2.0, 2.2, 2.1])
    unconfirmed = Study.of(state_of(proposals, results), brief, BASE, STEPS)
    assert unconfirmed.conclusion() == confirmation.conclusion(proposals, results, STEPS, brief)
    assert "not confirmed" in unconfirmed.conclusion()
    fresh = unconfirmed.confirmation_round(proposals[1], 2, None)
    everyone = [*proposals, *fresh]
    held_out = [scored(fresh[0], [2.0, 2.2, 2.1], first_seed=3), scored(fresh[1], [1.0, 1.1, 1.05], first_seed=3)]
    judged = analysis.judge(held_out, everyone, BASE, STEPS, UP, known=results)
    final = confirmation.attach([*results, *judged], everyone, BASE)
    confirmed = Study.of(state_of(everyone, final), brief, BASE, STEPS)
    found = confirmed.recommendation()
    assert found.recommended and found.pick is not None and found.pick.id == "r1-2"
    assert confirmed.conclusion() == found.text() == confirmation.conclusion(everyone, final, STEPS, brief)
    assert confirmed.conclusion().startswith("recommend r1-2: replicated on held-out seeds [3, 4, 5]")
    assert not confirmed.evidence_owed()
