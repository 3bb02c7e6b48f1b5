"""vLLM's side of runs that repeat and of greedy calls: a seed per request only when a run asks for
repeatable sampling (vLLM's batched sampler otherwise), each keyed request's tokens whatever order the
requests arrive in, and a greedy call with top_p recording the logprob the trainer computes."""

from __future__ import annotations

import asyncio
from contextlib import contextmanager

import torch

from core.engine import SamplingParams
from core.engine.worker import Request, derive_seed
from core.records import Call
from core.train.packing import pack, token_logprobs
from core.train.timelines import merge_calls
from tests.vllm.conftest import chat_prompt
from tests.vllm.test_engine_parity import LOGPROB_TOLERANCE


@contextmanager
def repeatable(engine):
    """The session engine as a run with `engine.repeatable_sampling: true` builds it (the flag it reads)."""
    engine.repeatable = True
    try:
        yield engine
    finally:
        engine.repeatable = False


def vllm_seed(engine, params: SamplingParams):
    return engine._sampling(Request([1, 2, 3], params, future=None, loop=None)).seed


def test_vllm_gets_a_seed_per_request_only_when_the_run_asks_for_repeatable_sampling(engines):
    vllm_engine, _ = engines
    keyed = SamplingParams(max_tokens=4, key="letters/t/0/0/0")
    assert vllm_seed(vllm_engine, keyed) is None  # the fast path: vLLM's batched sampler
    assert vllm_seed(vllm_engine, SamplingParams(max_tokens=4, seed=7)) == 7  # a request's own seed is kept
    with repeatable(vllm_engine):
        assert vllm_seed(vllm_engine, keyed) == derive_seed(vllm_engine.seed, keyed.key)


def test_repeatable_sampling_gives_each_keyed_request_its_tokens_whatever_the_arrival_order(engines, smollm2):
    vllm_engine, _ = engines
    _, tok = smollm2
    prompt = chat_prompt(tok, "Tell me about cats.")
    keys = [f"bench/task/{i}/0/0" for i in range(6)]

    async def go(order):
        gens = await asyncio.gather(*(vllm_engine.generate(prompt, SamplingParams(max_tokens=12, temperature=1.0,
                                                                                  key=k)) for k in order))
        return {k: g.token_ids for k, g in zip(order, gens)}

    with repeatable(vllm_engine):
        forward, backward = asyncio.run(go(keys)), asyncio.run(go(keys[::-1]))
    assert forward == backward
    assert len({tuple(v) for v in forward.values()}) > 1  # each key its own draw


def test_a_greedy_call_with_top_p_records_the_logprob_the_trainer_computes(engines, smollm2):
    vllm_engine, _ = engines
    model, tok = smollm2
    prompt = chat_prompt(tok, "Tell me about cats.")
    gen = asyncio.run(vllm_engine.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0, top_p=0.5)))
    assert gen.top_p == 1.0 and gen.temperature == 1.0  # greedy drops top_p, as the hf engine does
    call = Call(model="policy", version=gen.version, prompt_ids=prompt, completion_ids=gen.token_ids,
                completion_logprobs=gen.logprobs, temperature=gen.temperature, top_p=gen.top_p)
    (mb,) = pack(merge_calls([call], "none"), token_budget=4096)
    with torch.no_grad():
        logp, _ = token_logprobs(model, mb)
    ratio = torch.exp(logp - mb.old_logprobs)[mb.loss_mask]
    assert ratio.numel() == len(gen.token_ids) > 0
    assert float((ratio - 1).abs().max()) < LOGPROB_TOLERANCE
