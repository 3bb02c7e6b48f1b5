"""Rollout replicas (core/engine/replicas.py) as 2 real engine processes of the tiny model.

Sticky least-loaded routing, weight sync reaching both replicas (checked on the weights they
generate with, not only on the version they report), a sync a replica cannot take failing loudly,
and a SIGKILLed replica: its episodes handed over for abort, its waiting call failed, the replica
restarted at the current version and routed to again.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import torch

from core import models
from core.config_io import load_config
from core.engine import SamplingParams
from core.engine.process import ReplicaLost
from core.engine.replicas import ReplicaBehind, ReplicaEngine, make_model_engine
from core.engine.routing import EPISODE

RESTART_WAIT_S = 180.0  # a restart spawns a process that imports torch: ~5 s quiet, far more on a loaded 2-core box
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def replicas():
    cfg = load_config({"models": [{"device": "cpu", "replicas": 2}], "trainer": {"max_staleness": 0}})
    model, tok = models.load(cfg.models[0])
    engine = make_model_engine(cfg, cfg.models[0], model, tok, 256)
    assert isinstance(engine, ReplicaEngine)
    lost: list[list[str]] = []
    engine.on_lost = lost.append
    yield engine, model, tok, lost
    engine.close()


async def _episode(engine, name: str, prompt: list[int], calls: int) -> list[float]:
    EPISODE.set(name)  # what the registry sets when a request's key resolves (core.engine.routing)
    return [(await engine.generate(prompt, GREEDY)).timings["replica"] for _ in range(calls)]


def test_an_episodes_calls_stay_on_one_replica_and_new_episodes_go_to_the_least_loaded(replicas):
    engine, _, tok, _ = replicas
    prompt = tok.encode("hello", add_special_tokens=False)

    async def main():
        return await asyncio.gather(*(_episode(engine, f"sticky-{i}", prompt, 3) for i in range(6)))

    served = asyncio.run(main())
    assert all(len(set(calls)) == 1 for calls in served), served
    per_replica = [sum(1 for calls in served if calls[0] == r) for r in (0.0, 1.0)]
    assert per_replica == [3, 3]  # six new episodes, each to the replica with fewer pinned
    assert {engine.replica_of(f"sticky-{i}") for i in range(6)} == {0, 1}


def _logprobs_under(model, prompt: list[int], gen) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + gen.token_ids])).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    return [logp[len(prompt) + i - 1, t].item() for i, t in enumerate(gen.token_ids)]


def test_after_a_sync_both_replicas_serve_the_new_version_with_the_new_weights(replicas):
    engine, model, tok, _ = replicas
    prompt = tok.encode("weights", add_special_tokens=False)
    with torch.no_grad():
        for p in model.parameters():  # what a trainer step does to the trainer's module
            p.add_(torch.randn_like(p) * 0.05)
    target = engine.version + 1
    engine.resume(target)
    assert [s["version"] for s in engine.status()] == [target, target]

    async def main():
        return await asyncio.gather(*(_episode(engine, f"synced-{i}", prompt, 1) for i in range(2)))

    asyncio.run(main())
    for i in range(2):
        EPISODE.set(f"synced-{i}")
        gen = asyncio.run(engine.generate(prompt, GREEDY))
        assert gen.version == target
        # The replica's recorded logprobs are those of the trainer's new weights: the weights arrived.
        assert gen.logprobs == pytest.approx(_logprobs_under(model, prompt, gen), abs=1e-4)


def test_a_sync_a_replica_cannot_take_fails_loudly_and_keeps_the_version(replicas):
    engine, model, _, _ = replicas
    before = engine.version
    model.register_parameter("not_in_replicas", torch.nn.Parameter(torch.zeros(2)))
    try:
        with pytest.raises(ReplicaBehind, match="did not reach every replica"):
            engine.resume(before + 1)
    finally:
        del model.not_in_replicas
    assert engine.version == before
    engine.resume(before + 1)  # the cause gone, the next sync goes through
    assert [s["version"] for s in engine.status()] == [before + 1] * 2


def test_a_killed_replica_aborts_its_episodes_fails_its_calls_and_comes_back_synced(replicas):
    engine, _, tok, lost = replicas
    prompt = tok.encode("chaos", add_special_tokens=False)
    asyncio.run(_episode(engine, "doomed", prompt, 1))
    victim = engine.replica_of("doomed")
    pid = engine.status()[victim]["pid"]
    os.kill(pid, signal.SIGKILL)

    async def next_call():
        EPISODE.set("doomed")
        return await engine.generate(prompt, GREEDY)

    with pytest.raises(ReplicaLost):
        asyncio.run(next_call())  # its replica is gone: the call fails, the episode never completes there
    deadline = time.monotonic() + 30
    while not any("doomed" in batch for batch in lost) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert any("doomed" in batch for batch in lost)
    assert engine.replica_of("doomed") is None
    deadline = time.monotonic() + RESTART_WAIT_S
    while time.monotonic() < deadline and not all(s["healthy"] for s in engine.status()):
        time.sleep(0.5)
    rows = engine.status()
    assert all(s["healthy"] for s in rows) and rows[victim]["pid"] != pid
    assert rows[victim]["version"] == engine.version and rows[victim]["restarts"] == 1

    async def spread():
        return await asyncio.gather(*(_episode(engine, f"after-{i}", prompt, 1) for i in range(4)))

    engine.is_open = lambda episode: episode.startswith("after-")  # the earlier episodes have ended
    assert {calls[0] for calls in asyncio.run(spread())} == {0.0, 1.0}  # the restarted one is routed to again


def test_an_overlapped_step_swaps_the_new_weights_into_both_replicas_between_decode_steps(replicas):
    engine, model, tok, _ = replicas
    prompt = tok.encode("overlap", add_special_tokens=False)
    before = engine.version

    def step() -> bool:  # what `trainer.apply` does inside the loop's swap: change the module in place
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.98)
        return True

    assert engine.swap_weights(step) is True
    assert engine.version == before + 1
    assert [s["version"] for s in engine.status()] == [before + 1] * 2
    EPISODE.set("overlap-check")
    gen = asyncio.run(engine.generate(prompt, GREEDY))
    assert gen.version == before + 1
    assert gen.logprobs == pytest.approx(_logprobs_under(model, prompt, gen), abs=1e-4)
    assert engine.swap_weights(lambda: False) is False and engine.version == before + 1  # no change, no version
