"""The Responses and Messages APIs over real HTTP, driven by the official `openai` and `anthropic` SDKs.

Each conversation is held twice on a live swarm server with the tool-calling tiny model, in two
episodes: once through the API under test and once through Chat Completions. Greedy decoding makes
both conversations the same, so the two episodes' recorded calls, and the timelines they merge
into, must hold the very same token ids: one renderer, whichever API carried the conversation.
"""

from __future__ import annotations

import anthropic
import openai
import pytest

from core.clients.sdk import SwarmClient
from core.train.timelines import merge_calls
from tests.support import ADD_TOOL, ANSWER_TEXT, USER_PROMPTS, tiny_policy

SYSTEM = "You add numbers."
GREEDY = {"temperature": 0}  # the anthropic SDK (2.x) has no temperature argument; the API still takes it
RESPONSES_TOOL = {"type": "function", **ADD_TOOL["function"]}
ANTHROPIC_TOOL = {"name": "add", "description": ADD_TOOL["function"]["description"],
                  "input_schema": ADD_TOOL["function"]["parameters"]}
# What every call of a conversation asks, greedy so both APIs' conversations are the same one.
RESPONSES_ASK = {"model": "policy", "instructions": SYSTEM, "tools": [RESPONSES_TOOL], "temperature": 0,
                 "max_output_tokens": 80}
MESSAGES_ASK = {"model": "policy", "system": SYSTEM, "tools": [ANTHROPIC_TOOL], "max_tokens": 80, "extra_body": GREEDY}


@pytest.fixture
def tool_server(live_server, tool_model):
    model, tok = tool_model
    return live_server({"policy": tiny_policy(model, tok)})


def chat_twin(server) -> list:
    """The tool conversation over Chat Completions: a tool call, its result, the answer. Returns the calls."""
    with SwarmClient(server.url).episode(task_id="chat-twin") as ep:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER_PROMPTS[0]}]
        first = ep.openai.chat.completions.create(model="policy", messages=messages, tools=[ADD_TOOL], temperature=0,
                                                  max_tokens=80).choices[0].message
        assert first.tool_calls, first
        messages += [first.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "5"}]
        second = ep.openai.chat.completions.create(model="policy", messages=messages, tools=[ADD_TOOL], temperature=0,
                                                   max_tokens=80).choices[0].message
        assert second.content == ANSWER_TEXT
        calls = list(server.registry._open[ep.id].calls)
        ep.finish(1.0)
    return calls


def assert_same_timeline(calls, twin) -> None:
    assert [(c.prompt_ids, c.completion_ids) for c in calls] == [(c.prompt_ids, c.completion_ids) for c in twin]
    ours, theirs = merge_calls(calls, "linear"), merge_calls(twin, "linear")
    assert len(ours) == 1  # the second turn extends the first: one merged sample
    assert [(s.input_ids, s.loss_mask) for s in ours] == [(s.input_ids, s.loss_mask) for s in theirs]
    assert calls[1].reused_prefix == len(calls[0].prompt_ids) + len(calls[0].completion_ids)  # token-in-token-out


def responses_client(ep) -> openai.OpenAI:
    return openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)


def stream_response(client: openai.OpenAI, **kw):
    """A streamed response: (event types in order, the final response object, the streamed text)."""
    kinds, numbers, text, final = [], [], [], None
    for ev in client.responses.create(stream=True, **kw):
        kinds.append(ev.type)
        numbers.append(ev.sequence_number)
        if ev.type == "response.output_text.delta":
            text.append(ev.delta)
        if ev.type in ("response.completed", "response.incomplete"):
            final = ev.response
    assert [e for e in kinds if e.startswith("response.") and e.split(".")[1] in ("created", "in_progress")] == [
        "response.created", "response.in_progress"]
    assert numbers == list(range(len(kinds)))
    return kinds, final, "".join(text)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_responses_tool_turns_with_previous_response_id_record_the_ids_chat_gives(tool_server, stream):
    server = tool_server
    twin = chat_twin(server)
    with SwarmClient(server.url).episode(task_id="responses") as ep:
        client = responses_client(ep)
        if stream:
            kinds, first, _ = stream_response(client, input=USER_PROMPTS[0], **RESPONSES_ASK)
            assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
        else:
            first = client.responses.create(input=USER_PROMPTS[0], **RESPONSES_ASK)
        [call] = [item for item in first.output if item.type == "function_call"]
        assert (call.name, call.arguments) == ("add", '{"a": 2, "b": 3}')
        assert first.usage.input_tokens == len(twin[0].prompt_ids)
        assert first.usage.output_tokens == len(twin[0].completion_ids)
        follow = {"previous_response_id": first.id,
                  "input": [{"type": "function_call_output", "call_id": call.call_id, "output": "5"}], **RESPONSES_ASK}
        if stream:
            kinds, second, text = stream_response(client, **follow)
            assert text == ANSWER_TEXT and "response.output_text.done" in kinds
        else:
            second = client.responses.create(**follow)
        assert second.output_text == ANSWER_TEXT and second.status == "completed"
        assert second.previous_response_id == first.id
        calls = list(server.registry._open[ep.id].calls)
        ep.finish(1.0)
    assert_same_timeline(calls, twin)


def test_responses_without_previous_response_id_resend_the_output_items(tool_server):
    """The Agents SDK's default: every turn sends the whole conversation as items, output items included."""
    server = tool_server
    twin = chat_twin(server)
    with SwarmClient(server.url).episode(task_id="items") as ep:
        client = responses_client(ep)
        items = [{"role": "user", "content": USER_PROMPTS[0]}]
        first = client.responses.create(input=items, **RESPONSES_ASK)
        items += [o.model_dump(exclude_none=True) for o in first.output]
        items.append({"type": "function_call_output", "call_id": first.output[-1].call_id, "output": "5"})
        assert client.responses.create(input=items, **RESPONSES_ASK).output_text == ANSWER_TEXT
        calls = list(server.registry._open[ep.id].calls)
        ep.finish(1.0)
    assert_same_timeline(calls, twin)


def test_a_previous_response_of_another_episode_is_a_404(tool_server):
    server = tool_server
    client = SwarmClient(server.url)
    with client.episode(task_id="a") as a, client.episode(task_id="b") as b:
        first = responses_client(a).responses.create(model="policy", input="hi", max_output_tokens=4)
        with pytest.raises(openai.NotFoundError) as e:
            responses_client(b).responses.create(model="policy", input="more", previous_response_id=first.id)
        assert "previous_response_id" in str(e.value)
        again = responses_client(a).responses.create(model="policy", input="more", previous_response_id=first.id,
                                                     max_output_tokens=4)
        assert again.status in ("completed", "incomplete")
        a.finish(0.0)
        b.finish(0.0)


def anthropic_client(ep) -> anthropic.Anthropic:
    # The SDK appends /v1/messages and sends the key as x-api-key: the episode key, unchanged.
    return anthropic.Anthropic(base_url=ep.base_url.removesuffix("/").removesuffix("/v1"), api_key=ep.api_key,
                               max_retries=0)


def stream_message(client: anthropic.Anthropic, **kw):
    """A streamed message: (event types, text, tool_use blocks as (id, name, input), stop reason, output tokens)."""
    kinds, text, tools = [], [], []
    with client.messages.stream(**kw) as events:
        for ev in events:
            kinds.append(ev.type)
        final = events.get_final_message()
    for block in final.content:
        if block.type == "text":
            text.append(block.text)
        else:
            tools.append((block.id, block.name, block.input))
    return kinds, "".join(text), tools, final.stop_reason, final.usage.output_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_messages_tool_use_then_tool_result_record_the_ids_chat_gives(tool_server, stream):
    server = tool_server
    twin = chat_twin(server)
    with SwarmClient(server.url).episode(task_id="messages") as ep:
        client = anthropic_client(ep)
        messages = [{"role": "user", "content": USER_PROMPTS[0]}]
        if stream:
            kinds, text, tools, reason, out_tokens = stream_message(client, messages=messages, **MESSAGES_ASK)
            assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
            [(use_id, name, args)] = tools
        else:
            first = client.messages.create(messages=messages, **MESSAGES_ASK)
            [use] = [b for b in first.content if b.type == "tool_use"]
            use_id, name, args, reason, out_tokens = use.id, use.name, use.input, first.stop_reason, first.usage.output_tokens
            messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]})
        assert (name, args, reason) == ("add", {"a": 2, "b": 3}, "tool_use")
        assert out_tokens == len(twin[0].completion_ids)
        if stream:
            messages.append({"role": "assistant", "content": [{"type": "tool_use", "id": use_id, "name": name, "input": args}]})
        messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": use_id, "content": "5"}]})
        if stream:
            _, text, tools, reason, _ = stream_message(client, messages=messages, **MESSAGES_ASK)
        else:
            second = client.messages.create(messages=messages, **MESSAGES_ASK)
            text, tools, reason = "".join(b.text for b in second.content if b.type == "text"), [], second.stop_reason
        assert (text, tools, reason) == (ANSWER_TEXT, [], "end_turn")
        calls = list(server.registry._open[ep.id].calls)
        ep.finish(1.0)
    assert_same_timeline(calls, twin)


def test_the_tito_counters_count_every_api(tool_server):
    server = tool_server
    before = server.status()["throughput"]["tito"]["reused"]
    chat_twin(server)
    with SwarmClient(server.url).episode(task_id="count") as ep:
        client = anthropic_client(ep)
        first = client.messages.create(messages=[{"role": "user", "content": USER_PROMPTS[0]}], **MESSAGES_ASK)
        use = next(b for b in first.content if b.type == "tool_use")
        client.messages.create(messages=[
            {"role": "user", "content": USER_PROMPTS[0]},
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}]}], **MESSAGES_ASK)
        ep.finish(1.0)
    tito = server.status()["throughput"]["tito"]
    assert tito["reused"] == before + 2 and tito["broken"] == 0


def test_streamed_and_whole_responses_and_messages_give_the_same_text_as_chat(live_server):
    server = live_server()
    with SwarmClient(server.url).episode(task_id="plain") as ep:
        chat = ep.openai.chat.completions.create(model="policy", messages=[{"role": "user", "content": "tell me"}],
                                                 temperature=0, max_tokens=12).choices[0].message.content
        client = responses_client(ep)
        whole = client.responses.create(model="policy", input="tell me", temperature=0, max_output_tokens=12)
        _, final, streamed = stream_response(client, model="policy", input="tell me", temperature=0, max_output_tokens=12)
        assert whole.output_text == streamed == final.output_text == chat
        assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
        claude = anthropic_client(ep)
        ask = {"model": "policy", "max_tokens": 12, "messages": [{"role": "user", "content": "tell me"}], "extra_body": GREEDY}
        message = claude.messages.create(**ask)
        kinds, text, tools, reason, out_tokens = stream_message(claude, **ask)
        assert "".join(b.text for b in message.content) == text == chat and tools == []
        assert message.stop_reason == reason == "max_tokens" and out_tokens == message.usage.output_tokens == 12
        ep.finish(0.0)


def test_a_response_made_with_store_false_cannot_be_continued(live_server):
    server = live_server()
    with SwarmClient(server.url).episode(task_id="unstored") as ep:
        client = responses_client(ep)
        first = client.responses.create(model="policy", input="hi", max_output_tokens=4, store=False)
        with pytest.raises(openai.NotFoundError):
            client.responses.create(model="policy", input="more", previous_response_id=first.id, max_output_tokens=4)
        ep.finish(0.0)
