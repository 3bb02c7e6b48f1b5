"""Behaviour logprobs match sampling: before any update, the PPO ratio of engine-recorded tokens is 1
at any temperature, on merged (linear) and tree-packed samples alike."""

from __future__ import annotations

import asyncio

import pytest
import torch

from core.config import EngineConfig
from core.engine import SamplingParams
from core.engine.hf import HFEngine
from core.models import build_tiny
from core.records import Call
from core.train.prompt_sharing import share_prompt
from core.train.timelines import merge_calls
from core.train.packing import pack, token_logprobs


@pytest.fixture(scope="module")
def episode_calls():
    """A real two-turn episode sampled at T = 0.7 (the second turn extends the first), plus a retry of
    the first turn at T = 1.3 (a branch), all recorded from the HF engine."""
    model, tok = build_tiny()
    model.eval()
    engine = HFEngine(model, tok, EngineConfig(), max_context=2048)
    first = tok("user: name a colour\nassistant:", add_special_tokens=False)["input_ids"]
    suffix = tok("\nuser: another one\nassistant:", add_special_tokens=False)["input_ids"]

    def call(prompt: list[int], params: SamplingParams) -> Call:
        gen = asyncio.run(engine.generate(prompt, params))
        return Call(model="policy", version=gen.version, prompt_ids=prompt, completion_ids=gen.token_ids,
                    completion_logprobs=gen.logprobs, temperature=gen.temperature, top_p=gen.top_p)

    try:
        turn1 = call(first, SamplingParams(max_tokens=12, temperature=0.7, seed=1))
        context = turn1.prompt_ids + turn1.completion_ids + suffix
        turn2 = call(context, SamplingParams(max_tokens=12, temperature=0.7, seed=2))
        retry = call(first, SamplingParams(max_tokens=12, temperature=1.3, seed=3))
    finally:
        engine.close()
    return model, [turn1, turn2, retry]


def ratios(model, samples) -> torch.Tensor:
    out = []
    with torch.no_grad():
        for mb in pack(samples, token_budget=4096):
            logp, _ = token_logprobs(model, mb)
            out.append(torch.exp(logp - mb.old_logprobs)[mb.loss_mask])
    return torch.cat(out)


@pytest.mark.parametrize("mode", ["none", "linear", "tree"])
def test_ppo_ratio_before_any_update_is_one_at_temperature_0_7(episode_calls, mode):
    model, calls = episode_calls
    samples = merge_calls(calls, mode)
    if mode != "none":
        assert sum(len(s.input_ids) for s in samples) < sum(len(c.prompt_ids) + len(c.completion_ids) for c in calls)
    r = ratios(model, samples)
    assert r.numel() == sum(len(c.completion_ids) for c in calls)
    assert float((r - 1).abs().max()) < 1e-4


@pytest.mark.parametrize("mode", ["none", "linear", "tree"])
def test_ppo_ratio_is_one_when_a_groups_shared_prompt_is_held_once(episode_calls, mode):
    # The three calls start with the same prompt, like the episodes of one group.
    model, calls = episode_calls
    samples = merge_calls(calls, mode)
    shared = share_prompt(samples, max_tokens=4096)
    assert len(shared) == 1 and shared[0].parents is not None
    r = ratios(model, shared)
    assert r.numel() == sum(len(c.completion_ids) for c in calls)
    assert float((r - 1).abs().max()) < 1e-4


def test_scoring_at_temperature_one_would_be_off_policy(episode_calls):
    """The check above can fail: drop the recorded temperatures and the ratio moves away from 1."""
    model, calls = episode_calls
    samples = merge_calls(calls, "tree")
    for s in samples:
        s.temperatures = None
    assert float((ratios(model, samples) - 1).abs().max()) > 1e-2


def test_a_call_with_a_non_positive_temperature_is_refused(episode_calls):
    _, calls = episode_calls
    bad = calls[0].model_copy(update={"temperature": 0.0})
    with pytest.raises(ValueError, match="temperature"):
        merge_calls([bad], "linear")


@pytest.fixture(scope="module")
def nucleus_calls():
    """Two calls sampled at top_p 0.9 (T = 0.7 and 1.0), recorded from the HF engine."""
    model, tok = build_tiny()
    model.eval()
    engine = HFEngine(model, tok, EngineConfig(), max_context=2048)
    prompt = tok("user: name a colour\nassistant:", add_special_tokens=False)["input_ids"]
    calls = []
    try:
        for seed, temperature in ((4, 0.7), (5, 1.0)):
            gen = asyncio.run(engine.generate(prompt, SamplingParams(max_tokens=12, temperature=temperature,
                                                                     top_p=0.9, seed=seed)))
            calls.append(Call(model="policy", version=gen.version, prompt_ids=prompt, completion_ids=gen.token_ids,
                              completion_logprobs=gen.logprobs, temperature=gen.temperature, top_p=gen.top_p))
    finally:
        engine.close()
    return model, calls


@pytest.mark.parametrize("mode", ["none", "linear", "tree"])
def test_ppo_ratio_before_any_update_is_one_at_top_p_0_9(nucleus_calls, mode):
    model, calls = nucleus_calls
    assert all(c.top_p == 0.9 for c in calls)
    r = ratios(model, merge_calls(calls, mode))
    assert r.numel() >= sum(len(c.completion_ids) for c in calls) - 2  # a shared first token may merge
    assert float((r - 1).abs().max()) < 1e-4


def test_scoring_the_full_distribution_of_a_nucleus_sample_would_be_off_policy(nucleus_calls):
    """The check above can fail: score without the nucleus and the ratio is the kept mass, below 1."""
    model, calls = nucleus_calls
    samples = merge_calls(calls, "none")
    for s in samples:
        s.top_ps = None
    assert float(ratios(model, samples).min()) < 0.99
