"""The engine never hangs: bad requests fail alone, `max_batch` caps rows, late joiners change nothing,
and weights swapped between decode steps leave running rows going."""

from __future__ import annotations

import asyncio
import queue
import threading
import time

import pytest
import torch

from core.config import EngineConfig
from core.engine import GenerationError, SamplingParams
from core.engine.batch_cache import MIN_COLUMNS
from core.engine.hf import HFEngine
from core.models import build_tiny


@pytest.fixture(scope="module")
def tiny():
    return build_tiny()


@pytest.fixture
def make_engine(tiny):
    engines = []

    def make(**cfg) -> HFEngine:
        model, tok = tiny
        eng = HFEngine(model, tok, EngineConfig(**cfg), max_context=2048)
        engines.append(eng)
        return eng

    yield make
    for eng in engines:
        eng.close()


def prompt(eng: HFEngine, i: int) -> list[int]:
    return eng.tokenizer(f"prompt number {i} says", add_special_tokens=False)["input_ids"]


async def after_tokens(eng: HFEngine, ids: list[int], params: SamplingParams, n: int):
    """Start a generation and return (its task, once it has sampled `n` tokens)."""
    seen = asyncio.Event()
    count = 0

    def on_token(_: int) -> None:
        nonlocal count
        count += 1
        if count >= n:
            seen.set()

    task = asyncio.ensure_future(eng.generate(ids, params, on_token=on_token))
    await seen.wait()
    return task


def test_a_bad_request_fails_alone_and_rows_already_decoding_continue(make_engine):
    eng = make_engine()
    long = SamplingParams(max_tokens=30, temperature=1.0, seed=7)
    short = SamplingParams(max_tokens=6, temperature=0)
    out_of_vocab = prompt(eng, 1) + [len(eng.tokenizer) + 1000]

    async def go():
        alone = await eng.generate(prompt(eng, 0), long)
        running = await after_tokens(eng, prompt(eng, 0), long, 3)
        results = await asyncio.gather(eng.generate(out_of_vocab, short), eng.generate(prompt(eng, 2), short),
                                       return_exceptions=True)
        return alone, await running, results

    alone, running, (bad, good) = asyncio.run(go())
    assert isinstance(bad, Exception)  # its own error, delivered: the caller does not hang
    assert not isinstance(good, Exception) and good.token_ids
    assert running.token_ids == alone.token_ids and len(running.token_ids) == 30
    after = asyncio.run(eng.generate(prompt(eng, 3), short))
    assert after.token_ids


def test_rows_retiring_one_by_one_after_the_cache_has_grown_each_yield_what_they_would_alone(make_engine):
    # Decode grows the batch cache past its first capacity (MIN_COLUMNS), then the rows finish at different
    # steps: each retirement moves survivors inside buffers the decode step allocated. (A README client
    # found this failing every batch with "Inplace update to inference tensor outside InferenceMode".)
    eng = make_engine()
    eng.eos_ids = ()  # each row runs to its own max_tokens, whatever the random model samples
    params = [SamplingParams(max_tokens=MIN_COLUMNS + 6 + 20 * i, temperature=1.0, seed=i) for i in range(3)]

    async def go():
        alone = [await eng.generate(prompt(eng, i), p) for i, p in enumerate(params)]
        together = await asyncio.gather(*(eng.generate(prompt(eng, i), p) for i, p in enumerate(params)))
        return alone, together

    alone, together = asyncio.run(go())
    assert [len(g.token_ids) for g in together] == [p.max_tokens for p in params]
    assert [g.token_ids for g in together] == [g.token_ids for g in alone]
    assert asyncio.run(eng.generate(prompt(eng, 0), params[0])).token_ids == alone[0].token_ids  # and serves on


def test_an_empty_prompt_is_refused_with_a_clear_error(make_engine):
    eng = make_engine()
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        asyncio.run(eng.generate([], SamplingParams(max_tokens=4)))


def test_max_batch_caps_the_active_rows_and_every_request_completes(make_engine):
    eng = make_engine(max_batch=2)
    params = [SamplingParams(max_tokens=8, temperature=1.0, seed=i) for i in range(6)]

    async def go():
        alone = [await eng.generate(prompt(eng, i), p) for i, p in enumerate(params)]
        eng.stats["max_rows"] = 0
        together = await asyncio.gather(*(eng.generate(prompt(eng, i), p) for i, p in enumerate(params)))
        return alone, together

    alone, together = asyncio.run(go())
    assert eng.stats["max_rows"] == 2  # batched, and never more than the cap
    assert [g.token_ids for g in together] == [g.token_ids for g in alone]


@pytest.mark.parametrize("late", [SamplingParams(max_tokens=12, temperature=0),
                                  SamplingParams(max_tokens=12, temperature=0.8, seed=11)],
                         ids=["greedy", "seeded"])
def test_a_request_joining_mid_decode_yields_what_it_would_alone(make_engine, late):
    eng = make_engine()
    early = SamplingParams(max_tokens=24, temperature=1.0, seed=3)
    # A longer prompt than the running row's, so the join left-pads the running KV cache, not only the new one.
    late_prompt = prompt(eng, 5) + prompt(eng, 6)

    async def go():
        early_alone = await eng.generate(prompt(eng, 4), early)
        late_alone = await eng.generate(late_prompt, late)
        running = await after_tokens(eng, prompt(eng, 4), early, 5)
        late_joined = await eng.generate(late_prompt, late)
        return early_alone, late_alone, await running, late_joined

    early_alone, late_alone, early_joined, late_joined = asyncio.run(go())
    assert len(early_alone.token_ids) == 24  # still decoding when the late request joined at token 5
    assert late_joined.token_ids == late_alone.token_ids
    assert late_joined.logprobs == pytest.approx(late_alone.logprobs, abs=1e-4)
    assert early_joined.token_ids == early_alone.token_ids
    assert early_joined.logprobs == pytest.approx(early_alone.logprobs, abs=1e-4)


def test_a_group_sharing_a_prompt_is_prefilled_once_and_each_row_yields_what_it_would_alone(make_engine):
    # A long batch window: all five requests reach the engine's first prefill together.
    eng = make_engine(batch_window_ms=500)
    shared, other = prompt(eng, 7), prompt(eng, 8) + prompt(eng, 9)  # the other prompt is longer: left padding
    params = [SamplingParams(max_tokens=10, temperature=1.0, seed=s) for s in (1, 2, 3)] + [
        SamplingParams(max_tokens=10, temperature=0), SamplingParams(max_tokens=10, temperature=0.7, seed=4)]
    prompts = [shared, shared, shared, shared, other]
    widths: list[int] = []
    forward = eng.model.forward

    def counting(*args, **kw):
        widths.append(kw["input_ids"].shape[0])
        return forward(*args, **kw)

    async def go():
        alone = [await eng.generate(p, sp) for p, sp in zip(prompts, params)]
        eng.model.forward = counting
        together = await asyncio.gather(*(eng.generate(p, sp) for p, sp in zip(prompts, params)))
        return alone, together

    alone, together = asyncio.run(go())
    assert widths[0] == 2  # the first pass of the batch: one row per distinct prompt, not per request
    for a, t in zip(alone, together):
        assert t.token_ids == a.token_ids
        assert t.logprobs == pytest.approx(a.logprobs, abs=1e-4)
    assert len({tuple(t.token_ids) for t in together[:3]}) > 1  # same prompt, own seeds: own samples


def test_weights_swapped_mid_decode_keep_rows_going_and_report_the_oldest_version(make_engine, tiny):
    eng = make_engine()
    version = eng.version
    applied = []

    async def go():
        # 64 tokens: the swap must land while the row still decodes, also with the CPU shared (xdist workers).
        running = await after_tokens(eng, prompt(eng, 0), SamplingParams(max_tokens=64, temperature=1.0, seed=1), 2)
        def change() -> bool:
            applied.append(running.done())
            return True

        assert await asyncio.to_thread(eng.swap_weights, change)
        return await running

    gen = asyncio.run(go())
    assert applied == [False]  # the change ran while the row was still decoding
    assert len(gen.token_ids) > 2 and gen.version == version  # went on after the swap; prefilled by the old weights
    assert asyncio.run(eng.generate(prompt(eng, 1), SamplingParams(max_tokens=3))).version == version + 1


def test_a_failing_weight_change_reaches_the_trainer_and_leaves_the_version(make_engine):
    eng = make_engine()
    version = eng.version

    def broken() -> None:
        raise RuntimeError("optimizer blew up")

    with pytest.raises(RuntimeError, match="optimizer blew up"):
        eng.swap_weights(broken)
    assert eng.version == version
    assert not eng.swap_weights(lambda: False)  # a step that changed nothing keeps the version
    assert eng.version == version
    assert asyncio.run(eng.generate(prompt(eng, 2), SamplingParams(max_tokens=3))).token_ids


def test_a_top_p_or_temperature_that_rounds_to_zero_samples_the_top_token_and_running_rows_go_on(make_engine):
    eng = make_engine()
    long = SamplingParams(max_tokens=20, temperature=1.0, seed=3)
    greedy = SamplingParams(max_tokens=6, temperature=0)

    async def go():
        alone = await eng.generate(prompt(eng, 0), long)
        expected = await eng.generate(prompt(eng, 1), greedy)
        running = await after_tokens(eng, prompt(eng, 0), long, 3)
        tiny_p, tiny_t = await asyncio.wait_for(asyncio.gather(  # bounded: before the fix these hung
            eng.generate(prompt(eng, 1), SamplingParams(max_tokens=6, temperature=1.0, top_p=1e-300, seed=1)),
            eng.generate(prompt(eng, 1), SamplingParams(max_tokens=6, temperature=1e-39))), 60)
        return alone, expected, await running, tiny_p, tiny_t

    alone, expected, running, tiny_p, tiny_t = asyncio.run(go())
    assert tiny_p.token_ids == expected.token_ids and tiny_t.token_ids == expected.token_ids
    assert tiny_t.temperature == 1.0  # greedy: scored at T = 1, like T = 0
    assert all(lp == lp for lp in tiny_p.logprobs + tiny_t.logprobs)  # no NaN recorded
    assert running.token_ids == alone.token_ids


class _NaNOnMarker(torch.nn.Module):
    """The tiny model, except that any forward pass whose row holds `marker` returns NaN logits for that
    row: a diverged model as one request sees it."""

    def __init__(self, model, marker: int):
        super().__init__()
        self.inner, self.marker = model, marker
        self.config, self.generation_config = model.config, model.generation_config

    def forward(self, input_ids, **kw):
        out = self.inner(input_ids=input_ids, **kw)
        bad = (input_ids == self.marker).any(-1)
        out.logits[bad] = float("nan")
        return out


def test_nan_logits_fail_only_their_own_request_with_a_clear_error(tiny):
    model, tok = tiny
    marker = tok("zebra", add_special_tokens=False)["input_ids"][0]
    eng = HFEngine(_NaNOnMarker(model, marker), tok, EngineConfig(), max_context=2048)
    long = SamplingParams(max_tokens=20, temperature=1.0, seed=7)
    short = SamplingParams(max_tokens=6, temperature=0)
    try:
        async def go():
            alone = await eng.generate(prompt(eng, 0), long)
            running = await after_tokens(eng, prompt(eng, 0), long, 3)
            results = await asyncio.wait_for(asyncio.gather(eng.generate(prompt(eng, 1) + [marker], short),
                                                            eng.generate(prompt(eng, 2), short),
                                                            return_exceptions=True), 60)
            return alone, await running, results

        alone, running, (bad, good) = asyncio.run(go())
        assert isinstance(bad, GenerationError) and "not finite" in str(bad)
        assert not isinstance(good, BaseException) and good.token_ids
        assert running.token_ids == alone.token_ids
        assert asyncio.run(eng.generate(prompt(eng, 3), short)).token_ids  # the worker lives on
    finally:
        eng.close()


def test_after_hold_returns_nothing_is_admitted_until_resume_even_a_request_already_dequeued(make_engine):
    # The worker has just taken a request off the queue when the trainer holds the engine: a barrier
    # stops it right there, so the race is certain instead of a matter of timing.
    eng = make_engine()
    dequeued, go = threading.Event(), threading.Event()

    class BarrierQueue(queue.Queue):
        def get(self, *args, **kwargs):
            req = super().get(*args, **kwargs)
            if req is not None and not go.is_set():
                dequeued.set()
                go.wait(30)
            return req

    eng._queue = BarrierQueue()  # the next request reaches the worker through the barrier

    async def scenario():
        task = asyncio.ensure_future(eng.generate(prompt(eng, 0), SamplingParams(max_tokens=3, seed=0)))
        assert await asyncio.to_thread(dequeued.wait, 30)
        eng.hold()  # returns at once: no admission is under way, the worker is between dequeue and admit
        go.set()
        deadline = time.monotonic() + 30
        while not eng._held_back and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert eng._held_back and not task.done()  # held back, not decoding on the old weights
        eng.resume(new_version=7)
        return await asyncio.wait_for(task, 30)

    gen = asyncio.run(scenario())
    assert gen.version == 7 and len(gen.token_ids) >= 1
