"""A bad request to the vLLM engine gets its own error; the requests beside it and after it are served."""

from __future__ import annotations

import asyncio

import pytest

from core.engine import SamplingParams
from tests.vllm.conftest import MAX_CONTEXT, chat_prompt


def test_an_out_of_vocabulary_prompt_fails_alone_and_the_engine_keeps_serving(engines, smollm2):
    vllm_engine, _ = engines
    _, tok = smollm2
    good = chat_prompt(tok, "Name a fruit.")
    bad = good[:-1] + [len(tok) + 1000]
    params = SamplingParams(max_tokens=8, temperature=0)

    async def go():
        return await asyncio.gather(vllm_engine.generate(bad, params), vllm_engine.generate(good, params),
                                    return_exceptions=True)

    failed, served = asyncio.run(go())
    assert isinstance(failed, ValueError)
    assert not isinstance(served, BaseException) and served.token_ids
    after = asyncio.run(vllm_engine.generate(good, params))
    assert after.token_ids == served.token_ids


@pytest.mark.parametrize("prompt_len", [0, MAX_CONTEXT])
def test_an_empty_or_overlong_prompt_is_refused_up_front(engines, prompt_len):
    vllm_engine, _ = engines
    with pytest.raises(ValueError, match="prompt"):
        asyncio.run(vllm_engine.generate([1] * prompt_len, SamplingParams(max_tokens=4)))


def test_a_cancelled_request_frees_its_place_and_others_finish(engines, smollm2):
    vllm_engine, _ = engines
    _, tok = smollm2
    prompt = chat_prompt(tok, "Write a long story about a dragon.")

    async def go():
        long = asyncio.ensure_future(vllm_engine.generate(prompt, SamplingParams(max_tokens=200, temperature=1.0, seed=1)))
        short = asyncio.ensure_future(vllm_engine.generate(prompt, SamplingParams(max_tokens=4, temperature=0)))
        done = await short
        long.cancel()
        with pytest.raises(asyncio.CancelledError):
            await long
        return done

    assert len(asyncio.run(go()).token_ids) == 4
    assert asyncio.run(vllm_engine.generate(prompt, SamplingParams(max_tokens=3, temperature=0))).token_ids


def test_a_failing_weight_change_raises_to_the_trainer_and_keeps_the_version(engines, smollm2):
    vllm_engine, _ = engines
    _, tok = smollm2
    version = vllm_engine.version

    def broken() -> bool:
        raise RuntimeError("optimizer blew up")

    with pytest.raises(RuntimeError, match="optimizer blew up"):
        vllm_engine.swap_weights(broken)
    assert vllm_engine.version == version
    assert asyncio.run(vllm_engine.generate(chat_prompt(tok, "Hi."), SamplingParams(max_tokens=3))).version == version
