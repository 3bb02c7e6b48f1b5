"""The transformers engine: sampling controls, exact logprobs, batching that changes nothing, drain."""

from __future__ import annotations

import asyncio

import pytest
import torch

from core.config import EngineConfig
from core.engine import SamplingParams
from core.engine.hf import HFEngine
from core.models import build_tiny
from core.records import Call
from core.train.packing import pack, token_logprobs
from core.train.timelines import merge_calls


@pytest.fixture(scope="module")
def engine():
    model, tok = build_tiny()
    eng = HFEngine(model, tok, EngineConfig(), max_context=2048)
    yield eng
    eng.close()


def prompts(eng, n):
    return [eng.tokenizer(f"prompt number {i}", add_special_tokens=False)["input_ids"] for i in range(n)]


def test_seeded_sampling_is_identical_alone_or_batched(engine):
    ps = prompts(engine, 8)
    params = [SamplingParams(max_tokens=12, temperature=1.0, seed=i) for i in range(8)]

    async def go():
        alone = [await engine.generate(p, sp) for p, sp in zip(ps, params)]
        together = await asyncio.gather(*(engine.generate(p, sp) for p, sp in zip(ps, params)))
        return alone, together

    alone, together = asyncio.run(go())
    assert [g.token_ids for g in alone] == [g.token_ids for g in together]


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.3])
def test_logprobs_are_of_the_tempered_distribution_that_sampled_the_ids(engine, temperature):
    p = prompts(engine, 1)[0]
    gen = asyncio.run(engine.generate(p, SamplingParams(max_tokens=10, temperature=temperature, seed=3)))
    with torch.no_grad():
        logits = engine.model(torch.tensor([p + gen.token_ids])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, -1)
    expected = [float(logp[len(p) - 1 + k, t]) for k, t in enumerate(gen.token_ids)]
    assert gen.logprobs == pytest.approx(expected, abs=1e-4)
    assert gen.temperature == temperature


def test_greedy_calls_are_scored_at_temperature_one(engine):
    p = prompts(engine, 1)[0]
    gen = asyncio.run(engine.generate(p, SamplingParams(max_tokens=6, temperature=0)))
    with torch.no_grad():
        logp = torch.log_softmax(engine.model(torch.tensor([p + gen.token_ids])).logits[0].float(), -1)
    assert gen.temperature == 1.0
    assert gen.logprobs == pytest.approx([float(logp[len(p) - 1 + k, t]) for k, t in enumerate(gen.token_ids)], abs=1e-4)


@pytest.mark.parametrize("top_p", [0.3, 0.9])
def test_a_greedy_call_with_top_p_records_the_logprob_the_trainer_computes(engine, top_p):
    # Greedy drops top_p (as vLLM does): the call records top_p 1, and the trainer scores the whole
    # distribution at T = 1, as the engine did. Recording the asked top_p made the trainer score
    # within the nucleus instead: a ratio far from 1 (1.87 measured) on a call that is on-policy.
    p = prompts(engine, 1)[0]
    gen = asyncio.run(engine.generate(p, SamplingParams(max_tokens=8, temperature=0.0, top_p=top_p)))
    assert gen.top_p == 1.0 and gen.temperature == 1.0
    call = Call(model="policy", version=gen.version, prompt_ids=p, completion_ids=gen.token_ids,
                completion_logprobs=gen.logprobs, temperature=gen.temperature, top_p=gen.top_p)
    with torch.no_grad():
        (mb,) = pack(merge_calls([call], "none"), token_budget=4096)
        logp, _ = token_logprobs(engine.model, mb)
    assert torch.allclose(logp[mb.loss_mask], mb.old_logprobs[mb.loss_mask], atol=1e-4)
    as_asked = Call(**{**call.model_dump(), "top_p": top_p})  # what the engine used to record
    with torch.no_grad():
        (mb,) = pack(merge_calls([as_asked], "none"), token_budget=4096)
        nucleus_logp, _ = token_logprobs(engine.model, mb)
    assert float((nucleus_logp - mb.old_logprobs)[mb.loss_mask].max()) > 1e-3  # the check can fail


def test_temperature_zero_and_tiny_top_p_both_pick_the_most_likely_token(engine):
    p = prompts(engine, 1)[0]
    greedy = asyncio.run(engine.generate(p, SamplingParams(max_tokens=8, temperature=0)))
    nucleus = asyncio.run(engine.generate(p, SamplingParams(max_tokens=8, temperature=1.0, top_p=1e-6, seed=5)))
    assert greedy.token_ids == nucleus.token_ids
    assert nucleus.top_p == 1e-6 and greedy.top_p == 1.0  # recorded, so truncated calls can be told apart


def test_max_tokens_and_stop_strings_end_generation(engine):
    p = prompts(engine, 1)[0]
    gen = asyncio.run(engine.generate(p, SamplingParams(max_tokens=5, temperature=0)))
    assert len(gen.token_ids) <= 5
    if gen.finish_reason == "length":
        text = engine.tokenizer.decode(gen.token_ids[:3])
        stop = text[-1]
        stopped = asyncio.run(engine.generate(p, SamplingParams(max_tokens=5, temperature=0, stop=(stop,))))
        assert stopped.finish_reason == "stop" and stopped.stop_string == stop
        assert len(stopped.token_ids) <= 3


def test_pause_drains_in_flight_work_and_holds_new_requests(engine):
    ps = prompts(engine, 2)

    async def go():
        decoding = asyncio.Event()  # in flight means decoding: a request still queued is held, not drained
        first = asyncio.ensure_future(engine.generate(ps[0], SamplingParams(max_tokens=40, temperature=1.0, seed=1),
                                                      on_token=lambda _: decoding.set()))
        await decoding.wait()
        await engine.pause()
        assert first.done()  # pause returned only after the in-flight generation finished
        held = asyncio.ensure_future(engine.generate(ps[1], SamplingParams(max_tokens=4, temperature=0)))
        await asyncio.sleep(0.2)
        assert not held.done()  # queued while paused: latency, not an error
        engine.resume(new_version=engine.version + 1)
        gen = await held
        return gen

    version = engine.version
    gen = asyncio.run(go())
    assert gen.version == version + 1
