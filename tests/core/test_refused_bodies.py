"""Bodies refused before anything is generated: too deep, or holding a lone surrogate, on every route.

Over real HTTP with the tiny model, in an episode: each such body is a 400 naming where, in the
server process and in the child that parses bodies over 1 MiB; the episode records no call and the
server counts none; and the keep-alive connection that carried the refused request serves the next,
as it does after an unexpected failure (a 500).
"""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlparse

import pytest

from core.clients.sdk import SwarmClient
from core.engine.null import NullEngine
from core.models import build_tiny
from core.serve.bodies import CHILD_BYTES, MAX_DEPTH
from core.serve.chat import ChatRenderer
from core.serve.state import Policy

DEEP = 3000  # levels: past Python's recursion limit, where json and pydantic raised RecursionError (a 500)
BASE = {
    "chat/completions": {"model": "policy", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
    "responses": {"model": "policy", "max_output_tokens": 2, "input": "hi"},
    "messages": {"model": "policy", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
}


def deep(levels: int) -> str:
    return "[" * levels + "]" * levels


def post(ep, path: str, raw: str) -> tuple[int, dict]:
    """POST raw JSON text with the episode's key; (status, body)."""
    url = urlparse(ep.base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    conn.request("POST", f"/v1/{path}", raw.encode(), {"Content-Type": "application/json",
                                                      "Authorization": f"Bearer {ep.api_key}", "x-api-key": ep.api_key})
    r = conn.getresponse()
    out = r.status, json.loads(r.read())
    conn.close()
    return out


def message(body: dict) -> str:
    return body["error"]["message"]


@pytest.mark.parametrize("path", list(BASE))
@pytest.mark.parametrize("size", ["small", "child"])
def test_a_body_nested_3000_deep_is_a_400_and_records_nothing(live_server, path, size):
    server = live_server()
    with SwarmClient(server.url).episode(task_id="deep") as ep:
        calls = server.status()["throughput"]["calls"]
        pad = "x" * (CHILD_BYTES + 1024) if size == "child" else ""  # past 1 MiB: parsed in the child process
        raw = json.dumps({**BASE[path], "pad": pad})[:-1] + f', "extra": {deep(DEEP)}}}'
        status, body = post(ep, path, raw)
        assert status == 400 and f"nested deeper than {MAX_DEPTH} levels" in message(body), body
        assert server.registry._open[ep.id].calls == [] and server.status()["throughput"]["calls"] == calls
        ep.finish(0.0)


@pytest.mark.parametrize("path,field,where", [
    ("responses", {"metadata": {"note": "\ud800"}}, "metadata.note"),
    ("responses", {"tools": [{"type": "function", "name": "f", "x": "\ud800"}]}, "tools.0.x"),
    ("messages", {"metadata": {"user_id": "\udfff"}}, "metadata.user_id"),
    ("chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "x": "\ud800"}}]},
     "tools.0.function.x"),
], ids=["responses-metadata", "responses-tool-key", "messages-metadata", "chat-tool-key"])
def test_a_lone_surrogate_anywhere_is_a_400_naming_it_and_records_nothing(live_server, path, field, where):
    server = live_server()
    with SwarmClient(server.url).episode(task_id="surrogate") as ep:
        status, body = post(ep, path, json.dumps({**BASE[path], **field}))  # json writes the surrogate as \ud800
        assert status == 400 and where in message(body) and "UTF-8" in message(body), body
        assert server.registry._open[ep.id].calls == []
        ep.finish(0.0)


def test_the_connection_that_carried_a_refused_body_serves_the_next_request(live_server):
    server = live_server()
    url = urlparse(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", (json.dumps(BASE["chat/completions"])[:-1] +
                                                  f', "extra": {deep(DEEP)}}}').encode(),
                 {"Content-Type": "application/json"})
    refused = conn.getresponse()
    refused.read()
    sock = conn.sock
    assert refused.status == 400 and not refused.will_close
    conn.request("POST", "/v1/chat/completions", json.dumps(BASE["chat/completions"]).encode(),
                 {"Content-Type": "application/json"})
    served = conn.getresponse()
    served.read()
    assert served.status == 200 and conn.sock is sock  # the same connection, not a reconnect
    conn.close()


class _Broken(NullEngine):
    """An engine with a bug: every generation raises something no handler expects."""

    async def generate(self, prompt_ids, params, on_token=None):
        raise RuntimeError("a bug")


def test_the_connection_that_carried_a_500_serves_the_next_request(live_server):
    model, tok = build_tiny()
    server = live_server({"policy": Policy("policy", model, tok, ChatRenderer(tok), _Broken(tok, 2048)),
                          "other": Policy("other", model, tok, ChatRenderer(tok), NullEngine(tok, 2048))})
    url = urlparse(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps(BASE["chat/completions"]).encode(),
                 {"Content-Type": "application/json"})
    failed = conn.getresponse()
    body = json.loads(failed.read())
    sock = conn.sock
    assert failed.status == 500 and body["error"]["code"] == "internal_error" and not failed.will_close
    conn.request("POST", "/v1/chat/completions", json.dumps({**BASE["chat/completions"], "model": "other"}).encode(),
                 {"Content-Type": "application/json"})
    served = conn.getresponse()
    served.read()
    assert served.status == 200 and conn.sock is sock
    conn.close()
