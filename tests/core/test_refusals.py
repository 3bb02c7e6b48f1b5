"""Every refusal is one type (`core.episodes.errors.Refusal`), rendered in the shape of the caller's API:
OpenAI-shaped on the OpenAI and swarm routes, Anthropic-shaped on the Messages routes, over real HTTP."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from core.episodes.errors import Refusal
from core.serve.errors import error_body, is_anthropic

MESSAGES = {"model": "policy", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
CHAT = {"model": "policy", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}


def test_a_messages_route_refusal_is_anthropic_shaped_and_keeps_status_and_code(live_server):
    server = live_server(server__allow_anonymous=False)
    r = httpx.post(server.url + "/v1/messages", json=MESSAGES, headers={"x-api-key": "sk-swarm-forged"}, timeout=60)
    assert r.status_code == 401
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
    assert body["error"]["code"] == "invalid_api_key" and "episode key" in body["error"]["message"]
    # the path form is a Messages route too
    r = httpx.post(server.url + "/episodes/0123456789abcdef0123456789abcdef/v1/messages", json=MESSAGES, timeout=60)
    assert r.status_code == 401 and r.json()["type"] == "error", r.text


def test_the_anthropic_sdk_reads_our_refusal_as_its_own_error_type(live_server):
    server = live_server()
    client = anthropic.Anthropic(base_url=server.url, api_key="EMPTY", max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["error"]["type"] == "not_found_error" and "no-such-model" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:  # a validation error is rendered the same way
        client.messages.create(model="policy", max_tokens=0, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["error"]["type"] == "invalid_request_error"


def test_an_openai_route_refusal_is_openai_shaped_and_the_sdk_reads_it(live_server):
    server = live_server()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert e.value.code == "model_not_found" and e.value.type == "not_found_error"
    r = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "temperature": "hot"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text  # the field at fault


def test_a_body_over_the_limit_on_the_messages_route_is_anthropic_shaped(live_server):
    server = live_server(server__max_request_bytes=2_000)
    big = {**MESSAGES, "messages": [{"role": "user", "content": "x" * 5_000}]}
    r = httpx.post(server.url + "/v1/messages", json=big, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large", r.text
    r = httpx.post(server.url + "/v1/chat/completions", json=big, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text


def test_a_swarm_route_refusal_is_openai_shaped_with_retry_after(live_server):
    server = live_server()
    httpx.post(server.url + "/swarm/v1/admin/pause", headers={"Authorization": f"Bearer {server.admin_token}"})
    r = httpx.post(server.url + "/swarm/v1/episodes", json={"task_id": "t"}, timeout=60)
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    assert r.json()["error"] == {"message": "the server is paused", "type": "service_unavailable", "code": "paused",
                                 "param": None}


@pytest.mark.parametrize("status,anthropic_type", [(400, "invalid_request_error"), (403, "permission_error"),
                                                   (409, "invalid_request_error"), (413, "request_too_large"),
                                                   (429, "rate_limit_error"), (503, "overloaded_error"),
                                                   (504, "api_error"), (599, "api_error")])
def test_every_status_maps_to_one_of_anthropics_error_types(status, anthropic_type):
    body = error_body("/v1/messages", Refusal(status, "why", "code"))
    assert body == {"type": "error", "error": {"type": anthropic_type, "message": "why", "code": "code"}}


def test_only_the_messages_routes_are_anthropic_shaped():
    assert is_anthropic("/v1/messages") and is_anthropic("/episodes/abc/v1/messages")
    assert not any(is_anthropic(p) for p in ("/v1/chat/completions", "/v1/responses", "/swarm/v1/episodes",
                                             "/episodes/abc/v1/chat/completions"))
