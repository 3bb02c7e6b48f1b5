"""Batched sampling on the model's device: greedy below the threshold, the nucleus always keeps the top
token, draws follow the distribution and never land outside it, and nothing is read back to the host."""

from __future__ import annotations

import math

import torch

from core.engine.sampling import inverse_cdf, sample_batch, top_p_filter

LARGEST_BELOW_ONE = 1.0 - 2.0 ** -24  # the largest float32 uniform torch.rand can return


def test_each_row_follows_its_own_temperature_top_p_and_draw():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]] * 4)
    temperatures = [0.0, 1.0, 1.0, 1e-39]  # greedy, plain, nucleus, greedy (rounds to 0)
    top_ps = [1.0, 1.0, 0.5, 1.0]
    uniforms = torch.tensor([0.99, 0.99, 0.99, 0.5])
    out = sample_batch(logits, temperatures, top_ps, uniforms)
    assert out.tokens.tolist() == [0, 3, 0, 0]  # the plain row's u = 0.99 lands in the last token's mass
    full = torch.log_softmax(logits[0], -1)
    assert out.logprobs[0] == full[0] and out.logprobs[1] == full[3]
    assert out.logprobs[2] == 0.0  # top_p 0.5 keeps only the top token (p = 0.64): probability 1 in its nucleus
    assert not out.broken.any()
    assert out.to_host() == [(0, float(full[0]), False), (3, float(full[3]), False), (0, 0.0, False),
                             (0, float(full[0]), False)]


def test_a_top_p_that_rounds_to_zero_keeps_the_top_token_and_nan_logits_are_flagged():
    logits = torch.tensor([[0.0, 3.0, 1.0], [float("nan"), 0.0, 0.0]])
    out = sample_batch(logits, [1.0, 1.0], [1e-300, 1.0], torch.tensor([0.7, 0.2]))
    assert out.tokens[0] == 1 and out.broken.tolist() == [False, True]


def test_a_zero_draw_never_picks_a_token_outside_the_nucleus():
    # Token 0 is the least likely: outside a 0.9 nucleus. The old strict `<` picked it for u = 0 and
    # recorded log 0 = -inf, which failed the whole step's merge.
    logits = torch.tensor([[-6.0, 3.0, 2.0, 1.0]])
    out = sample_batch(logits, [1.0], [0.9], torch.zeros(1))
    assert out.tokens.tolist() == [1]  # the first token the nucleus can draw
    assert math.isfinite(float(out.logprobs[0]))


def test_a_zero_draw_never_picks_a_token_of_zero_probability():
    logits = torch.tensor([[float("-inf"), float("-inf"), 0.5, 0.0]])
    out = sample_batch(logits, [1.0], [1.0], torch.zeros(1))
    assert out.tokens.tolist() == [2] and math.isfinite(float(out.logprobs[0]))


def test_a_draw_that_rounds_up_to_the_whole_mass_takes_the_last_drawable_token():
    probs = torch.tensor([[0.25, 0.75, 0.0, 0.0]])
    assert inverse_cdf(probs, torch.tensor([LARGEST_BELOW_ONE])).tolist() == [1]
    assert inverse_cdf(probs, torch.tensor([1.0])).tolist() == [1]  # even past the top: never a zero-mass token
    assert inverse_cdf(probs, torch.tensor([0.0])).tolist() == [0]


def test_greedy_rows_ignore_top_p_and_record_the_whole_distribution():
    logits = torch.tensor([[2.0, 1.9, -1.0]])
    out = sample_batch(logits, [0.0], [0.5], torch.tensor([0.3]))
    assert out.tokens.tolist() == [0]
    assert float(out.logprobs[0]) == float(torch.log_softmax(logits[0], -1)[0])  # not 0 (the nucleus' mass)


def test_sampling_reads_nothing_back_from_the_device():
    # On the meta device a tensor has no values: any host read inside (`.item()`, `bool(mask.any())`,
    # boolean-mask indexing) raises. The only read is the caller's `to_host`.
    logits = torch.empty((5, 11), device="meta")
    out = sample_batch(logits, [0.0, 1.0, 0.7, 1.0, 0.5], [1.0, 0.9, 1.0, 0.3, 0.8], torch.rand(5))
    assert out.tokens.device.type == out.logprobs.device.type == out.broken.device.type == "meta"
    assert out.tokens.shape == out.logprobs.shape == out.broken.shape == (5,)


def test_inverse_cdf_draws_match_the_tempered_distribution():
    logits = torch.tensor([[1.0, 0.0, -0.5, 0.3]])
    n = 20000
    u = torch.rand(n, generator=torch.Generator().manual_seed(0))
    out = sample_batch(logits.expand(n, -1), [0.7] * n, [1.0] * n, u)
    freq = torch.bincount(out.tokens, minlength=4).float() / n
    want = torch.softmax(logits[0] / 0.7, -1)
    assert torch.allclose(freq, want, atol=0.015)
    nucleus = top_p_filter(want[None], torch.tensor([0.8]))[0]
    assert math.isclose(float(nucleus.sum()), 1.0, rel_tol=1e-6) and (nucleus == 0).sum() >= 1
