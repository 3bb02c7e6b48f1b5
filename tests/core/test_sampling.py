"""Batched sampling on the model's device: greedy below the threshold, the nucleus always keeps the top token, draws follow the distribution."""

from __future__ import annotations

import math

import torch

from core.engine.sampling import sample_batch, top_p_filter


def test_each_row_follows_its_own_temperature_top_p_and_draw():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]] * 4)
    temperatures = torch.tensor([0.0, 1.0, 1.0, 1e-39])  # greedy, plain, nucleus, greedy (rounds to 0)
    top_ps = torch.tensor([1.0, 1.0, 0.5, 1.0])
    uniforms = torch.tensor([0.99, 0.99, 0.99, 0.5])
    tokens, logprobs, broken = sample_batch(logits, temperatures, top_ps, uniforms)
    assert tokens.tolist() == [0, 3, 0, 0]  # the plain row's u = 0.99 lands in the last token's mass
    full = torch.log_softmax(logits[0], -1)
    assert logprobs[0] == full[0] and logprobs[1] == full[3]
    assert logprobs[2] == 0.0  # top_p 0.5 keeps only the top token (p = 0.64): probability 1 in its nucleus
    assert not broken.any()


def test_a_top_p_that_rounds_to_zero_keeps_the_top_token_and_nan_logits_are_flagged():
    logits = torch.tensor([[0.0, 3.0, 1.0], [float("nan"), 0.0, 0.0]])
    tokens, _, broken = sample_batch(logits, torch.ones(2), torch.tensor([1e-300, 1.0]), torch.tensor([0.7, 0.2]))
    assert tokens[0] == 1 and broken.tolist() == [False, True]


def test_inverse_cdf_draws_match_the_tempered_distribution():
    logits = torch.tensor([[1.0, 0.0, -0.5, 0.3]])
    n = 20000
    u = torch.rand(n, generator=torch.Generator().manual_seed(0))
    tokens, _, _ = sample_batch(logits.expand(n, -1), torch.full((n,), 0.7), torch.ones(n), u)
    freq = torch.bincount(tokens, minlength=4).float() / n
    want = torch.softmax(logits[0] / 0.7, -1)
    assert torch.allclose(freq, want, atol=0.015)
    nucleus = top_p_filter(want[None], torch.tensor([0.8]))[0]
    assert math.isclose(float(nucleus.sum()), 1.0, rel_tol=1e-6) and (nucleus == 0).sum() >= 1
