"""The baseline rule: any planner's judged proposal gets a baseline arm, run once per (steps, seeds) and reused,
and the LLM planner is told it exists and shown its scores."""

from __future__ import annotations

from pathlib import Path

from researcher.evidence import baselines
from researcher.evidence.analysis import baseline_for, is_baseline
from researcher.planner.llm import build_messages
from researcher.records import Decision, Proposal
from tests.researcher.test_planner_context import context, result

BASE = {"trainer.lr": 1e-5, "trainer.steps": 8}


def person(pid: str, number: int, **kw) -> Proposal:
    return Proposal(id=pid, round=number, planner="person:ada", hypothesis="my patch helps", rationale="r r",
                    expected_effect="e e", patch="--- a/x\n+++ b/x\n", **kw)


def test_a_manual_code_proposal_gets_a_baseline_at_the_same_steps_and_seeds() -> None:
    fresh = [person("p-1", 1)]
    added = baselines.needed(fresh, [], [], BASE, 8, 1)
    assert len(added) == 1
    b = added[0]
    assert b.id == "r1-2" and b.planner == baselines.BASELINE_PLANNER and is_baseline(b, BASE)
    assert b.overrides == {"trainer.steps": 8} and b.seeds is None
    assert baseline_for(fresh[0], [*fresh, *added], BASE, 8) == b  # it is what the verdict compares with


def test_a_baseline_is_run_once_per_steps_and_seeds_and_reused() -> None:
    first = [person("p-1", 1)]
    earlier = [*first, *baselines.needed(first, [], [], BASE, 8, 1)]
    again = [person("p-2", 2)]
    assert baselines.needed(again, earlier, [], BASE, 8, 2) == []  # the round-1 baseline serves
    longer = [person("p-3", 2, overrides={"trainer.steps": 16}), person("p-4", 2, overrides={"trainer.steps": 16})]
    added = baselines.needed(longer, earlier, [], BASE, 8, 2)
    assert [b.overrides for b in added] == [{"trainer.steps": 16}]  # one for both
    held_out = [person("p-5", 2, seeds=[7, 8])]
    assert [b.seeds for b in baselines.needed(held_out, earlier, [], BASE, 8, 2)] == [[7, 8]]


def test_a_vetoed_baseline_is_not_reused() -> None:
    first = [person("p-1", 1)]
    earlier = [*first, *baselines.needed(first, [], [], BASE, 8, 1)]
    vetoes = [Decision(proposal_id="r1-2", verdict="vetoed", by="ada")]
    assert len(baselines.needed([person("p-2", 2)], earlier, vetoes, BASE, 8, 2)) == 1


def test_a_planner_baseline_already_in_the_round_and_hot_swaps_need_none() -> None:
    own = Proposal(id="r1-1", round=1, planner="heuristic", hypothesis="the baseline", rationale="r r",
                   expected_effect="e e", overrides={"trainer.lr": 1e-5, "trainer.steps": 2})
    arm = Proposal(id="r1-2", round=1, planner="heuristic", hypothesis="lr up", rationale="r r",
                   expected_effect="e e", overrides={"trainer.lr": 1e-3, "trainer.steps": 2})
    assert baselines.needed([own, arm], [], [], BASE, 8, 1) == []
    assert baselines.needed([person("p-1", 1, mode="hot_swap")], [], [], BASE, 8, 1) == []


def test_rule_baseline_ids_follow_the_rounds_own_and_never_collide() -> None:
    fresh = [Proposal(id="r3-1", round=3, planner="llm:x", hypothesis="lr up", rationale="r r", expected_effect="e e",
                      overrides={"trainer.lr": 1e-3})]
    assert [b.id for b in baselines.needed(fresh, [], [], BASE, 8, 3)] == ["r3-2"]


def test_the_llm_prompt_says_the_baseline_exists_and_shows_its_scores(tmp_path: Path) -> None:
    base = Proposal(id="r1-2", round=1, planner=baselines.BASELINE_PLANNER, hypothesis="the baseline",
                    rationale="r r", expected_effect="e e", overrides={"trainer.steps": 8})
    ctx = context(tmp_path, [base], [result("r1-2", 0.0, {0: 0.11, 1: 0.13})])
    system, user = (m["content"] for m in build_messages(ctx))
    assert "runs the baseline itself" in system
    assert "# Baseline" in user and "r1-2, 8 steps" in user and "per seed {0: 0.11, 1: 0.13}" in user
    empty = build_messages(context(tmp_path, [], []))[1]["content"]
    assert "no baseline scored yet" in empty
