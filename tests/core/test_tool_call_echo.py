"""One canonical tool call: what a harness echoes back renders the tokens the model wrote, on every route.

Over real HTTP. A call's arguments are the model's own text; a client that re-serialises them
(LangChain writes `"Z\\u00fcrich"` for `"Zürich"`, JavaScript compact JSON) still extends the
episode's history, so the next call reuses the earlier call's exact ids. The same conversation
renders the same prompt ids on Chat, Responses and Messages, `strict` tools included; a malformed
call (arguments not an object, an empty name) stays text that every route can send back; an empty
reply on Responses is an empty message item a client can resend.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from core.clients.sdk import SwarmClient
from tests.core.scripted import scripted_policy
from tests.support import ADD_TOOL, USER_PROMPTS, tiny_policy

CITY = {"type": "function", "function": {"name": "weather", "description": "Weather in a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
LONG = 200  # tokens: room for every scripted reply (the test server defaults to 16)
ZURICH_CALL = '<tool_call>\n{"name": "weather", "arguments": {"city": "Zürich"}}\n</tool_call>'


def calls_of(server, ep) -> list:
    return list(server.registry._open[ep.id].calls)


def assert_extends(calls) -> None:
    """The last call reused every id of the one before it: token-in-token-out held."""
    assert calls[-1].reused_prefix == len(calls[-2].prompt_ids) + len(calls[-2].completion_ids)


@pytest.mark.parametrize("echo", [
    lambda args: json.dumps(json.loads(args)),  # ASCII escapes, as Python's json and LangChain write it
    lambda args: json.dumps(json.loads(args), ensure_ascii=False, separators=(",", ":")),  # compact, as JavaScript
], ids=["ascii-escaped", "compact"])
def test_a_re_serialised_echo_of_a_non_ascii_call_reuses_its_prefix(live_server, echo):
    policy, _ = scripted_policy([ZURICH_CALL, "Sunny."])
    server = live_server({"policy": policy})
    before = server.status()["throughput"]["tito"]["broken"]
    with SwarmClient(server.url).episode(task_id="zurich") as ep:
        messages = [{"role": "user", "content": "Weather in Zürich?"}]
        first = ep.openai.chat.completions.create(model="policy", messages=messages, tools=[CITY], max_tokens=LONG).choices[0].message
        [call] = first.tool_calls
        assert call.function.arguments == '{"city": "Zürich"}'  # the model's own text, not a re-serialisation
        echoed = {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": "weather", "arguments": echo(call.function.arguments)}}]}
        messages += [echoed, {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
        ep.openai.chat.completions.create(model="policy", messages=messages, tools=[CITY], max_tokens=LONG)
        calls = calls_of(server, ep)
        assert_extends(calls)
        ep.finish(1.0)
    assert server.status()["throughput"]["tito"]["broken"] == before


def test_compact_json_from_the_real_model_reuses_its_prefix(live_server, tool_model):
    model, tok = tool_model
    server = live_server({"policy": tiny_policy(model, tok)})
    with SwarmClient(server.url).episode(task_id="compact") as ep:
        messages = [{"role": "user", "content": USER_PROMPTS[0]}]
        ask = {"model": "policy", "tools": [ADD_TOOL], "temperature": 0, "max_tokens": 80}
        first = ep.openai.chat.completions.create(messages=messages, **ask).choices[0].message
        [call] = first.tool_calls
        compact = json.dumps(json.loads(call.function.arguments), separators=(",", ":"))
        assert compact == '{"a":2,"b":3}' != call.function.arguments
        messages += [{"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": "add", "arguments": compact}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "5"}]
        ep.openai.chat.completions.create(messages=messages, **ask)
        assert_extends(calls_of(server, ep))
        ep.finish(1.0)


def test_chat_responses_and_messages_render_the_same_prompt_ids_with_strict_tools(live_server):
    policy, engine = scripted_policy(["ok"] * 3)
    server = live_server({"policy": policy})
    fn = {**ADD_TOOL["function"], "strict": True}
    # One conversation, each harness writing the earlier call its own way (compact, spaced, an object).
    chat = {"model": "policy", "max_tokens": 4, "tools": [{"type": "function", "function": fn}], "messages": [
        {"role": "user", "content": USER_PROMPTS[0]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a":2,"b":3}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"}]}
    responses = {"model": "policy", "max_output_tokens": 4, "tools": [{"type": "function", **fn}], "input": [
        {"role": "user", "content": USER_PROMPTS[0]},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 2, "b": 3}'},
        {"type": "function_call_output", "call_id": "c1", "output": "5"}]}
    messages = {"model": "policy", "max_tokens": 4, "tools": [
        {"name": "add", "description": fn["description"], "input_schema": fn["parameters"], "strict": True}], "messages": [
        {"role": "user", "content": USER_PROMPTS[0]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "add", "input": {"a": 2, "b": 3}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "5"}]}]}
    for path, body in (("chat/completions", chat), ("responses", responses), ("messages", messages)):
        r = httpx.post(f"{server.url}/v1/{path}", json=body, timeout=60)
        assert r.status_code == 200, r.text
    chat_ids, responses_ids, messages_ids = engine.prompts
    assert chat_ids == responses_ids == messages_ids
    assert "strict" not in policy.tokenizer.decode(chat_ids)


MALFORMED = ['<tool_call>\n{"name": "add", "arguments": [1, 2]}\n</tool_call>',
             '<tool_call>\n{"name": "", "arguments": {"a": 1}}\n</tool_call>']


@pytest.mark.parametrize("text", MALFORMED, ids=["list-arguments", "empty-name"])
def test_a_malformed_call_stays_text_and_round_trips_on_every_route(live_server, text):
    policy, _ = scripted_policy([text, "ok"] * 3)
    server = live_server({"policy": policy})
    client = SwarmClient(server.url)
    with client.episode(task_id="chat") as ep:
        messages = [{"role": "user", "content": "go"}]
        first = ep.openai.chat.completions.create(model="policy", messages=messages, tools=[ADD_TOOL], max_tokens=LONG).choices[0]
        assert (first.message.content, first.message.tool_calls, first.finish_reason) == (text, None, "stop")
        messages += [first.message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
        ep.openai.chat.completions.create(model="policy", messages=messages, tools=[ADD_TOOL], max_tokens=LONG)
        assert_extends(calls_of(server, ep))
        ep.finish(0.0)
    with client.episode(task_id="responses") as ep:
        api = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        items = [{"role": "user", "content": "go"}]
        first = api.responses.create(model="policy", input=items, max_output_tokens=LONG, tools=[{"type": "function", **ADD_TOOL["function"]}])
        assert [o.type for o in first.output] == ["message"] and first.output_text == text
        items += [o.model_dump(exclude_none=True) for o in first.output] + [{"role": "user", "content": "again"}]
        api.responses.create(model="policy", input=items, max_output_tokens=LONG, tools=[{"type": "function", **ADD_TOOL["function"]}])
        assert_extends(calls_of(server, ep))
        ep.finish(0.0)
    with client.episode(task_id="messages") as ep:
        api = anthropic.Anthropic(base_url=ep.base_url.removesuffix("/").removesuffix("/v1"), api_key=ep.api_key,
                                  max_retries=0)
        tool = {"name": "add", "description": "Add two integers.", "input_schema": ADD_TOOL["function"]["parameters"]}
        messages = [{"role": "user", "content": "go"}]
        first = api.messages.create(model="policy", max_tokens=LONG, messages=messages, tools=[tool])
        assert [(b.type, b.text) for b in first.content] == [("text", text)] and first.stop_reason == "end_turn"
        messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                     {"role": "user", "content": "again"}]
        api.messages.create(model="policy", max_tokens=LONG, messages=messages, tools=[tool])
        assert_extends(calls_of(server, ep))
        ep.finish(0.0)


def test_a_malformed_call_beside_a_well_formed_one_is_kept_as_text(live_server):
    good = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    policy, _ = scripted_policy([good + "\n" + MALFORMED[0]])
    server = live_server({"policy": policy})
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": "policy", "tools": [ADD_TOOL], "max_tokens": LONG, "messages": [{"role": "user", "content": "go"}]})
    message = r.json()["choices"][0]["message"]
    assert [c["function"]["arguments"] for c in message["tool_calls"]] == ['{"a": 2, "b": 3}']
    assert message["content"] == MALFORMED[0]


def test_an_empty_responses_reply_is_an_empty_message_that_keeps_reuse(live_server):
    policy, _ = scripted_policy(["", "ok"])
    server = live_server({"policy": policy})
    with SwarmClient(server.url).episode(task_id="empty") as ep:
        api = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        items = [{"role": "user", "content": "say nothing"}]
        first = api.responses.create(model="policy", input=items)
        assert [(o.type, o.role) for o in first.output] == [("message", "assistant")] and first.output_text == ""
        items += [o.model_dump(exclude_none=True) for o in first.output] + [{"role": "user", "content": "now talk"}]
        api.responses.create(model="policy", input=items)
        assert_extends(calls_of(server, ep))
        ep.finish(0.0)
