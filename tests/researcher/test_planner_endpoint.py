"""The llm planner's requests fit the model: the model named or the single served one, and a context
learned from `/v1/models` or from a server's context-length refusal (scripted vLLM-like stand-in here;
the real `swarm serve` path is in test_llm_swarm_serve.py)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from researcher.planner.endpoint import Endpoint, parse_context_refusal
from researcher.planner.llm import LlmPlanner
from researcher.planner.types import PlannerError
from tests.researcher.scripted_llm import serve
from tests.researcher.test_llm_planner import context, draft, reply

CONTEXT = 6000  # the stand-in's context (one token per character plus 8 per message): room for a full prompt


class TightLLM:
    """A vLLM-like stand-in: `/v1/models` without a context length, and vLLM's 400 when a request does not fit."""

    def __init__(self, models: list[str], replies: list[str]) -> None:
        self.models, self.replies, self.requests = models, list(replies), []  # type: list[dict[str, Any]]
        self.app = FastAPI()
        self.app.get("/v1/models")(self._models)
        self.app.post("/v1/chat/completions")(self._complete)

    async def _models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": m, "object": "model", "created": 0, "owned_by": "x"} for m in self.models]}

    async def _complete(self, request: Request) -> Any:
        body = await request.json()
        self.requests.append(body)
        prompt = sum(len(m["content"]) + 8 for m in body["messages"])
        if prompt + body["max_tokens"] > CONTEXT:
            message = (f"This model's maximum context length is {CONTEXT} tokens. However, you requested "
                       f"{prompt + body['max_tokens']} tokens ({prompt} in the messages, {body['max_tokens']} in the "
                       "completion). Please reduce the length of the messages or completion.")
            return JSONResponse({"error": {"message": message, "type": "BadRequestError", "code": 400}}, status_code=400)
        text = self.replies.pop(0)
        return {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}],
                "usage": {"prompt_tokens": prompt, "completion_tokens": 20, "total_tokens": prompt + 20}}


def test_context_refusals_are_read_in_every_known_wording() -> None:
    assert parse_context_refusal("prompt (1514) + max_tokens (1500) exceeds the model's context (2048)") == (2048, 1514)
    assert parse_context_refusal("prompt is 2100 tokens; the model's context is 2048") == (2048, 2100)
    assert parse_context_refusal("This model's maximum context length is 4096 tokens. However, you requested 5000 "
                                 "tokens (3000 in the messages, 2000 in the completion).") == (4096, 3000)
    assert parse_context_refusal("This model's maximum context length is 8192 tokens. However, your messages "
                                 "resulted in 9000 tokens.") == (8192, 9000)
    assert parse_context_refusal("temperature: must be at most 2") is None


def test_a_refusal_teaches_the_context_and_the_request_is_refitted(tmp_path: Path, caplog) -> None:
    llm = TightLLM(["tight"], [reply(draft())])
    caplog.set_level(logging.WARNING, "researcher.planner.endpoint")
    with serve(llm) as url:
        plan = LlmPlanner(url, None).plan(context(tmp_path, "planner:\n  llm: {max_tokens: 5900}"))
    assert len(plan.planned) == 1
    first, second = llm.requests
    assert first["model"] == second["model"] == "tight"  # no model named: the single served one
    assert first["max_tokens"] == 5900
    prompt = sum(len(m["content"]) + 8 for m in second["messages"])
    assert prompt + second["max_tokens"] <= CONTEXT
    assert "context of 6000 tokens" in caplog.text and "max_tokens lowered from 5900" in caplog.text


def test_old_retry_exchanges_are_dropped_when_even_a_short_reply_would_not_fit(caplog) -> None:
    endpoint = Endpoint("http://127.0.0.1:9/v1", "m")
    endpoint.context, endpoint.chars_per_token = 1000, 1.0
    base = [{"role": "system", "content": "s" * 100}, {"role": "user", "content": "u" * 300}]
    retries = [{"role": "assistant", "content": "a" * 250}, {"role": "user", "content": "e" * 100}] * 2
    caplog.set_level(logging.WARNING, "researcher.planner.endpoint")
    sent, max_tokens = endpoint.fit(base + retries, 2000)
    assert sent == base + retries[2:]  # the oldest exchange went, the latest error stayed
    assert max_tokens >= 128 and endpoint.estimate(sent) + max_tokens <= 1000
    assert "dropped the 2 oldest retry message(s)" in caplog.text


def test_a_prompt_that_cannot_fit_at_all_is_a_clear_error() -> None:
    endpoint = Endpoint("http://127.0.0.1:9/v1", "m")
    endpoint.context, endpoint.chars_per_token = 500, 1.0
    with pytest.raises(PlannerError, match="does not fit m's context of 500 tokens"):
        endpoint.fit([{"role": "system", "content": "s" * 400}, {"role": "user", "content": "u" * 400}], 100)


def test_without_a_model_name_an_endpoint_serving_several_is_a_clear_error(tmp_path: Path) -> None:
    with serve(TightLLM(["a", "b"], [])) as url, pytest.raises(PlannerError, match=r"serves \['a', 'b'\]: name one"):
        LlmPlanner(url, None).plan(context(tmp_path))
