"""A failed planner round is retried with a doubling backoff; the search ends only after
`max_failed_rounds` failed rounds in a row, and every failed round's tokens still count."""

from __future__ import annotations

from pathlib import Path

import pytest

from researcher.planner.retry import BACKOFF_CAP_S, backoff_s, plan_with_retries
from researcher.planner.types import PlanContext, PlannerError, PlanResult
from tests.researcher.helpers import make_brief


class Flaky:
    """Fails `fails` rounds (spending `tokens` each), then plans."""

    name = "llm:flaky"

    def __init__(self, fails: int, tokens: int = 100) -> None:
        self.fails, self.tokens, self.seen_tokens_left = fails, tokens, []

    def plan(self, ctx: PlanContext) -> PlanResult:
        self.seen_tokens_left.append(ctx.tokens_left)
        if self.fails:
            self.fails -= 1
            raise PlannerError("gave no valid plan", tokens=self.tokens)
        return PlanResult([], note="planned", tokens=7)


@pytest.fixture
def ctx(tmp_path: Path) -> PlanContext:
    brief = make_brief(tmp_path, "  trainer.lr:\n    kind: choice\n    values: [0.0, 0.03]")
    return PlanContext(brief=brief, base_values={}, base_steps=8, round=1, proposals=[], decisions=[], results=[],
                       runs_left=10, steps_left=100, tokens_left=1000)


def test_a_failed_round_is_retried_with_backoff_and_its_tokens_count(ctx: PlanContext) -> None:
    waits: list[float] = []
    planner = Flaky(fails=2)
    result = plan_with_retries(planner, ctx, 3, 5.0, sleep=waits.append)
    assert not result.done and result.tokens == 207 and "after 2 failed round(s)" in result.note
    assert waits == [5.0, 10.0]  # doubling
    assert planner.seen_tokens_left == [1000, 900, 800]  # what failed rounds spent is gone from the budget


def test_the_search_ends_only_after_max_failed_rounds_in_a_row(ctx: PlanContext) -> None:
    waits: list[float] = []
    result = plan_with_retries(Flaky(fails=5), ctx, 3, 1.0, sleep=waits.append)
    assert result.done and result.tokens == 300 and "failed 3 round(s) in a row" in result.note
    assert len(waits) == 2


def test_a_planner_that_never_spent_anything_stops_the_study(ctx: PlanContext) -> None:
    with pytest.raises(PlannerError):
        plan_with_retries(Flaky(fails=5, tokens=0), ctx, 2, 0.0, sleep=lambda s: None)


def test_the_backoff_doubles_up_to_its_cap() -> None:
    assert [backoff_s(n, 2.0) for n in (1, 2, 3)] == [2.0, 4.0, 8.0]
    assert backoff_s(30, 2.0) == BACKOFF_CAP_S


def test_the_default_is_three_failed_rounds(ctx: PlanContext) -> None:
    assert ctx.brief.planner.llm.max_failed_rounds == 3
