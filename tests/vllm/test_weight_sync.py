"""Weights follow the trainer without restarting vLLM: after a change to the trainer's module, the
same prompt gets new logprobs, and they are the hf engine's under the same new weights."""

from __future__ import annotations

import asyncio

import pytest
import torch

from core.engine import SamplingParams
from tests.vllm.conftest import chat_prompt
from tests.vllm.test_engine_parity import LOGPROB_TOLERANCE

CHANGE = 0.05  # relative noise on every weight: enough to move greedy logprobs far beyond the tolerance


def greedy(engine, prompt):
    return asyncio.run(engine.generate(prompt, SamplingParams(max_tokens=12, temperature=0)))


@pytest.fixture
def perturbed(smollm2):
    """A change the trainer would make in place, and the way back to the original weights."""
    model, _ = smollm2
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(0)

    def change() -> bool:
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * p.abs().mean() * CHANGE)
        return True

    def restore() -> bool:
        model.load_state_dict(saved)
        return True

    return change, restore


def test_swap_weights_streams_the_new_weights_into_vllm(engines, smollm2, perturbed):
    vllm_engine, hf_engine = engines
    _, tok = smollm2
    change, restore = perturbed
    prompt = chat_prompt(tok, "Name an animal.")
    before = greedy(vllm_engine, prompt)
    version = vllm_engine.version
    try:
        assert vllm_engine.swap_weights(change)
        assert vllm_engine.version == version + 1
        after, reference = greedy(vllm_engine, prompt), greedy(hf_engine, prompt)
    finally:
        vllm_engine.swap_weights(restore)
    assert after.version == version + 1
    assert after.token_ids == reference.token_ids
    assert after.logprobs == pytest.approx(reference.logprobs, abs=LOGPROB_TOLERANCE)
    shared = min(len(before.logprobs), len(after.logprobs))
    assert max(abs(a - b) for a, b in zip(before.logprobs[:shared], after.logprobs[:shared])) > 10 * LOGPROB_TOLERANCE
    restored = greedy(vllm_engine, prompt)
    assert restored.token_ids == before.token_ids
    assert restored.logprobs == pytest.approx(before.logprobs, abs=LOGPROB_TOLERANCE)


def test_pause_then_resume_with_a_new_version_syncs_the_weights(engines, smollm2, perturbed):
    vllm_engine, hf_engine = engines
    _, tok = smollm2
    change, restore = perturbed
    prompt = chat_prompt(tok, "Name a planet.")
    before = greedy(vllm_engine, prompt)
    try:
        vllm_engine.hold()
        vllm_engine.pause_blocking()  # drained: the trainer steps now
        with torch.no_grad():
            change()
        vllm_engine.resume(vllm_engine.version + 1)
        after, reference = greedy(vllm_engine, prompt), greedy(hf_engine, prompt)
    finally:
        vllm_engine.swap_weights(restore)
    assert after.logprobs == pytest.approx(reference.logprobs, abs=LOGPROB_TOLERANCE)
    assert after.logprobs != pytest.approx(before.logprobs, abs=10 * LOGPROB_TOLERANCE)


def test_a_step_that_changed_nothing_keeps_the_version(engines, smollm2):
    vllm_engine, _ = engines
    _, tok = smollm2
    version = vllm_engine.version
    assert not vllm_engine.swap_weights(lambda: False)
    assert greedy(vllm_engine, chat_prompt(tok, "Hi.")).version == version
