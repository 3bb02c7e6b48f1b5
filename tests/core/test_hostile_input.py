"""Hostile or unlucky input fails only itself: over real HTTP on the tiny model, each bad request gets
its own OpenAI-shaped 4xx/5xx (or is served, where clamping makes it harmless), and healthy requests
sent alongside all finish 200."""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.clients.retries import SwarmError
from core.clients.sdk import SwarmClient
from core.config import EngineConfig
from core.engine import GenerationError, SamplingParams
from core.engine.hf import HFEngine
from core.engine.null import NullEngine
from core.models import build_tiny
from core.serve.chat import ChatRenderer
from core.serve.openai_wire import SEED_MAX, SEED_MIN
from core.serve.state import Policy

CHAT = "/v1/chat/completions"


def chat(content="hello", **fields) -> dict:
    return {"model": "policy", "messages": [{"role": "user", "content": content}], "max_tokens": 4, **fields}


def post(server, body: dict | bytes, path: str = CHAT, **kw) -> httpx.Response:
    if isinstance(body, dict):
        return httpx.post(server.url + path, json=body, timeout=60, **kw)
    return httpx.post(server.url + path, content=body, headers={"content-type": "application/json"}, timeout=60, **kw)


def raw_json(body: dict) -> bytes:
    """JSON as a hostile client writes it: lone surrogates stay escaped (httpx would refuse to encode them)."""
    return json.dumps(body, ensure_ascii=True).encode()


@pytest.mark.parametrize("fields", [{"top_p": 1e-300}, {"temperature": 1e-39}, {"temperature": 5e-5, "seed": 1}])
def test_sampling_parameters_that_round_to_zero_are_served_greedily(live_server, fields):
    server = live_server()
    greedy = post(server, chat(temperature=0))
    r = post(server, chat(**{"temperature": 1.0, **fields}))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"] == greedy.json()["choices"][0]["message"]


@pytest.mark.parametrize("seed", [2**64, 2**63, -(2**63) - 1])
def test_a_seed_beyond_int64_is_a_400_naming_seed(live_server, seed):
    server = live_server()
    r = post(server, chat(seed=seed))
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("seed")
    assert post(server, chat(seed=2**63 - 1, n=2)).status_code == 200  # the edge itself, and seed + 1


@pytest.mark.parametrize("body", [chat("bad \ud800 text"), {**chat(), "stop": ["\udfff"]},
                                  {"model": "policy", "prompt": "x\ud800", "max_tokens": 2}])
def test_text_that_cannot_be_encoded_is_a_400_naming_where(live_server, body):
    server = live_server()
    path = "/v1/completions" if "prompt" in body else CHAT
    r = post(server, raw_json(body), path)
    assert r.status_code == 400, r.text
    assert "cannot be encoded" in r.json()["error"]["message"]
    assert post(server, chat()).status_code == 200  # the connection and the server are fine


def test_a_body_over_max_request_bytes_is_refused_413_declared_or_chunked(live_server):
    server = live_server(server__max_request_bytes=20_000)
    big = raw_json(chat("x" * 30_000))
    r = post(server, big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():
        for i in range(0, len(big), 4096):
            yield big[i : i + 4096]

    r = httpx.post(server.url + CHAT, content=chunks(), headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and "max_request_bytes" in r.json()["error"]["message"]
    assert post(server, chat("x" * 1000)).status_code == 200  # under the limit: served


def test_a_prompt_its_bytes_prove_too_long_is_refused_before_tokenizing(live_server, monkeypatch):
    server = live_server()
    renderer = server.policies["policy"].renderer
    encoded: list[int] = []
    real = renderer.encode
    monkeypatch.setattr(renderer, "encode", lambda text: encoded.append(len(text)) or real(text))
    huge = "word " * (renderer.max_token_bytes * 2048 // 5 + 100)
    for path, body in ((CHAT, chat(huge)), ("/v1/completions", {"model": "policy", "prompt": huge})):
        r = post(server, body, path)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert "at least" in r.json()["error"]["message"]
    assert encoded == []  # refused from the byte length alone


def test_rendering_runs_off_the_event_loop(live_server, monkeypatch):
    server = live_server()
    renderer = server.policies["policy"].renderer
    real = renderer.render
    rendering, release = threading.Event(), threading.Event()

    def held(*args, **kw):  # a 12 MB message's worth of tokenizing, held until /status has answered
        rendering.set()
        release.wait(60)
        return real(*args, **kw)

    monkeypatch.setattr(renderer, "render", held)
    slow_call = threading.Thread(target=post, args=(server, chat()))
    slow_call.start()
    try:
        assert rendering.wait(30)
        # On the event loop, the render would hold /status until release: this would time out.
        assert httpx.get(server.url + "/swarm/v1/status", timeout=10).status_code == 200
    finally:
        release.set()
        slow_call.join()


class _Silent(NullEngine):
    """An engine that never answers: a wedged worker, as the gateway sees it."""

    async def generate(self, prompt_ids, params, on_token=None):
        await asyncio.Event().wait()


def test_an_engine_that_never_answers_gets_a_504_within_request_timeout_s(live_server):
    model, tok = build_tiny()
    policy = Policy("policy", model, tok, ChatRenderer(tok), _Silent(tok, 2048))
    server = live_server(policies={"policy": policy}, server__request_timeout_s=0.5)
    started = time.perf_counter()
    r = post(server, chat())
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
    assert time.perf_counter() - started < 10
    stream = post(server, chat(stream=True))
    assert stream.status_code == 200 and "request_timeout_s" in stream.text  # reported in-stream


def test_bad_requests_mixed_into_a_healthy_batch_fail_only_themselves(live_server):
    server = live_server(server__max_request_bytes=50_000)
    healthy = [chat(f"healthy request {i}", seed=i, temperature=1.0) for i in range(8)]
    hostile = [
        chat(top_p=1e-300, temperature=1.0), chat(temperature=1e-39), raw_json(chat(seed=2**64)),
        raw_json(chat("lone \ud800")), raw_json(chat("x" * 60_000)), chat(max_tokens=100_000),
        chat(n=3, seed=2**63 - 1, top_p=1e-200), b"{not json", raw_json({"model": "policy", "messages": []}),
    ]
    mixed = [(True, b) for b in healthy] + [(False, b) for b in hostile]
    mixed = [mixed[i] for i in (0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15, 16)]
    results: list[tuple[bool, httpx.Response]] = []
    lock = threading.Lock()

    def send(ok: bool, body) -> None:
        r = post(server, body)
        with lock:
            results.append((ok, r))

    threads = [threading.Thread(target=send, args=m) for m in mixed]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == len(mixed)
    for ok, r in results:
        if ok:
            assert r.status_code == 200, r.text
        else:
            assert r.status_code < 500, r.text  # refused (4xx) or made harmless and served (200)
            assert r.status_code == 200 or set(r.json()["error"]) >= {"message", "type", "code"}
    assert sum(r.status_code == 200 for ok, r in results if not ok) == 3  # the clamped ones are served


class _Diverged(NullEngine):
    """An engine whose model diverged: every generation fails with the engine's own error."""

    async def generate(self, prompt_ids, params, on_token=None):
        raise GenerationError("the model's logits for this request are not finite (NaN)")


def test_a_request_the_engine_cannot_generate_gets_its_own_500_naming_why(live_server):
    model, tok = build_tiny()
    policy = Policy("policy", model, tok, ChatRenderer(tok), _Diverged(tok, 2048))
    server = live_server(policies={"policy": policy})
    r = post(server, chat())
    assert r.status_code == 500 and r.json()["error"]["code"] == "generation_failed"
    assert "not finite" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/v1/models").status_code == 200


def test_a_finish_with_a_reward_beyond_max_abs_reward_is_a_400_over_http(live_server):
    server = live_server()
    with SwarmClient(server.url).episode(task_id="t") as ep:
        with pytest.raises(SwarmError) as e:
            ep.finish(1e308)
        assert e.value.status == 400 and "max_abs_reward" in str(e.value)
        ep.finish(0.5)  # still open: a sane reward finishes it
    assert server.status()["episodes"]["finished"] == 1


@pytest.fixture(scope="module")
def hf_engine():
    model, tok = build_tiny()
    eng = HFEngine(model, tok, EngineConfig(), max_context=2048)
    yield eng
    eng.close()


tiny_or_any = st.floats(min_value=0.0, max_value=1.0, allow_subnormal=True) | st.sampled_from([1e-300, 5e-324, 1e-39, 1e-5])


@given(temperature=tiny_or_any.map(lambda t: 2 * t), top_p=tiny_or_any.filter(lambda p: p > 0),
       seed=st.integers(SEED_MIN, SEED_MAX) | st.none())
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
def test_every_sampling_parameter_the_wire_accepts_generates_without_nan(hf_engine, temperature, top_p, seed):
    ids = hf_engine.tokenizer("any prompt", add_special_tokens=False)["input_ids"]
    params = SamplingParams(max_tokens=3, temperature=temperature, top_p=top_p, seed=seed)
    gen = asyncio.run(asyncio.wait_for(hf_engine.generate(ids, params), 60))
    assert gen.token_ids and all(math.isfinite(lp) for lp in gen.logprobs)


def test_a_stopping_server_cancels_a_stuck_request_after_shutdown_s(live_server):
    model, tok = build_tiny()
    policy = Policy("policy", model, tok, ChatRenderer(tok), _Silent(tok, 2048))
    server = live_server(policies={"policy": policy}, server__shutdown_s=1.0)
    stuck = threading.Thread(target=lambda: httpx.post(server.url + CHAT, json=chat(), timeout=120), daemon=True)
    stuck.start()
    time.sleep(0.5)
    started = time.perf_counter()
    server.request_exit()
    server._thread.join(timeout=30)
    assert not server._thread.is_alive() and time.perf_counter() - started < 6
