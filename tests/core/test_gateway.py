"""The swarm server over real HTTP, driven by the official `openai` package and the SwarmClient SDK."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
import torch

from core.clients.retries import SwarmError
from core.clients.sdk import SwarmClient
from tests.support import ADD_TOOL, USER_PROMPTS, credential, tiny_policy


def _episode_calls(server, episode_id):
    ep = server.registry._open.get(episode_id)
    return ep.calls if ep is not None else None


def test_multi_turn_chat_records_exactly_the_generated_ids(live_server):
    server = live_server()
    client = SwarmClient(server.url)
    policy = server.policies["policy"]
    with client.episode(task_id="t1") as ep:
        messages = [{"role": "user", "content": "hello"}]
        replies = []
        for turn in range(3):
            r = ep.openai.chat.completions.create(model="policy", messages=messages, max_tokens=8, logprobs=True)
            replies.append(r)
            messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": f"turn {turn}"}]
        calls = _episode_calls(server, ep.id)
        assert len(calls) == 3
        for call, r in zip(calls, replies):
            assert [c.logprob for c in r.choices[0].logprobs.content] == pytest.approx(call.completion_logprobs)
            assert r.usage.completion_tokens == len(call.completion_ids)
            assert r.usage.prompt_tokens == len(call.prompt_ids)
            # The recorded ids are the sampled ones: the model scores them with the recorded logprobs.
            ids = torch.tensor([call.prompt_ids + call.completion_ids])
            with torch.no_grad():
                logp = torch.log_softmax(policy.model(ids).logits[0].float(), -1)
            start = len(call.prompt_ids) - 1
            rescored = [float(logp[start + k, t]) for k, t in enumerate(call.completion_ids)]
            assert rescored == pytest.approx(call.completion_logprobs, abs=1e-4)
        ep.finish(1.0)


def test_later_turns_reuse_the_exact_ids_of_earlier_turns(live_server):
    server = live_server()
    with SwarmClient(server.url).episode(task_id="tito") as ep:
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        for turn in range(5):
            r = ep.openai.chat.completions.create(model="policy", messages=messages, max_tokens=6)
            messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
        calls = _episode_calls(server, ep.id)
        for prev, call in zip(calls, calls[1:]):
            full = prev.prompt_ids + prev.completion_ids
            assert call.prompt_ids[: len(full)] == full
            assert call.reused_prefix == len(full)
        ep.finish(0.0)
    assert server.status()["throughput"]["tito"]["reused"] == 4


def test_tool_call_round_trip_over_five_turns_keeps_token_prefixes(live_server, tool_model):
    model, tok = tool_model
    server = live_server({"policy": tiny_policy(model, tok)})
    with SwarmClient(server.url).episode(task_id="tools") as ep:
        messages = [{"role": "user", "content": USER_PROMPTS[0]}]
        replies = []
        for _ in range(5):
            r = ep.openai.chat.completions.create(model="policy", messages=messages, tools=[ADD_TOOL], temperature=0, max_tokens=80)
            replies.append(r.choices[0])
            msg = r.choices[0].message
            messages.append(msg.model_dump(exclude_none=True))
            if msg.tool_calls:
                messages.append({"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "5"})
            else:
                messages.append({"role": "user", "content": USER_PROMPTS[0]})
        first, second = replies[0], replies[1]
        assert first.finish_reason == "tool_calls"
        assert first.message.tool_calls[0].function.name == "add"
        assert first.message.tool_calls[0].function.arguments == '{"a": 2, "b": 3}'
        assert second.message.content == "The sum is 5."  # answered from the tool result
        calls = _episode_calls(server, ep.id)
        assert len(calls) == 5
        for prev, call in zip(calls, calls[1:]):
            assert call.prompt_ids[: len(prev.prompt_ids) + len(prev.completion_ids)] == prev.prompt_ids + prev.completion_ids
        ep.finish(1.0)


def test_streaming_yields_the_same_text_as_a_plain_call(live_server):
    server = live_server()
    o = openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY")
    msgs = [{"role": "user", "content": "tell me"}]
    plain = o.chat.completions.create(model="policy", messages=msgs, max_tokens=12, seed=3)
    chunks = list(o.chat.completions.create(model="policy", messages=msgs, max_tokens=12, seed=3, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == plain.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_temperature_zero_is_deterministic_and_stop_strings_cut_text(live_server):
    server = live_server()
    o = openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY")
    msgs = [{"role": "user", "content": "x"}]
    a = o.chat.completions.create(model="policy", messages=msgs, max_tokens=10, temperature=0)
    b = o.chat.completions.create(model="policy", messages=msgs, max_tokens=10, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    text = a.choices[0].message.content
    if len(text) > 3:
        stop = text[2:4]
        c = o.chat.completions.create(model="policy", messages=msgs, max_tokens=10, temperature=0, stop=[stop])
        assert c.choices[0].message.content == text[: text.index(stop)]
        assert c.choices[0].finish_reason == "stop"


def test_completions_route_accepts_text_and_token_prompts(live_server):
    server = live_server()
    o = openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY")
    r = o.completions.create(model="policy", prompt="abc", max_tokens=5, seed=1)
    assert r.usage.prompt_tokens == 3 and r.choices[0].text is not None
    ids = server.policies["policy"].tokenizer("abc", add_special_tokens=False)["input_ids"]
    r2 = o.completions.create(model="policy", prompt=ids, max_tokens=5, seed=1)  # the same prompt, as ids
    assert r2.choices[0].text == r.choices[0].text


def test_sixteen_concurrent_agents_share_batches(live_server):
    server = live_server()
    o = openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY")
    results = []

    def agent(i):
        results.append(o.chat.completions.create(model="policy", messages=[{"role": "user", "content": f"q{i}"}], max_tokens=32))

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 16
    assert server.policies["policy"].engine.stats["max_rows"] > 1


def test_lease_expires_when_heartbeats_stop(live_server):
    server = live_server()
    opened = httpx.post(server.url + "/swarm/v1/episodes", json={"task_id": "t", "lease_s": 0.3}).json()
    time.sleep(0.8)
    r = httpx.post(opened["base_url"] + "/chat/completions", json={"model": "policy", "messages": [{"role": "user", "content": "x"}]},
                   headers={"Authorization": f"Bearer {opened['api_key']}"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "episode_expired"
    assert server.status()["episodes"]["expired"] == 1


def test_heartbeats_keep_a_short_lease_alive(live_server):
    server = live_server()
    with SwarmClient(server.url).episode(task_id="t", lease_s=1.0) as ep:
        time.sleep(2.0)
        ep.openai.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}], max_tokens=2)
        ep.finish(0.5)
    assert server.status()["episodes"]["expired"] == 0


def test_finish_is_idempotent_and_a_different_body_conflicts(live_server):
    server = live_server()
    client = SwarmClient(server.url)
    with client.episode(task_id="t") as ep:
        first = ep.finish(0.25)
        assert ep.finish(0.25) == first
        with pytest.raises(SwarmError) as e:
            ep.finish(0.75)
        assert e.value.status == 409


def test_leaving_an_episode_without_reward_aborts_it(live_server):
    server = live_server()
    with pytest.raises(RuntimeError):
        with SwarmClient(server.url).episode(task_id="t"):
            raise RuntimeError("agent crashed")
    with SwarmClient(server.url).episode(task_id="t"):
        pass
    assert server.status()["episodes"]["aborted"] == 2
    assert server.registry.ready_groups() == 0


def test_client_waits_out_a_paused_server(live_server):
    server = live_server()
    admin = {"Authorization": f"Bearer {server.admin_token}"}
    assert httpx.post(server.url + "/swarm/v1/admin/pause", headers=admin).status_code == 200
    threading.Timer(1.0, lambda: httpx.post(server.url + "/swarm/v1/admin/resume", headers=admin)).start()
    start = time.time()
    with SwarmClient(server.url).episode(task_id="t") as ep:
        ep.finish(1.0)
    assert time.time() - start >= 0.9


def test_admin_routes_need_the_token(live_server):
    server = live_server()
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(server.url + "/swarm/v1/admin/pause", headers=headers)
        assert r.status_code == 401 and "error" in r.json()


def test_keys_are_required_when_anonymous_use_is_off(live_server):
    server = live_server(server__allow_anonymous=False)
    grant = credential(server)  # a server that takes no anonymous use takes no anonymous opens either
    body = {"model": "policy", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    assert httpx.post(server.url + "/v1/chat/completions", json=body).status_code == 401
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer sk-swarm-forged"})
    assert r.status_code == 401
    with SwarmClient(server.url, credential=grant).episode(task_id="t") as ep:
        assert ep.openai.chat.completions.create(model="policy", messages=body["messages"], max_tokens=2).choices
        ep.finish(0.0)


def test_anonymous_calls_are_served_but_never_recorded(live_server):
    server = live_server()
    o = openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY")
    o.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert server.status()["episodes"]["calls"] == 0


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "model_not_found"),
        ({"model": "policy", "messages": [{"role": "wizard", "content": "x"}]}, 400, "invalid_request"),
        ({"model": "policy", "messages": []}, 400, "invalid_request"),
        ({"model": "policy", "messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}, 400, "context_length_exceeded"),
        ({"model": "policy", "messages": [{"role": "user", "content": "x" * 3000}]}, 400, "context_length_exceeded"),
        ({"model": "policy", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "bad name!"}}]}, 400, "invalid_request"),
        ({"model": "policy", "messages": [{"role": "user", "content": "x"}], "temperature": -1}, 400, "invalid_request"),
    ],
)
def test_bad_requests_get_openai_shaped_errors(live_server, body, status, code):
    server = live_server()
    r = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert r.status_code == status
    assert r.json()["error"]["code"] == code and r.json()["error"]["message"]


def test_malformed_json_is_a_400_not_a_crash(live_server):
    server = live_server()
    r = httpx.post(server.url + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    assert httpx.get(server.url + "/v1/models").status_code == 200
