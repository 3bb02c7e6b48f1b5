"""A study whose LLM planner fails, through the real CLI, with a scripted server standing in for the LLM.

Garbage replies spend tokens: they count against the study's budget, the failed round is retried,
and after `max_failed_rounds` failed rounds in a row the search ends as if the planner had nothing
more, and the report says why. An unreachable endpoint spends nothing: the
study stops with a clear error, saved, to be resumed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.researcher.harness import Project
from tests.researcher.scripted_llm import ScriptedLLM, serve

# Each study start creates the MLflow store and checkpoints: seconds, not minutes; no core run starts.
pytestmark = pytest.mark.slow

BRIEF = """---
title: planner failure
objective: {metric: reward/mean, direction: maximize}
budget: {max_runs: 4, llm_tokens: 5000}
run:
  base_config: configs/tiny.yaml
search_space:
  trainer.lr: {kind: choice, values: [0.0, 0.01]}
planner: {llm: {max_retries: 2, max_failed_rounds: 2, failed_round_backoff_s: 0}}
---
Planner failure test.
"""


def test_failed_planner_attempts_count_against_the_budget_and_a_dead_endpoint_stops_cleanly(tmp_path: Path) -> None:
    project = Project(tmp_path)
    brief = tmp_path / "brief.md"
    brief.write_text(BRIEF)
    error = (500, {"error": {"message": "overloaded"}, "usage": {"total_tokens": 30}})
    llm = ScriptedLLM(["no plan here", error, "{not json"] * 2)  # (120 + 30 + 120) tokens a round, never a plan
    with serve(llm) as url:
        done = project.cli("start", str(brief), "--name", "garbage", "--planner", "llm", "--llm-base-url", url,
                           "--llm-model", "scripted")
    assert "is done" in done.stdout and len(llm.requests) == 6  # the failed round was retried once
    values, _, _ = project.state("garbage")
    assert values["tokens_used"] == 540 and values["notes"][0]["tokens"] == 540  # both failed rounds count
    assert values["stop_reason"].startswith("planner: llm:scripted failed 2 round(s) in a row: llm:scripted gave "
                                            "no valid plan")
    status = json.loads(project.cli("status", "garbage", "--json").stdout)
    assert status["budget"]["LLM tokens"] == {"used": "540", "limit": "5000"} and status["proposals"] == []
    report = (project.studies / "garbage" / "report.md").read_text()
    assert "| LLM tokens | 540 | 5000 |" in report and "gave no valid plan" in report
    dead = project.cli("start", str(brief), "--name", "dead", "--planner", "llm", "--llm-base-url",
                       "http://127.0.0.1:9/v1", "--llm-model", "m", check=False)
    assert dead.returncode == 2 and "endpoint error" in dead.stdout and "researcher study resume dead" in dead.stdout
    values, nxt, _ = project.state("dead")
    assert nxt == ("plan",) and values.get("tokens_used", 0) == 0  # saved before the plan, nothing spent
