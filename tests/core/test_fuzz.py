"""Bad input, generated: no request a client can send yields a 5xx or kills the server.

Schemathesis derives requests from the app's own OpenAPI schema (valid and invalid ones); hypothesis
throws arbitrary JSON at the chat route. The null engine answers instantly, so the fuzzing time is
spent on validation, rendering, recording and the swarm routes rather than on sampling.
"""

from __future__ import annotations

import json

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from core.config_io import load_config
from core.models import build_tiny
from core.serve.server import Server
from tests.support import tiny_policy


def _app():
    model, tok = build_tiny()
    cfg = load_config(overrides=["engine.kind=instant", "engine.default_max_tokens=8"])
    return Server(cfg, policies={"policy": tiny_policy(model, tok, engine="instant")}).app()


APP = _app()
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)


@pytest.mark.slow
@schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_generated_request_gets_a_server_error(case):
    response = case.call()
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        assert "error" in response.json()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "tool", "system", "developer", "bogus"])},
        optional={"content": json_values, "tool_calls": json_values, "tool_call_id": json_values},
    ),
    max_size=4,
)
chat_bodies = st.fixed_dictionaries(
    {"model": st.sampled_from(["policy", "other", ""]), "messages": messages},
    optional={"max_tokens": json_values, "temperature": json_values, "tools": json_values, "n": json_values,
              "stop": json_values, "stream": st.booleans(), "seed": json_values, "top_p": json_values},
)


@pytest.mark.slow
@given(body=chat_bodies | json_values)
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
def test_arbitrary_json_on_the_chat_route_never_breaks_the_server(body):
    with TestClient(APP) as client:
        r = client.post("/v1/chat/completions", content=json.dumps(body), headers={"content-type": "application/json"})
        assert r.status_code < 500, r.text
        if r.status_code >= 400:
            assert set(r.json()["error"]) >= {"message", "type", "code"}
        assert client.get("/v1/models").status_code == 200


items = st.lists(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "bogus"])},
        optional={"role": st.sampled_from(["user", "assistant", "system", "developer", "tool", "x"]),
                  "content": json_values, "call_id": json_values, "name": json_values, "arguments": json_values,
                  "output": json_values},
    ),
    max_size=4,
)
responses_bodies = st.fixed_dictionaries(
    {"model": st.sampled_from(["policy", "other"]), "input": st.text(max_size=10) | items},
    optional={"instructions": json_values, "tools": json_values, "tool_choice": json_values, "stream": st.booleans(),
              "previous_response_id": json_values, "max_output_tokens": json_values, "text": json_values},
)
blocks = st.lists(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "tool_use", "tool_result", "image", "thinking"])},
        optional={"text": json_values, "id": json_values, "name": json_values, "input": json_values,
                  "tool_use_id": json_values, "content": json_values},
    ),
    max_size=4,
)
messages_bodies = st.fixed_dictionaries(
    {"model": st.sampled_from(["policy", "other"]), "max_tokens": json_values,
     "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                                 "content": st.text(max_size=10) | blocks}), max_size=3)},
    optional={"system": json_values, "tools": json_values, "tool_choice": json_values, "stream": st.booleans(),
              "stop_sequences": json_values},
)


@pytest.mark.slow
@pytest.mark.parametrize("path,bodies", [("/v1/responses", responses_bodies), ("/v1/messages", messages_bodies)],
                         ids=["responses", "messages"])
def test_arbitrary_items_and_blocks_never_break_the_server(path, bodies):
    @given(body=bodies | json_values)
    @settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
    def check(body):
        with TestClient(APP) as client:
            r = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
            assert r.status_code < 500, r.text
            if r.status_code >= 400:
                assert set(r.json()["error"]) >= {"message", "type", "code"}
            assert client.get("/v1/models").status_code == 200

    check()
