"""LoRA weight sync: the vLLM engine serves the trainer's adapter, and after an adapter change it
serves the new one (a new `LoRARequest` per version), matching the hf engine on the same PEFT model."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
import torch

from core.config import EngineConfig, LoraConfig, ModelConfig
from core.engine import SamplingParams
from core.engine.factory import make_engine
from core.engine.hf import HFEngine
from core.models import load, prepare_policy
from tests.vllm.conftest import chat_prompt
from tests.vllm.test_engine_parity import LOGPROB_TOLERANCE

LORA_CONTEXT = 512
ADAPTER_SCALE = 0.02  # lora_B starts at zero (a no-op adapter); this makes the adapter visibly matter


@pytest.fixture(scope="module")
def lora_engines():
    model, tok = load(ModelConfig(source="smollm2-135m"))
    policy = prepare_policy(model, LoraConfig(r=8, alpha=16))
    randomise_adapters(policy, seed=0)
    cfg = EngineConfig(max_batch=4)
    before = rng_states()
    vllm_engine = make_engine("vllm", policy, tok, cfg, LORA_CONTEXT)
    after = rng_states()
    hf_engine = HFEngine(policy, tok, cfg, LORA_CONTEXT)
    yield policy, tok, vllm_engine, hf_engine, (before, after)
    vllm_engine.close()
    hf_engine.close()


def rng_states() -> tuple:
    return torch.random.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()


def randomise_adapters(policy, seed: int) -> bool:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * ADAPTER_SCALE)
    return True


def greedy(engine, prompt):
    return asyncio.run(engine.generate(prompt, SamplingParams(max_tokens=10, temperature=0)))


def test_the_served_adapter_follows_the_trainers_adapter(lora_engines):
    policy, tok, vllm_engine, hf_engine, _ = lora_engines
    prompt = chat_prompt(tok, "Name a fruit.")
    first, first_hf = greedy(vllm_engine, prompt), greedy(hf_engine, prompt)
    assert first.token_ids == first_hf.token_ids
    assert first.logprobs == pytest.approx(first_hf.logprobs, abs=LOGPROB_TOLERANCE)
    with policy.disable_adapter():  # the base model alone: the adapter must make a difference
        base = greedy(hf_engine, prompt)
    assert first.logprobs != pytest.approx(base.logprobs, abs=10 * LOGPROB_TOLERANCE)

    version = vllm_engine.version
    assert vllm_engine.swap_weights(lambda: randomise_adapters(policy, seed=1))
    second, second_hf = greedy(vllm_engine, prompt), greedy(hf_engine, prompt)
    assert second.version == version + 1
    assert second.token_ids == second_hf.token_ids
    assert second.logprobs == pytest.approx(second_hf.logprobs, abs=LOGPROB_TOLERANCE)
    assert second.logprobs != pytest.approx(first.logprobs, abs=10 * LOGPROB_TOLERANCE)


def test_starting_vllm_leaves_the_runs_random_streams_alone(lora_engines):
    """vLLM's in-process worker seeds the global RNGs; a seeded run must not see its streams reset."""
    (torch_before, py_before, np_before), (torch_after, py_after, np_after) = lora_engines[-1]
    assert torch.equal(torch_before, torch_after)
    assert py_before == py_after
    assert np.array_equal(np_before, np_after)
