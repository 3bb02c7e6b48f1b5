"""A config-only `mode: hot_swap` proposal is refused when it is planned or proposed, with the reason:
it has no code to swap into the live run, so it would never run and stay approved forever."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from researcher.planner.llm import LlmPlan
from researcher.records import HOT_SWAP_NEEDS_CODE, Edit, Proposal, ProposalDraft
from researcher.study import inbox

DRAFT = {"hypothesis": "lr up helps", "rationale": "r r", "expected_effect": "e e", "overrides": {"trainer.lr": 0.1}}


def test_an_llm_plan_with_a_config_only_hot_swap_is_refused_with_the_reason() -> None:
    with pytest.raises(ValidationError, match="config-only change needs runs of its own"):
        LlmPlan.model_validate({"proposals": [{**DRAFT, "mode": "hot_swap"}]})


def test_a_hot_swap_with_code_and_a_config_only_runs_proposal_are_accepted() -> None:
    edit = Edit(file="sandboxes/x/agent.py", search="a", replace="b")
    assert ProposalDraft(**DRAFT, mode="hot_swap", needs_code_change=True, code_change="x: y", edits=[edit]).mode == "hot_swap"
    assert ProposalDraft(**DRAFT).mode == "runs"
    assert Proposal(**DRAFT, id="p1", round=1, planner="person:ada", patch="--- a\n+++ b\n", mode="hot_swap").kind == "code"


def test_a_planned_config_only_hot_swap_proposal_is_refused() -> None:
    with pytest.raises(ValidationError) as e:
        Proposal(**DRAFT, id="r1-1", round=1, planner="llm:x", mode="hot_swap")
    assert HOT_SWAP_NEEDS_CODE in str(e.value)


def test_a_persons_hot_swap_without_a_patch_is_not_stored(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="no code"):
        inbox.add(tmp_path, {"hypothesis": "lr up", "overrides": {"trainer.lr": 0.1}, "by": "ada", "hot_swap": True})
    assert list(tmp_path.iterdir()) == []
    assert inbox.add(tmp_path, {"hypothesis": "lr up", "overrides": {"trainer.lr": 0.1}, "by": "ada"}).id == "p1"
