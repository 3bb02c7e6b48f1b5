"""Sampling one token for every row of a decode batch, on the model's device, in one pass.

`sample_batch` takes the batch's last logits [B, V] where the model left them and returns each
row's token, the logprob of what sampled it, and whether the row's logits were unusable (NaN).
Everything is batched: one log-softmax, a vocabulary sort only for the rows that ask for top_p,
and inverse-CDF draws from uniforms the caller supplies, so the draws come from the run's seeded
CPU generator (or a request's own seed) while the [B, V] work stays on the GPU, and only B tokens
and B logprobs cross back to the host. The rules match the engines' contract (`core.engine`):
below `GREEDY_BELOW` a row decodes greedily and is scored at temperature 1; with top_p the
recorded logprob is of the renormalised nucleus (as vLLM records it), which always keeps the top
token, so a top_p that rounds to 0 in float32 samples greedily instead of failing.

This module is pure tensor code: it knows no requests, rows or engines (`core.engine.hf` does).
"""

from __future__ import annotations

import torch

from core.engine import GREEDY_BELOW


def nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[N, V] bool: each row's nucleus, the most likely tokens while the mass before them is below the
    row's top_p [N], the most likely one always. The trainer scores top_p tokens within the same set."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    keep = sorted_probs.cumsum(-1) - sorted_probs < top_p[:, None]
    keep[:, 0] = True
    return torch.zeros_like(keep).scatter(1, order, keep)


def top_p_filter(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Rows of `probs` [N, V] cut to their nucleus and renormalised."""
    filtered = probs * nucleus(probs, top_p)
    return filtered / filtered.sum(-1, keepdim=True)


def sample_batch(logits: torch.Tensor, temperatures: torch.Tensor, top_ps: torch.Tensor,
                 uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [B], logprobs [B], broken [B]) for last logits [B, V] and per-row temperature, top_p and
    a uniform draw in [0, 1) (all [B], any device; they are moved to the logits' device)."""
    device = logits.device
    logits = logits.float()
    temperatures, top_ps, uniforms = (x.to(device, torch.float32) for x in (temperatures, top_ps, uniforms))
    greedy = temperatures < GREEDY_BELOW
    scaled = logits / torch.where(greedy, torch.ones_like(temperatures), temperatures)[:, None]
    logp = torch.log_softmax(scaled, dim=-1)
    broken = torch.isnan(logits).any(-1) | ~torch.isfinite(logp.max(-1).values)
    probs = logp.exp()
    nucleus = (top_ps < 1.0) & ~greedy
    if bool(nucleus.any()):
        probs[nucleus] = top_p_filter(probs[nucleus], top_ps[nucleus])
    cdf = probs.cumsum(-1)
    drawn = (cdf < uniforms[:, None] * cdf[:, -1:]).sum(-1).clamp(max=logits.shape[-1] - 1)
    tokens = torch.where(greedy, logits.argmax(-1), drawn)
    chosen = tokens[:, None]
    logprobs = torch.where(nucleus, torch.log(probs.gather(1, chosen))[:, 0], logp.gather(1, chosen)[:, 0])
    return tokens, logprobs, broken
