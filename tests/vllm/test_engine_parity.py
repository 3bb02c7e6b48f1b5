"""The vLLM engine generates what the hf engine generates: same greedy ids, same logprobs, same stops."""

from __future__ import annotations

import asyncio

import pytest
import torch

from core.engine import SamplingParams
from core.records import Call
from core.train.packing import pack, token_logprobs
from core.train.timelines import merge_calls
from tests.vllm.conftest import chat_prompt

# fp32 on CPU: vLLM's fused kernels (paged attention, fused RMSNorm, SiLU-and-mul) sum in another
# order than transformers; measured differences stay below 1e-3 nats per token.
LOGPROB_TOLERANCE = 2e-3
PROMPTS = ["Name a fruit.", "What is the capital of France?", "Write a haiku about rain.", "Count to five."]


def test_greedy_generation_gives_the_hf_engines_token_ids(engines, smollm2):
    vllm_engine, hf_engine = engines
    _, tok = smollm2
    params = SamplingParams(max_tokens=24, temperature=0)

    async def go():
        prompts = [chat_prompt(tok, p) for p in PROMPTS]
        return (await asyncio.gather(*(vllm_engine.generate(p, params) for p in prompts)),
                await asyncio.gather(*(hf_engine.generate(p, params) for p in prompts)))

    from_vllm, from_hf = asyncio.run(go())
    assert [g.token_ids for g in from_vllm] == [g.token_ids for g in from_hf]
    assert [g.finish_reason for g in from_vllm] == [g.finish_reason for g in from_hf]
    for v, h in zip(from_vllm, from_hf):
        assert v.logprobs == pytest.approx(h.logprobs, abs=LOGPROB_TOLERANCE)
        assert v.temperature == h.temperature == 1.0  # greedy calls are scored at temperature 1


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.3])
def test_sampled_logprobs_are_of_the_tempered_distribution(engines, smollm2, temperature):
    vllm_engine, _ = engines
    model, tok = smollm2
    prompt = chat_prompt(tok, "Tell me about cats.")
    gen = asyncio.run(vllm_engine.generate(prompt, SamplingParams(max_tokens=16, temperature=temperature, seed=5)))
    with torch.no_grad():
        logits = model(torch.tensor([prompt + gen.token_ids])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, -1)
    expected = [float(logp[len(prompt) - 1 + k, t]) for k, t in enumerate(gen.token_ids)]
    assert len(gen.token_ids) == len(gen.logprobs) > 0
    assert gen.logprobs == pytest.approx(expected, abs=LOGPROB_TOLERANCE)
    assert gen.temperature == temperature


def test_the_trainer_scores_a_top_p_sample_as_vllm_recorded_it(engines, smollm2):
    # vLLM records the nucleus-renormalised logprob; the trainer scores a top_p call within the same
    # nucleus, so before any update the PPO ratio is 1 (to vLLM's kernel tolerance, not the kept mass).
    vllm_engine, _ = engines
    model, tok = smollm2
    prompt = chat_prompt(tok, "Tell me about cats.")
    gen = asyncio.run(vllm_engine.generate(prompt, SamplingParams(max_tokens=16, temperature=0.7, top_p=0.9, seed=6)))
    call = Call(model="policy", version=gen.version, prompt_ids=prompt, completion_ids=gen.token_ids,
                completion_logprobs=gen.logprobs, temperature=gen.temperature, top_p=gen.top_p)
    (mb,) = pack(merge_calls([call], "none"), token_budget=4096)
    with torch.no_grad():
        logp, _ = token_logprobs(model, mb)
    ratio = torch.exp(logp - mb.old_logprobs)[mb.loss_mask]
    assert gen.top_p == 0.9 and ratio.numel() == len(gen.token_ids) > 0
    assert float((ratio - 1).abs().max()) < LOGPROB_TOLERANCE


def test_seeded_sampling_is_the_same_alone_or_among_concurrent_requests(engines, smollm2):
    vllm_engine, _ = engines
    _, tok = smollm2
    prompts = [chat_prompt(tok, f"Say something about the number {i}.") for i in range(8)]
    params = [SamplingParams(max_tokens=12, temperature=1.0, seed=i) for i in range(8)]

    async def go():
        alone = [await vllm_engine.generate(p, sp) for p, sp in zip(prompts, params)]
        together = await asyncio.gather(*(vllm_engine.generate(p, sp) for p, sp in zip(prompts, params)))
        return alone, together

    before = vllm_engine.stats["max_rows"]
    alone, together = asyncio.run(go())
    assert [g.token_ids for g in alone] == [g.token_ids for g in together]
    assert vllm_engine.stats["max_rows"] > max(before, 1)  # the concurrent ones ran in one batch


def test_a_stop_string_ends_generation_like_the_hf_engine(engines, smollm2):
    vllm_engine, hf_engine = engines
    _, tok = smollm2
    prompt = chat_prompt(tok, "Write a haiku about rain.")
    free = asyncio.run(hf_engine.generate(prompt, SamplingParams(max_tokens=24, temperature=0)))
    stop = tok.decode(free.token_ids).split()[3]  # the fourth word of the free-running reply
    params = SamplingParams(max_tokens=24, temperature=0, stop=(stop,))

    async def go():
        return await vllm_engine.generate(prompt, params), await hf_engine.generate(prompt, params)

    v, h = asyncio.run(go())
    assert v.finish_reason == h.finish_reason == "stop"
    assert v.stop_string == h.stop_string == stop
    assert v.token_ids == h.token_ids
    assert len(v.token_ids) < len(free.token_ids)


def test_streaming_sees_every_token_in_order(engines, smollm2):
    vllm_engine, _ = engines
    _, tok = smollm2
    seen: list[int] = []

    async def go():
        return await vllm_engine.generate(chat_prompt(tok, "Name a colour."), SamplingParams(max_tokens=10, temperature=0),
                                          on_token=seen.append)

    gen = asyncio.run(go())
    assert seen == gen.token_ids
