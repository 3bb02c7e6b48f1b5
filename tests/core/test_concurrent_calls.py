"""A call's index in its episode is reserved before it is sampled: concurrent calls of one episode never share
a derived seed (`engine.repeatable_sampling`). Real server, the tiny model, real HTTP."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from core.clients.sdk import SwarmClient
from core.config_io import load_config
from core.serve.server import Server

ROOT = Path(__file__).resolve().parents[2]
# Sampled, long enough that two independent draws of the tiny model's near-uniform bytes never agree by chance.
BODY = {"model": "policy", "messages": [{"role": "user", "content": "count"}], "max_tokens": 24, "temperature": 1.0}


def test_two_concurrent_calls_in_one_episode_get_different_derived_seeds(tmp_path):
    cfg = load_config(ROOT / "configs" / "tiny.yaml", [f"trainer.checkpoint_dir={tmp_path}", "clients=[]",
                                                       "server.port=0", "engine.repeatable_sampling=true"])
    server = Server(cfg)
    server.start()
    try:
        with SwarmClient(server.url).episode(task_id="t", group_size=1) as ep:
            async def both() -> list[httpx.Response]:
                async with httpx.AsyncClient(base_url=server.url, timeout=120,
                                             headers={"Authorization": f"Bearer {ep.api_key}"}) as http:
                    return await asyncio.gather(*(http.post("/v1/chat/completions", json=BODY) for _ in range(2)))

            replies = asyncio.run(both())
            assert [r.status_code for r in replies] == [200, 200], [r.text for r in replies]
            calls = server.registry._open[ep.id].calls
            assert len(calls) == 2
            # Same prompt, same weights, same run seed: only the reserved call index tells the two draws apart.
            assert calls[0].completion_ids != calls[1].completion_ids
            ep.finish(0.0)
    finally:
        server.stop()
