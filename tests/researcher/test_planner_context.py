"""What the llm planner is shown and what it may answer: evidence, verdicts, budgets, repeats."""

from __future__ import annotations

from pathlib import Path

import pytest

from researcher.evidence.decision import PAIRED, Verdict
from researcher.planner.llm import LlmPlan, build_messages, check_plan
from researcher.planner.types import PlanContext
from researcher.records import Decision, ExperimentResult, Launch, Proposal, Summary
from researcher.study.nodes.base import typed_values
from tests.researcher.helpers import make_brief

SPACE = "  trainer.lr:\n    kind: range\n    low: 1.0e-6\n    high: 1.0e-1\n    log: true"


def proposal(i: int, lr: float) -> Proposal:
    return Proposal(id=f"r1-{i}", round=1, planner="llm:test", hypothesis=f"lr {lr} learns", rationale="r r",
                    expected_effect="e e", overrides={"trainer.lr": lr})


def result(pid: str, effect: float, seeds: dict[int, float], failed: dict[int, str] | None = None) -> ExperimentResult:
    return ExperimentResult(
        proposal_id=pid, status="ok", values=list(seeds.values()), seed_scores=seeds, failed_seeds=failed or {},
        summary=Summary(n=len(seeds), mean=sum(seeds.values()) / len(seeds), std=0.1, ci_low=0.0, ci_high=1.0),
        verdict=Verdict(result="better" if effect > 0.5 else "inconclusive", test=PAIRED, effect=effect,
                        ci=[effect - 0.2, effect + 0.2], p=0.01, n=len(seeds), n_baseline=3),
        curve={"start": 0.1, "end": 0.6, "slope": 0.05, "best_step": 7, "kl": 0.02, "entropy": 1.5, "clip_frac": 0.1})


def context(tmp_path: Path, proposals: list[Proposal], results: list[ExperimentResult], extra: str = "",
            launches: list[Launch] | None = None) -> PlanContext:
    brief = make_brief(tmp_path, SPACE, extra)
    base = brief.resolve_config(tmp_path)
    return PlanContext(brief=brief, base_values=typed_values(base.model_dump()), base_steps=8, round=2,
                       proposals=proposals, results=results, runs_left=100, steps_left=10_000, tokens_left=10_000,
                       decisions=[Decision(proposal_id=p.id, verdict="approved", by="policy") for p in proposals],
                       launches=launches or [])


def test_history_shows_seeds_verdicts_curves_and_why_a_seed_failed(tmp_path: Path) -> None:
    crash = Launch(key="r1-1-s2-rerun", proposal_id="r1-1", seed=2, steps=8, status="failed", attempt=1,
                   log_tail="step 3\nTraceback (most recent call last)\nRuntimeError: CUDA out of memory")
    ctx = context(tmp_path, [proposal(1, 0.03)],
                  [result("r1-1", 0.8, {0: 0.61, 1: 0.65}, {2: "failed twice; last: exit code 1"})], launches=[crash])
    user = build_messages(ctx)[1]["content"]
    assert "per seed {0: 0.61, 1: 0.65}" in user
    assert "verdict vs baseline: better: effect +0.8" in user and PAIRED in user and "p=0.01" in user
    assert "slope 0.05" in user and "kl 0.02" in user and "clip_frac 0.1" in user and "best_step 7" in user
    assert "seed 2 has no score: failed twice" in user and "RuntimeError: CUDA out of memory" in user
    assert '"prediction"' in build_messages(ctx)[0]["content"] and '"ablation"' in build_messages(ctx)[0]["content"]


def test_history_is_cut_to_its_budget_best_first_then_newest(tmp_path: Path) -> None:
    props = [proposal(i, 10.0 ** -(i % 5 + 1)) for i in range(1, 41)]
    results = [result(p.id, 0.01 * i, {0: 0.1, 1: 0.2}) for i, p in enumerate(props, start=1)]
    results[4] = result("r1-5", 9.0, {0: 0.9, 1: 0.95})  # the best one is old
    ctx = context(tmp_path, props, results, "planner:\n  llm: {history_tokens: 400}")
    history = build_messages(ctx)[1]["content"].split("# History\n")[1]
    first = history.splitlines()[0]
    assert first.startswith("- r1-5 ")  # best first, although it is old
    assert "- r1-40 " in history and "- r1-6 " not in history  # then newest; old mediocre ones cut
    assert "older experiment(s) left out to fit the history budget" in history


def test_a_configuration_already_run_is_refused_as_a_repeat(tmp_path: Path) -> None:
    ctx = context(tmp_path, [proposal(1, 0.03)], [result("r1-1", 0.1, {0: 0.1, 1: 0.2})])
    draft = {"hypothesis": "h h", "rationale": "r r", "expected_effect": "e e"}
    repeat = LlmPlan.model_validate({"proposals": [{**draft, "overrides": {"trainer.lr": 0.03}}]})
    with pytest.raises(ValueError, match="repeats r1-1, already run"):
        check_plan(repeat, ctx)
    orphan = LlmPlan.model_validate({"proposals": [{**draft, "overrides": {"trainer.lr": 0.01}, "parent": "r9-9"}]})
    with pytest.raises(ValueError, match="'r9-9' is not an earlier proposal id"):
        check_plan(orphan, ctx)
    fresh = LlmPlan.model_validate({"proposals": [{
        **draft, "overrides": {"trainer.lr": 0.01}, "parent": "r1-1", "ablation": False,
        "prediction": {"metric": "reward/mean", "direction": "up", "effect": 0.1}}]})
    check_plan(fresh, ctx)  # a new configuration with a prediction and a known parent is fine
    assert fresh.proposals[0].prediction is not None and fresh.proposals[0].prediction.direction == "up"


def test_a_first_round_prompt_fits_a_2048_byte_token_context_with_room_to_reply(tmp_path: Path) -> None:
    """tiny (`swarm serve --model tiny`) counts a token a byte: the prompt must leave it room for a plan."""
    brief = make_brief(tmp_path, SPACE)
    ctx = PlanContext(brief=brief, base_values=typed_values(brief.resolve_config(tmp_path).model_dump()),
                      base_steps=8, round=1, runs_left=10, steps_left=100, tokens_left=100_000)
    prompt_bytes = sum(len(m["content"].encode()) for m in build_messages(ctx))
    assert prompt_bytes < 1850  # 2048 less a reply of ~150 tokens and the chat template's few per message
