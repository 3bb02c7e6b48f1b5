"""Bad input on the Responses and Messages routes, and the gateway defects found on the same paths.

Over real HTTP: malformed items and content blocks, and what the APIs offer and the server does not,
each get an OpenAI-shaped 400 naming where; requests without a key get 401 once anonymous use is
off; a client that goes away mid-stream stops its generation; `logit_bias` is refused, not ignored;
and a large body is parsed off the event loop, so the server answers others meanwhile.
"""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import psutil
import pytest

from core.clients.sdk import SwarmClient
from core.engine.null import NullEngine
from core.models import build_tiny
from core.serve import bodies
from core.serve.chat import ChatRenderer
from core.serve.openai_wire import MAX_STOP
from core.serve.state import Policy
from tests.support import credential

RESPONSES, MESSAGES, CHAT = "/v1/responses", "/v1/messages", "/v1/chat/completions"


def responses(**fields) -> dict:
    return {"model": "policy", "input": "hello", "max_output_tokens": 4, **fields}


def messages(**fields) -> dict:
    return {"model": "policy", "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}], **fields}


def user_blocks(*blocks) -> list[dict]:
    return [{"role": "user", "content": list(blocks)}]


BAD = [
    (RESPONSES, responses(input=[{"type": "function_call", "name": "add"}]), "input[0].call_id"),
    (RESPONSES, responses(input=[{"type": "function_call_output", "call_id": "c", "output": 5}]), "input[0].output"),
    (RESPONSES, responses(input=[{"type": "image_generation_call", "id": "x"}]), "item type 'image_generation_call'"),
    (RESPONSES, responses(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
     "input[0].content[0]: content part type 'input_image'"),
    (RESPONSES, responses(input=[{"role": "robot", "content": "x"}]), "input[0].role"),
    (RESPONSES, responses(input=[]), "input"),
    (RESPONSES, responses(input=5), "input"),
    (RESPONSES, responses(tools=[{"type": "web_search"}]), "tools[0]: tool type 'web_search'"),
    (RESPONSES, responses(tools=[{"type": "function"}]), "tools[0].name"),
    (RESPONSES, responses(text={"format": {"type": "json_schema", "schema": {}}}), "text.format"),
    (RESPONSES, responses(include=["reasoning.encrypted_content"]), "include"),
    (RESPONSES, responses(background=True), "background"),
    (RESPONSES, responses(tool_choice={"type": "file_search"}), "tool_choice"),
    (RESPONSES, responses(max_output_tokens=0), "max_output_tokens"),
    (MESSAGES, messages(messages=user_blocks({"type": "image", "source": {}})), "messages[0].content[0]: content block type 'image'"),
    (MESSAGES, messages(messages=[{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "add"}]}]),
     "messages[0].content[0].input"),
    (MESSAGES, messages(messages=user_blocks({"type": "tool_result", "content": "5"})), "messages[0].content[0].tool_use_id"),
    (MESSAGES, messages(messages=user_blocks({"type": "text"})), "messages[0].content[0].text"),
    (MESSAGES, messages(messages=[{"role": "system", "content": "x"}]), "messages.0.role"),
    (MESSAGES, {"model": "policy", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    (MESSAGES, messages(top_k=5), "top_k"),
    (MESSAGES, messages(tools=[{"type": "bash_20250124", "name": "bash"}]), "tools[0]: tool type 'bash_20250124'"),
    (MESSAGES, messages(tools=[{"name": "add"}]), "tools[0].input_schema"),
    (MESSAGES, messages(stop_sequences=[f"s{k}" for k in range(MAX_STOP + 1)]), "stop_sequences"),
    (MESSAGES, messages(temperature=1.5), "temperature"),
    (MESSAGES, messages(thinking={"type": "enabled", "budget_tokens": 1024}), "thinking"),
    (MESSAGES, messages(system=[{"type": "image"}]), "system[0]"),
    (CHAT, {"model": "policy", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"1": 5}}, "logit_bias"),
    ("/v1/completions", {"model": "policy", "prompt": "x", "logit_bias": {"1": -100}}, "logit_bias"),
]


@pytest.mark.parametrize("path,body,names", BAD, ids=[f"{p.rsplit('/', 1)[1]}-{n[:30]}" for p, _, n in BAD])
def test_a_malformed_item_or_block_is_a_400_naming_where(live_server, path, body, names):
    server = live_server()
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) >= {"message", "type", "code"} and error["type"] == "invalid_request_error"
    assert names in error["message"], error["message"]


def test_logit_bias_with_nan_is_refused_and_an_empty_one_is_served(live_server):
    server = live_server()
    nan = json.dumps({"model": "policy", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                      "logit_bias": {"1": float("nan")}}).encode()  # NaN as Python's json writes it
    r = httpx.post(server.url + CHAT, content=nan, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400 and "logit_bias" in r.json()["error"]["message"], r.text
    ok = httpx.post(server.url + CHAT, json={"model": "policy", "messages": [{"role": "user", "content": "x"}],
                                             "max_tokens": 2, "logit_bias": {}}, timeout=60)
    assert ok.status_code == 200, ok.text


def test_an_unknown_previous_response_id_is_a_404(live_server):
    server = live_server()
    r = httpx.post(server.url + RESPONSES, json=responses(previous_response_id="resp_nope"), timeout=60)
    assert r.status_code == 404 and r.json()["error"]["code"] == "previous_response_not_found"


@pytest.mark.parametrize("path,body", [(RESPONSES, responses()), (MESSAGES, messages())], ids=["responses", "messages"])
def test_without_an_episode_key_the_new_routes_are_a_401_once_anonymous_use_is_off(live_server, path, body):
    server = live_server(server__allow_anonymous=False)
    for headers in ({}, {"Authorization": "Bearer sk-swarm-forged"}, {"x-api-key": "sk-swarm-forged"}):
        r = httpx.post(server.url + path, json=body, headers=headers, timeout=60)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (headers, r.text)
    r = httpx.post(server.url + "/episodes/0123456789abcdef0123456789abcdef" + path, json=body, timeout=60)
    assert r.status_code == 401, r.text
    with SwarmClient(server.url, credential=credential(server)).episode(task_id="keyed") as ep:
        header = {"x-api-key": ep.api_key} if path == MESSAGES else {"Authorization": f"Bearer {ep.api_key}"}
        assert httpx.post(server.url + path, json=body, headers=header, timeout=60).status_code == 200
        assert httpx.post(ep.base_url.removesuffix("/").removesuffix("/v1") + path, json=body, timeout=60).status_code == 200
        assert len(server.registry._open[ep.id].calls) == 2  # both recorded on the episode
        ep.finish(0.0)


class _Endless(NullEngine):
    """An engine that samples one token every few ms until it is cancelled: a long generation."""

    def __init__(self, tokenizer, max_context: int):
        super().__init__(tokenizer, max_context)
        self.tokens, self.cancelled = 0, threading.Event()

    async def generate(self, prompt_ids, params, on_token=None):
        try:
            while True:
                await asyncio.sleep(0.005)
                self.tokens += 1
                on_token(self._reply[0])
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


@pytest.mark.parametrize("path,body,first", [
    (RESPONSES, responses(stream=True, max_output_tokens=1000), b"response.output_text.delta"),
    (MESSAGES, messages(stream=True, max_tokens=1000), b"content_block_delta"),
    (CHAT, {"model": "policy", "messages": [{"role": "user", "content": "x"}], "stream": True, "max_tokens": 1000},
     b'"content": "o'),
], ids=["responses", "messages", "chat"])
def test_a_client_gone_mid_stream_stops_its_generation(live_server, path, body, first):
    model, tok = build_tiny()
    engine = _Endless(tok, 2048)
    server = live_server(policies={"policy": Policy("policy", model, tok, ChatRenderer(tok), engine)})
    with httpx.stream("POST", server.url + path, json=body, timeout=60) as r:
        assert r.status_code == 200
        seen = b""
        for chunk in r.iter_bytes():
            seen += chunk
            if first in seen:
                break
    # The connection is closed: the server's stream notices and cancels the engine's generation.
    assert engine.cancelled.wait(30), "generation went on after the client left"
    assert engine.tokens < 1000
    assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 200


def test_a_large_body_is_parsed_off_the_event_loop(live_server, monkeypatch):
    server = live_server()
    real = bodies.validate
    parsing, release = threading.Event(), threading.Event()

    def held(model, raw):  # a near-limit body's parse, held until /v1/models has answered
        if len(raw) >= bodies.INLINE_BYTES:
            parsing.set()
            release.wait(60)
        return real(model, raw)

    monkeypatch.setattr(bodies, "validate", held)
    big = {"model": "policy", "messages": [{"role": "user", "content": "x " * bodies.INLINE_BYTES}], "max_tokens": 2}
    result: list[httpx.Response] = []
    call = threading.Thread(target=lambda: result.append(httpx.post(server.url + CHAT, json=big, timeout=120)))
    call.start()
    try:
        assert parsing.wait(30)
        # Parsed on the event loop, the held parse would keep /v1/models from answering: this would time out.
        assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 200
        assert not result  # the big request is still being parsed
    finally:
        release.set()
        call.join()
    # ~64k tokens of "x ": refused by the context check after its parse, not a hang or a 5xx
    assert result[0].status_code == 400 and result[0].json()["error"]["code"] == "context_length_exceeded"


def test_a_body_past_child_bytes_gets_the_same_answers_from_the_child_process(live_server):
    server = live_server()
    n = bodies.CHILD_BYTES // 2  # "1," per id: the body is just past CHILD_BYTES
    r = httpx.post(server.url + "/v1/completions", json={"model": "policy", "prompt": [1] * n}, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert f"prompt is {n} tokens" in r.json()["error"]["message"]  # refused in the child, the list never sent back
    bad = {"model": "policy", "messages": [{"role": "user", "content": "x" * bodies.CHILD_BYTES}, {"role": "robot"}]}
    r = httpx.post(server.url + CHAT, json=bad, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("messages.1.role"), r.text
    r = httpx.post(server.url + CHAT, json={"model": "policy", "messages": [{"role": "user", "content": "x" * bodies.CHILD_BYTES}]},
                   timeout=120)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    small = httpx.post(server.url + "/v1/completions", json={"model": "policy", "prompt": [1, 2, 3], "max_tokens": 2})
    assert small.status_code == 200, small.text


def test_a_killed_body_parser_is_a_503_and_the_next_large_body_gets_a_new_one(live_server):
    server = live_server()
    n = bodies.CHILD_BYTES // 2
    big = {"model": "policy", "prompt": [1] * n}
    assert httpx.post(server.url + "/v1/completions", json=big, timeout=120).status_code == 400  # the child is up
    # The spawned parser: the server runs in this test's process; the newest multiprocessing worker is its child.
    workers = [p for p in psutil.Process().children() if "spawn_main" in " ".join(p.cmdline())]
    child = max(workers, key=lambda p: p.create_time())
    child.kill()
    child.wait(30)
    r = httpx.post(server.url + "/v1/completions", json=big, timeout=120)
    assert r.status_code == 503 and r.json()["error"]["code"] == "parser_unavailable", r.text
    r = httpx.post(server.url + "/v1/completions", json=big, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
