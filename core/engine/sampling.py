"""Sampling one token for every row of a decode batch, on the model's device, in one pass.

`sample_batch` takes the batch's last logits [B, V] where the model left them and returns each
row's token, the logprob of what sampled it, and whether the row's logits were unusable (NaN), as
device tensors (`Sampled`); `Sampled.to_host` is the decode step's one device-to-host read. Every
value that decides the shape of the work (which rows are greedy, which ask for top_p) is known on
the host from the requests, so nothing inside reads the device: the rows that need a vocabulary
sort are chosen by host-side indices, never by a device mask (`tests/core/test_sampling.py` runs
it on the `meta` device, where any read would raise). Draws are inverse-CDF from uniforms the
caller supplies, so they come from the run's seeded CPU generator or a row's own generator while
the [B, V] work stays on the GPU. The rules match the engines' contract (`core.engine`): below
`GREEDY_BELOW` a row decodes greedily and is scored at temperature 1 over the whole vocabulary
(top_p does not apply to a greedy row: `scoring_top_p`); with top_p the recorded logprob is of the
renormalised nucleus (as vLLM records it), which always keeps the top token, so a top_p that rounds
to 0 in float32 samples greedily instead of failing. A draw never lands on a token of probability 0
(outside the nucleus, or underflowed), a draw of exactly 0 included.

This module is pure tensor code: it knows no requests, rows or engines (`core.engine.hf` does).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """[N] the token each row's uniform in [0, 1) picks from its (unnormalised) `probs` [N, V]: the first
    token whose cumulative mass exceeds u * total. Such a token has mass > 0 (its cumulative mass rose),
    so u = 0 picks the first token that can be drawn, not token 0. The target is held strictly below the
    total, so a u * total that rounds up to it takes the last token whose mass counts, never one after."""
    cdf = probs.cumsum(-1)  # non-decreasing in float too: adding a non-negative number never lowers a sum
    total = cdf[:, -1]
    target = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))
    return (cdf <= target[:, None]).sum(-1)


@dataclass
class Sampled:
    """One decode step's draw, still on the model's device."""

    tokens: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32: of the distribution that sampled each token
    broken: torch.Tensor  # [B] bool: the row's logits were NaN (or all -inf)

    def to_host(self) -> list[tuple[int, float, bool]]:
        """(token, logprob, broken) per row, in ONE device-to-host read (float64 holds every token id
        and float32 logprob exactly)."""
        packed = torch.stack([self.tokens.double(), self.logprobs.double(), self.broken.double()], dim=1)
        return [(int(t), lp, bool(b)) for t, lp, b in packed.tolist()]


def sample_batch(logits: torch.Tensor, temperatures: Sequence[float], top_ps: Sequence[float],
                 uniforms: torch.Tensor) -> Sampled:
    """Each row's token for last logits [B, V] and per-row temperature and top_p (host values, [B]) and
    a uniform draw in [0, 1) ([B], any device: moved to the logits' device). Reads nothing back."""
    device, vocab = logits.device, logits.shape[-1]
    temperatures, top_ps = [float(t) for t in temperatures], [float(p) for p in top_ps]
    greedy_rows = [t < GREEDY_BELOW for t in temperatures]
    nucleus_rows = [i for i, (g, p) in enumerate(zip(greedy_rows, top_ps)) if p < 1.0 and not g]
    logits = logits.float()
    greedy = torch.tensor(greedy_rows, device=device)
    scale = torch.tensor([1.0 if g else t for g, t in zip(greedy_rows, temperatures)], device=device)
    logp = torch.log_softmax(logits / scale[:, None], dim=-1)
    broken = torch.isnan(logits).any(-1) | ~torch.isfinite(logp.max(-1).values)
    probs = logp.exp()
    chosen_logp = logp
    if nucleus_rows:  # a vocabulary sort only for the rows that asked for top_p, chosen on the host
        rows = torch.tensor(nucleus_rows, device=device)
        kept = top_p_filter(probs.index_select(0, rows), torch.tensor([top_ps[i] for i in nucleus_rows], device=device))
        probs = probs.index_copy(0, rows, kept)
        chosen_logp = logp.index_copy(0, rows, torch.log(kept))
    drawn = inverse_cdf(probs, uniforms.to(device, torch.float32))
    tokens = torch.where(greedy, logits.argmax(-1), drawn).clamp(max=vocab - 1)
    logprobs = chosen_logp.gather(1, tokens[:, None])[:, 0]
    return Sampled(tokens, logprobs, broken)
