"""The llm planner against the project's own OpenAI-compatible server (`swarm serve --model tiny`).

The tiny model is random, so its output is garbage: the planner must retry cleanly, feeding the
error back, and then fail with a clear message. No stand-in: real server, real HTTP.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from researcher.planner.llm import LlmPlanner
from researcher.planner.types import PlanContext, PlannerError
from researcher.study.graph import typed_values
from tests.researcher.harness import BIN
from tests.researcher.helpers import make_brief, wait_until_up
from tests.researcher.scripted_llm import free_port

pytestmark = pytest.mark.slow


@pytest.fixture
def swarm_serve(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(BIN / "swarm"), "serve", "--model", "tiny", "--port", str(port)], cwd=tmp_path,
                                stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"})
    url = f"http://127.0.0.1:{port}/v1"
    try:
        wait_until_up(f"{url}/models", "swarm serve", 180, proc, log)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def test_garbage_from_a_real_server_ends_in_clean_retries_then_a_clear_failure(tmp_path: Path, swarm_serve: str) -> None:
    brief = make_brief(tmp_path, "  trainer.lr:\n    kind: choice\n    values: [0.0, 0.001]",
                       "planner:\n  llm: {max_retries: 2, max_tokens: 64}")
    base = brief.resolve_config(tmp_path)
    ctx = PlanContext(brief=brief, base_values=typed_values(base.model_dump()), base_steps=8, round=1,
                      runs_left=10, steps_left=100, tokens_left=100_000)
    model = httpx.get(f"{swarm_serve}/models").json()["data"][0]["id"]
    with pytest.raises(PlannerError) as err:
        LlmPlanner(swarm_serve, model).plan(ctx)
    message = str(err.value)
    assert "gave no valid plan after 3 attempts" in message
    assert all(f"attempt {i}:" in message for i in (1, 2, 3))
    assert "endpoint error" not in message  # the server answered; the output was the problem
    assert "tokens spent" in message and "(0 tokens spent)" not in message


def test_the_served_model_and_its_context_come_from_swarm_serve(tmp_path: Path, swarm_serve: str, caplog) -> None:
    """README's researcher command names no model and asks for more tokens than tiny's 2048 can hold."""
    brief = make_brief(tmp_path, "  trainer.lr:\n    kind: choice\n    values: [0.0, 0.001]",
                       "planner:\n  llm: {max_retries: 0, max_tokens: 1900}")
    base = brief.resolve_config(tmp_path)
    ctx = PlanContext(brief=brief, base_values=typed_values(base.model_dump()), base_steps=8, round=1,
                      runs_left=10, steps_left=100, tokens_left=100_000)
    assert httpx.get(f"{swarm_serve}/models").json()["data"][0]["max_model_len"] == 2048  # vLLM's field
    planner = LlmPlanner(swarm_serve, None)
    caplog.set_level("WARNING", "researcher.planner.endpoint")
    with pytest.raises(PlannerError) as err:  # the random model writes no JSON; the requests themselves fit
        planner.plan(ctx)
    assert planner.name == "llm:tiny"
    assert "endpoint error" not in str(err.value) and "gave no valid plan after 1 attempts" in str(err.value)
    assert "max_tokens lowered from 1900" in caplog.text and "context of 2048 tokens" in caplog.text
