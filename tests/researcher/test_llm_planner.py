"""The llm planner against a scripted OpenAI-compatible server: structure, retries, tokens, vetoes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from researcher.planner.llm import PLAN_SCHEMA, LlmPlanner, extract_json
from researcher.planner.types import PlanContext, PlannerError, choose_planner
from researcher.records import Decision, Proposal
from researcher.study.graph import typed_values
from tests.researcher.helpers import make_brief
from tests.researcher.scripted_llm import ScriptedLLM, serve

SPACE = ("  trainer.lr:\n    kind: range\n    low: 1.0e-6\n    high: 1.0e-2\n    log: true\n"
         "  prompt:\n    kind: code\n    paths: [sandboxes/x/agent.py]")


def draft(**kw: object) -> dict:
    return {"hypothesis": "a higher lr learns faster", "rationale": "the base lr is tiny",
            "overrides": {"trainer.lr": 0.001}, "expected_effect": "reward rises", "priority": 1, **kw}


def reply(*drafts: dict, stop: bool = False) -> str:
    return "Here is my plan:\n```json\n" + json.dumps({"proposals": list(drafts), "stop": stop}) + "\n```"


def context(tmp_path: Path, extra: str = "", **kw: object) -> PlanContext:
    brief = make_brief(tmp_path, SPACE, extra)
    base = brief.resolve_config(tmp_path)
    args = dict(brief=brief, base_values=typed_values(base.model_dump()), base_steps=8, round=1,
                runs_left=100, steps_left=10_000, tokens_left=10_000)  # room for two proposals of 10 seeds
    return PlanContext(**{**args, **kw})  # type: ignore[arg-type]


def test_valid_structured_output_becomes_proposals_and_counts_tokens(tmp_path: Path) -> None:
    llm = ScriptedLLM([reply(draft(), draft(overrides={}, needs_code_change=True,
                                            code_change="prompt: ask for the number only", priority=2))])
    with serve(llm) as url:
        plan = LlmPlanner(url, "scripted").plan(context(tmp_path))
    assert [p.draft.overrides for p in plan.planned] == [{"trainer.lr": 0.001}, {}]
    assert plan.planned[1].draft.needs_code_change and plan.tokens == 120 and not plan.done
    system, user = llm.requests[0]["messages"]
    assert "trainer.lr" in user["content"] and "proposals" in system["content"]


def test_invalid_output_is_retried_with_the_error_fed_back(tmp_path: Path) -> None:
    llm = ScriptedLLM(["I think we should raise the lr.", reply(draft(overrides={"trainer.lr": 5.0})), reply(draft())])
    with serve(llm) as url:
        plan = LlmPlanner(url, "scripted").plan(context(tmp_path))
    assert len(plan.planned) == 1 and plan.tokens == 360
    second, third = llm.requests[1]["messages"], llm.requests[2]["messages"]
    assert "no JSON object" in second[-1]["content"]
    assert "outside the search space" in third[-1]["content"]
    assert "attempt 3" in plan.note


def test_garbage_output_fails_clearly_after_bounded_retries(tmp_path: Path) -> None:
    llm = ScriptedLLM(["\x00garbage{{"] * 10)
    with serve(llm) as url, pytest.raises(PlannerError) as err:
        LlmPlanner(url, "scripted").plan(context(tmp_path, "planner:\n  llm: {max_retries: 2}"))
    assert len(llm.requests) == 3
    assert "gave no valid plan after 3 attempts" in str(err.value) and "attempt 3:" in str(err.value)


def test_structured_output_is_asked_for_and_a_server_that_ignores_it_still_works(tmp_path: Path) -> None:
    llm = ScriptedLLM([reply(draft()), reply(draft(overrides={"trainer.lr": 1e-4}))])  # prose and fences: ignored
    with serve(llm) as url:
        planner = LlmPlanner(url, "scripted")
        first = planner.plan(context(tmp_path))
        planner.plan(context(tmp_path))
    assert first.planned[0].draft.overrides == {"trainer.lr": 0.001} and planner.endpoint.structured is True
    for request in llm.requests:  # every request asks for the plan's JSON schema
        fmt = request["response_format"]
        assert fmt["type"] == "json_schema" and fmt["json_schema"]["schema"] == PLAN_SCHEMA
        assert "proposals" in fmt["json_schema"]["schema"]["properties"]


def test_a_server_that_refuses_response_format_gets_plain_requests_and_replies_are_repaired(tmp_path: Path) -> None:
    llm = ScriptedLLM(["I would raise the lr.", reply(draft()), reply(draft(overrides={"trainer.lr": 1e-4}))],
                      reject_format=True)
    with serve(llm) as url:
        planner = LlmPlanner(url, "scripted")
        plan = planner.plan(context(tmp_path))
        again = planner.plan(context(tmp_path))  # learned: never asks with the field again
    assert plan.planned[0].draft.overrides == {"trainer.lr": 0.001} and planner.endpoint.structured is False
    assert ["response_format" in r for r in llm.requests] == [True, False, False, False]
    assert "no JSON object" in llm.requests[2]["messages"][-1]["content"]  # extraction failed, repair asked
    assert plan.tokens == 240  # the refused request generated nothing; the garbage reply counts
    assert again.tokens == 120 and again.planned[0].draft.overrides == {"trainer.lr": 1e-4}


def test_tokens_of_failed_attempts_and_error_replies_count(tmp_path: Path) -> None:
    error = (500, {"error": {"message": "the model crashed mid-reply"}, "usage": {"total_tokens": 50}})
    llm = ScriptedLLM(["\x00garbage{{", error, "still not json"])
    with serve(llm) as url, pytest.raises(PlannerError) as err:
        LlmPlanner(url, "scripted").plan(context(tmp_path, "planner:\n  llm: {max_retries: 2}"))
    assert err.value.tokens == 120 + 50 + 120 and "(290 tokens spent)" in str(err.value)
    assert "attempt 2: endpoint error" in str(err.value)


def test_unknown_keys_and_vetoed_configurations_are_rejected(tmp_path: Path) -> None:
    vetoed = Proposal(**draft(), id="r1-1", round=1, planner="llm:scripted")
    ctx = context(tmp_path, proposals=[vetoed], decisions=[Decision(proposal_id="r1-1", verdict="vetoed",
                                                                    by="ada", reason="lr too high")])
    llm = ScriptedLLM([reply(draft(overrides={"trainer.foo": 1})), reply(draft()),
                       reply(draft(overrides={"trainer.lr": 1e-4}))])
    with serve(llm) as url:
        plan = LlmPlanner(url, "scripted").plan(ctx)
    assert plan.planned[0].draft.overrides == {"trainer.lr": 1e-4}
    assert "not a search-space key" in llm.requests[1]["messages"][-1]["content"]
    assert "repeats a vetoed configuration" in llm.requests[2]["messages"][-1]["content"]
    assert "lr too high" in llm.requests[0]["messages"][1]["content"]  # veto reasons feed the next plan


def test_token_budget_ends_planning(tmp_path: Path) -> None:
    llm = ScriptedLLM(["nope", "nope", reply(draft())])
    with serve(llm) as url:
        plan = LlmPlanner(url, "scripted").plan(context(tmp_path, tokens_left=200))
    assert plan.done and not plan.planned and "token budget exhausted" in plan.note
    assert plan.tokens == 240 and len(llm.requests) == 2


def test_tokens_are_estimated_when_the_server_reports_no_usage(tmp_path: Path) -> None:
    llm = ScriptedLLM([reply(draft())], usage=False)
    with serve(llm) as url:
        plan = LlmPlanner(url, "scripted").plan(context(tmp_path))
    assert plan.tokens > 100


def test_an_unreachable_endpoint_fails_clearly(tmp_path: Path) -> None:
    with pytest.raises(PlannerError, match="endpoint error"):
        LlmPlanner("http://127.0.0.1:9/v1", "m").plan(context(tmp_path, "planner:\n  llm: {max_retries: 0}"))


def test_planner_choice_defaults_to_heuristic_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    monkeypatch.delenv("OPENAI_MODEL", raising=False)
    assert choose_planner(None, None, None).kind == "heuristic"
    with pytest.raises(PlannerError, match="needs an endpoint"):
        choose_planner("llm", None, None)
    monkeypatch.setenv("OPENAI_BASE_URL", "http://x/v1")
    monkeypatch.setenv("OPENAI_MODEL", "m")
    assert choose_planner(None, None, None).model_dump() == {"kind": "llm", "base_url": "http://x/v1", "model": "m"}


def test_extract_json_tolerates_prose_and_fences() -> None:
    assert extract_json('sure! {"a": 1} bye') == {"a": 1}
    with pytest.raises(ValueError, match="no JSON object"):
        extract_json("no braces")
