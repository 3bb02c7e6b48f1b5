"""The heuristic planner: a real successive-halving search that finds the planted better setting."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from core.config_io import flatten
from researcher.evidence.analysis import summarize
from researcher.planner.heuristic import HeuristicPlanner, candidate_arms, rung_sizes
from researcher.planner.types import PlanContext, PlanResult
from researcher.records import Decision, ExperimentResult, Proposal
from researcher.study.graph import typed_values
from tests.researcher.helpers import make_brief

LR_CHOICE = "  trainer.lr:\n    kind: choice\n    values: [0.0, 1.0e-3, 1.0e-1, 3.0e-4]"
LR_RANGE = "  trainer.lr:\n    kind: range\n    low: 1.0e-6\n    high: 1.0\n    log: true"

Reward = Callable[[dict, int], float]


def planted(overrides: dict, seed: int) -> float:
    """lr 0 cannot learn; too large diverges; near 1e-3 learns best. Noise per seed."""
    lr, steps = overrides["trainer.lr"], overrides["trainer.steps"]
    noise = random.Random(f"{lr}-{seed}-{steps}").gauss(0, 0.02)
    if lr > 0.05:
        return math.nan
    gain = 0.0 if lr == 0 else max(0.0, 1 - abs(math.log10(lr) + 3) / 3)
    return 0.2 + gain * 0.05 * steps + noise


def simulate(brief, workdir: Path, reward: Reward = planted, veto: Callable[[Proposal], bool] = lambda p: False,
             rounds: int = 20) -> tuple[list[Proposal], list[ExperimentResult], PlanResult]:
    base = brief.resolve_config(workdir)
    values = typed_values(base.model_dump())
    planner, proposals, decisions, results = HeuristicPlanner(), [], [], []
    for number in range(1, rounds + 1):
        ctx = PlanContext(brief=brief, base_values=values, base_steps=base.trainer.steps, round=number,
                          proposals=list(proposals), decisions=list(decisions), results=list(results),
                          runs_left=1000, steps_left=100_000, tokens_left=0)
        plan = planner.plan(ctx)
        if plan.done:
            return proposals, results, plan
        for i, item in enumerate(plan.planned, start=1):
            p = Proposal(**item.draft.model_dump(), id=f"r{number}-{i}", round=number, planner="heuristic",
                         arm=item.arm, rung=item.rung)
            proposals.append(p)
            verdict = "vetoed" if veto(p) else "approved"
            decisions.append(Decision(proposal_id=p.id, verdict=verdict, by="test", reason="no"))
            if verdict == "approved":
                scores = [reward(p.overrides, s) for s in brief.seeds]
                results.append(ExperimentResult(proposal_id=p.id, status="ok", values=scores, summary=summarize(scores)))
    raise AssertionError("the search did not finish")


def best_lr(proposals: list[Proposal], plan: PlanResult) -> float:
    pid = plan.note.split("proposal ")[-1].rstrip(")")
    return next(p for p in proposals if p.id == pid).overrides["trainer.lr"]


def test_successive_halving_finds_the_planted_learning_rate(tmp_path: Path) -> None:
    brief = make_brief(tmp_path, LR_CHOICE, "seeds: [0, 1, 2]\nplanner:\n  heuristic: {arms: 4, eta: 2}")
    proposals, _, plan = simulate(brief, tmp_path)
    assert best_lr(proposals, plan) == 1.0e-3
    assert "offline, no LLM" in plan.note
    rungs = [p.rung for p in proposals]
    # the baseline is one arm of rung 0; later rungs' baselines are the study graph's rule, not the planner's
    assert rungs.count(0) == 4 and rungs.count(1) == 2 and rungs.count(2) == 1
    steps = {p.rung: p.overrides["trainer.steps"] for p in proposals}
    assert steps == {0: 2, 1: 4, 2: 8}  # base 8 steps: eta^r growth ending at the base


def test_lr_zero_loses_to_a_sensible_rate_on_a_range_space(tmp_path: Path) -> None:
    brief = make_brief(tmp_path, LR_RANGE, "seeds: 2\nplanner:\n  seed: 3\n  heuristic: {arms: 8, eta: 2}")
    proposals, _, plan = simulate(brief, tmp_path)
    winner = best_lr(proposals, plan)
    assert 1e-5 < winner < 0.05
    assert all(1e-6 <= p.overrides["trainer.lr"] <= 1.0 for p in proposals if p.overrides["trainer.lr"] != 1e-5)


def test_minimize_direction_picks_the_lowest(tmp_path: Path) -> None:
    brief = make_brief(tmp_path, LR_CHOICE, "planner:\n  heuristic: {arms: 5, eta: 2}", objective="train/loss",
                       direction="minimize")
    proposals, _, plan = simulate(brief, tmp_path, reward=lambda o, s: abs(o["trainer.lr"] - 3.0e-4))
    assert best_lr(proposals, plan) == 3.0e-4


def test_same_seed_and_history_give_the_same_plan_and_another_seed_differs(tmp_path: Path) -> None:
    one = make_brief(tmp_path, LR_RANGE, "planner:\n  seed: 1\n  heuristic: {arms: 6}")
    two = make_brief(tmp_path, LR_RANGE, "planner:\n  seed: 2\n  heuristic: {arms: 6}")
    a, _, _ = simulate(one, tmp_path)
    b, _, _ = simulate(one, tmp_path)
    c, _, _ = simulate(two, tmp_path)
    assert [p.overrides for p in a] == [p.overrides for p in b]
    assert [p.overrides for p in a] != [p.overrides for p in c]


def test_a_vetoed_configuration_is_replaced_and_never_proposed_again(tmp_path: Path) -> None:
    brief = make_brief(tmp_path, LR_CHOICE, "planner:\n  heuristic: {arms: 3, eta: 2}")
    proposals, _, plan = simulate(brief, tmp_path, veto=lambda p: p.id == "r1-2")
    vetoed = next(p for p in proposals if p.id == "r1-2")
    again = [p for p in proposals if p.arm == vetoed.arm]
    assert again == [vetoed]  # proposed once, vetoed, never again
    rung0 = [p for p in proposals if p.rung == 0 and p.id != vetoed.id]
    assert len(rung0) == 3 and rung0[-1].round == 2  # a replacement arm was drawn in the next plan
    assert best_lr(proposals, plan) != vetoed.overrides["trainer.lr"]


def test_budget_limits_what_is_proposed(tmp_path: Path) -> None:
    brief = make_brief(tmp_path, LR_CHOICE, "seeds: 2\nplanner:\n  heuristic: {arms: 4}")
    base = brief.resolve_config(tmp_path)
    ctx = PlanContext(brief=brief, base_values=typed_values(base.model_dump()), base_steps=8, round=1,
                      runs_left=5, steps_left=1000)
    plan = HeuristicPlanner().plan(ctx)
    assert len(plan.planned) == 2 and "left out for budget" in plan.note
    empty = HeuristicPlanner().plan(PlanContext(brief=brief, base_values={}, base_steps=8, round=1, runs_left=1,
                                                steps_left=1000))
    assert empty.done and "budget exhausted" in empty.note


def test_baseline_is_the_first_arm(tmp_path: Path) -> None:
    brief = make_brief(tmp_path, LR_CHOICE)
    base = brief.resolve_config(tmp_path)
    ctx = PlanContext(brief=brief, base_values=typed_values(base.model_dump()), base_steps=8, round=1)
    arms = list(candidate_arms(ctx))
    assert arms[0] == {"trainer.lr": float(flatten(base)["trainer.lr"])}
    assert len(arms) == 5  # baseline + the four choices, no repeats


@pytest.mark.parametrize("arms, eta, sizes", [(4, 2, [4, 2, 1]), (3, 2, [3, 1]), (9, 3, [9, 3, 1]), (1, 2, [1])])
def test_rung_sizes(arms: int, eta: int, sizes: list[int]) -> None:
    assert rung_sizes(arms, eta) == sizes
