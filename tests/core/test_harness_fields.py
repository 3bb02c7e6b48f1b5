"""Every field is served or refused, and the habits of real harnesses work, over real HTTP.

`tool_choice` "required" or a named tool makes the reply a call (the template's call text is forced
into the prompt, the model writes the rest); `parallel_tool_calls: false` and Anthropic's
`disable_parallel_tool_use` stop generation after the first call; a failed tool result is shown to
the model; what no engine does is a 400 naming the field; Messages caps a `max_tokens` past the
context and says so while Chat refuses it; the token-count routes give the exact recorded length.
"""

from __future__ import annotations

import httpx
import pytest

from core.clients.sdk import SwarmClient
from core.serve.chat import ERROR_MARK
from core.serve.messages import CAPPED_HEADER
from tests.core.scripted import scripted_policy
from tests.support import ADD_TOOL

ANTHROPIC_ADD = {"name": "add", "description": "Add two integers.", "input_schema": ADD_TOOL["function"]["parameters"]}
RESPONSES_ADD = {"type": "function", **ADD_TOOL["function"]}
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
USER = [{"role": "user", "content": "hi"}]


def post(url: str, path: str, body: dict, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}", "x-api-key": key} if key else {}
    return httpx.post(f"{url}/v1/{path}", json=body, headers=headers, timeout=60)


@pytest.mark.parametrize("path,body,rest", [
    ("chat/completions", {"tool_choice": "required", "tools": [ADD_TOOL], "messages": USER, "max_tokens": 80},
     CALL.split('"name": "', 1)[1]),
    ("messages", {"tool_choice": {"type": "any"}, "tools": [ANTHROPIC_ADD], "messages": USER, "max_tokens": 80},
     CALL.split('"name": "', 1)[1]),
    ("responses", {"tool_choice": {"type": "function", "name": "add"}, "tools": [RESPONSES_ADD], "input": "hi",
                   "max_output_tokens": 80}, CALL.split('"arguments": ', 1)[1]),
], ids=["chat-required", "messages-any", "responses-named"])
def test_a_required_or_named_tool_choice_yields_a_call(live_server, path, body, rest):
    # The model writes only what follows the forced start: the rest of CALL. Free, it would reply "rest" as
    # text that is no call; forced, the prompt ends in the template's call text and the reply is a call.
    policy, engine = scripted_policy([rest])
    server = live_server({"policy": policy})
    r = post(server.url, path, {"model": "policy", **body})
    assert r.status_code == 200, r.text
    out = r.json()
    calls = (out["choices"][0]["message"].get("tool_calls") if path == "chat/completions" else
             [b for b in out["content"] if b["type"] == "tool_use"] if path == "messages" else
             [o for o in out["output"] if o["type"] == "function_call"])
    assert len(calls) == 1, out
    prompt = policy.tokenizer.decode(engine.prompts[0], skip_special_tokens=False)
    assert (prompt + rest).endswith(CALL)


@pytest.mark.parametrize("path,body", [
    ("chat/completions", {"parallel_tool_calls": False, "tools": [ADD_TOOL], "messages": USER, "max_tokens": 200}),
    ("responses", {"parallel_tool_calls": False, "tools": [RESPONSES_ADD], "input": "hi", "max_output_tokens": 200}),
    ("messages", {"tool_choice": {"type": "auto", "disable_parallel_tool_use": True}, "tools": [ANTHROPIC_ADD],
                  "messages": USER, "max_tokens": 200}),
], ids=["chat", "responses", "messages"])
def test_no_parallel_tool_calls_stops_after_the_first_call(live_server, path, body):
    policy, _ = scripted_policy([CALL + "\n" + CALL])
    server = live_server({"policy": policy})
    with SwarmClient(server.url).episode(task_id="one-call") as ep:
        r = post(server.url, path, {"model": "policy", **body}, ep.api_key)
        assert r.status_code == 200, r.text
        [call] = server.registry._open[ep.id].calls
        assert len(call.reply["tool_calls"]) == 1 and call.reply["content"] is None
        assert policy.tokenizer.decode(call.completion_ids, skip_special_tokens=False) == CALL
        if path == "responses":
            assert r.json()["parallel_tool_calls"] is False
        if path == "messages":
            assert r.json()["stop_reason"] == "tool_use"
        ep.finish(0.0)


def test_a_failed_tool_result_is_shown_to_the_model(live_server):
    policy, engine = scripted_policy(["ok", "ok"])
    server = live_server({"policy": policy})
    turns = [{"role": "user", "content": "go"},
             {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "add", "input": {"a": 1}}]}]
    for failed in (True, False):
        r = post(server.url, "messages", {"model": "policy", "max_tokens": 4, "tools": [ANTHROPIC_ADD], "messages": turns + [
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "b missing",
                                          "is_error": failed}]}]})
        assert r.status_code == 200, r.text
    shown, plain = (policy.tokenizer.decode(p, skip_special_tokens=False) for p in engine.prompts)
    assert ERROR_MARK + "b missing" in shown and ERROR_MARK not in plain


REFUSED = [
    ("chat/completions", {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {}}},
     "response_format"),
    ("chat/completions", {"messages": USER, "functions": [{"name": "f"}]}, "functions"),
    ("chat/completions", {"messages": USER, "presence_penalty": 0.5}, "presence_penalty"),
    ("chat/completions", {"messages": USER + [{"role": "tool", "content": "5"}]}, "messages[1].tool_call_id"),
    ("chat/completions", {"messages": USER + [{"role": "tool", "tool_call_id": "nope", "content": "5"}]},
     "messages[1].tool_call_id"),
    ("chat/completions", {"messages": USER, "tools": [ADD_TOOL], "tool_choice": {"type": "function",
                                                                                 "function": {"name": "mul"}}},
     "tool_choice"),
    ("responses", {"input": "hi", "top_logprobs": 3}, "top_logprobs"),
    ("responses", {"input": "hi", "max_tool_calls": 2}, "max_tool_calls"),
    ("responses", {"input": [{"type": "function_call_output", "call_id": "nope", "output": "5"}]}, "input[0].call_id"),
    ("messages", {"messages": USER, "mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp_servers"),
    ("messages", {"messages": USER, "container": "container_1"}, "container"),
    ("messages", {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope"}]}]},
     "messages[0].content[0].tool_use_id"),
]


@pytest.mark.parametrize("path,body,field", REFUSED, ids=[f"{p.split('/')[0]}-{f}" for p, _, f in REFUSED])
def test_a_field_no_engine_serves_is_a_400_naming_it(live_server, path, body, field):
    server = live_server()
    r = post(server.url, path, {"model": "policy", "max_tokens": 2, **body})
    assert r.status_code == 400 and field in r.json()["error"]["message"], r.text


def test_messages_caps_a_max_tokens_past_the_context_and_says_so_where_chat_refuses(live_server):
    policy, _ = scripted_policy(["ok"])
    server = live_server({"policy": policy})
    r = post(server.url, "messages", {"model": "policy", "max_tokens": 4096, "messages": USER})
    assert r.status_code == 200, r.text
    assert 0 < int(r.headers[CAPPED_HEADER]) < 4096
    refused = post(server.url, "chat/completions", {"model": "policy", "max_tokens": 4096, "messages": USER})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"


def test_more_than_four_stop_sequences_are_served(live_server):
    server = live_server()
    stops = [f"stop{k}" for k in range(12)]
    r = post(server.url, "messages", {"model": "policy", "max_tokens": 2, "messages": USER, "stop_sequences": stops})
    assert r.status_code == 200, r.text


def test_the_token_counts_equal_the_recorded_prompt_lengths(live_server):
    policy, _ = scripted_policy([CALL, "The sum is 3.", CALL])
    server = live_server({"policy": policy})
    with SwarmClient(server.url).episode(task_id="count") as ep:
        ask = {"model": "policy", "max_tokens": 200, "tools": [ANTHROPIC_ADD]}
        turns = [{"role": "user", "content": "add 1 and 2"}]
        for _ in range(2):
            counted = post(server.url, "messages/count_tokens", {**ask, "messages": turns}, ep.api_key)
            made = post(server.url, "messages", {**ask, "messages": turns}, ep.api_key).json()
            calls = server.registry._open[ep.id].calls
            assert counted.status_code == 200 and counted.json() == {"input_tokens": len(calls[-1].prompt_ids)}
            use = next(b for b in made["content"] if b["type"] == "tool_use") if made["stop_reason"] == "tool_use" else None
            turns += [{"role": "assistant", "content": made["content"]},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "3"}]
                       if use else "thanks"}]
        assert calls[-1].reused_prefix > 0  # the count rendered the reused ids, as the call did
        items = [{"role": "user", "content": "add 1 and 2"}]
        counted = post(server.url, "responses/input_tokens", {"model": "policy", "input": items,
                                                              "tools": [RESPONSES_ADD]}, ep.api_key)
        post(server.url, "responses", {"model": "policy", "input": items, "tools": [RESPONSES_ADD],
                                       "max_output_tokens": 200}, ep.api_key)
        assert counted.json() == {"object": "response.input_tokens",
                                  "input_tokens": len(server.registry._open[ep.id].calls[-1].prompt_ids)}
        assert len(server.registry._open[ep.id].calls) == 3  # counting recorded nothing
        ep.finish(0.0)
