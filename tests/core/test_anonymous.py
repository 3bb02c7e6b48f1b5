"""Anonymous use (no episode key) is decided by the mode: served when nothing trains, 401 while training."""

from __future__ import annotations

from pathlib import Path

import httpx

from core.clients.sdk import SwarmClient
from core.config_io import load_config
from core.run.loop import CoreRun
from core.serve.server import Server
from tests.support import credential

ROOT = Path(__file__).resolve().parents[2]
BODY = {"model": "policy", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}


def test_a_training_run_refuses_anonymous_calls_before_the_engine_even_with_allow_anonymous(tmp_path):
    cfg = load_config(ROOT / "configs" / "tiny.yaml", [f"trainer.checkpoint_dir={tmp_path}", "clients=[]",
                                                       "server.allow_anonymous=true"])
    core = CoreRun(cfg)  # what `swarm run` and `swarm serve CONFIG` (with its trainer) build
    core.server.start()
    try:
        for headers in ({}, {"Authorization": "Bearer EMPTY"}):
            r = httpx.post(core.server.url + "/v1/chat/completions", json=BODY, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert "trains" in r.json()["error"]["message"]
        assert core.server.throughput.calls == 0  # nothing reached the engine
        refused = httpx.post(core.server.url + "/swarm/v1/episodes", json={"task_id": "t"})  # nor anonymous opens
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "credential_required"
        grant = credential(core.server, group_size=1)  # what the run gives each client it launches
        with SwarmClient(core.server.url, credential=grant).episode(task_id="t", group_size=1) as ep:  # keyed calls
            assert ep.openai.chat.completions.create(model="policy", messages=BODY["messages"], max_tokens=2).choices
            ep.finish(0.0)
        assert core.server.throughput.calls == 1
    finally:
        core.server.stop()


def test_a_server_without_a_trainer_serves_anonymous_calls_unrecorded(tmp_path):
    cfg = load_config(ROOT / "configs" / "tiny.yaml", ["clients=[]", "engine.kind=instant"])
    server = Server(cfg)  # what `swarm serve` without training runs
    server.start()
    try:
        r = httpx.post(server.url + "/v1/chat/completions", json=BODY, headers={"Authorization": "Bearer EMPTY"})
        assert r.status_code == 200 and r.json()["choices"]
        assert server.throughput.calls == 1 and server.status()["episodes"]["calls"] == 0
    finally:
        server.stop()
