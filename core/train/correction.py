"""Rollout correction: how far each trained token's sampler was from the trainer, and what to do about it.

The engine samples from pi_behaviour and records its logprobs; the trainer scores the same tokens
with pi_theta. Their ratio r_t = exp(logp_theta - logp_behaviour) differs from 1 through numerics
(dtype, kernels, batch shape), through staleness (``max_staleness`` > 0) and through any sampling
setting the trainer does not reproduce. ``TrainerConfig.correction`` picks the correction, with the
bound C (``TrainerConfig.tis_cap``):

- ``token_tis``: each token's policy gradient weighted by min(r_t, C) (truncated IS, verl and TRL's
  ``token_truncate``);
- ``seq_tis``: every token of a sequence weighted by min(r_s, C), r_s = exp(sum_t log r_t) over the
  sequence's trained tokens (TRL's ``sequence_truncate``, verl's sequence-level TIS);
- ``token_mis``: a token whose r_t leaves [1/C, C] is dropped from the loss (masked IS), the others
  keep the policy loss unchanged;
- ``seq_mis``: a whole sequence is dropped when r_s leaves [1/C, C] (TRL's default ``sequence_mask``).

A *sequence* is one row of a micro-batch, i.e. one training sample (an episode's merged path, or its
whole trie with ``merge: tree``); the trainer therefore does not share a group's prompt across
episodes (``share_prompt``) under a sequence-level correction, which would put several episodes in
one row. Dropped tokens still count in the loss normaliser, as in TRL (their ratio is set to 0,
not removed), so a drop shrinks the step instead of re-weighting the survivors.

It also measures the mismatch for telemetry: ``mismatch_kl`` is Schulman's k3 estimate of
KL(pi_behaviour || pi_theta) on the sampled tokens, r - 1 - log r (non-negative, unbiased since the
tokens were drawn from pi_behaviour). Before a step's update the trainer's weights are the ones that
sampled (on-policy), so it is the engine/trainer mismatch alone; with staleness it also holds drift.

This module computes detached weights and masks. It does not compute the loss (``core.train.loss``)
or decide what to do when the mismatch is large (``core.train.mismatch``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

Correction = Literal["none", "token_tis", "seq_tis", "token_mis", "seq_mis"]
CORRECTIONS: tuple[Correction, ...] = ("none", "token_tis", "seq_tis", "token_mis", "seq_mis")
SEQUENCE_LEVEL: tuple[Correction, ...] = ("seq_tis", "seq_mis")


@dataclass
class Corrected:
    """What a correction decided for a [B, T] batch of tokens (all detached)."""

    weight: torch.Tensor | None  # TIS: each token's truncated importance weight; None: no TIS
    keep: torch.Tensor  # bool: trained tokens that stay in the loss (MIS drops the others)
    capped: torch.Tensor  # bool: tokens whose TIS weight hit the cap (0 without TIS)


def sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's summed log-ratio over its masked tokens, broadcast back to [B, T]."""
    zero = torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device)
    return torch.where(mask, log_ratio, zero).sum(dim=-1, keepdim=True).expand_as(log_ratio)


def correct(log_ratio: torch.Tensor, mask: torch.Tensor, kind: Correction, cap: float | None) -> Corrected:
    """The weights and kept tokens of `kind` for detached per-token log-ratios; `mask`: trained tokens."""
    if kind not in CORRECTIONS:
        raise ValueError(f"unknown correction {kind!r}; expected one of {CORRECTIONS}")
    none = torch.zeros_like(mask)
    if kind == "none":
        return Corrected(weight=None, keep=mask, capped=none)
    if cap is None or not cap > 0.0 or (kind.endswith("_mis") and not cap > 1.0):
        raise ValueError(f"correction {kind!r} needs a bound C (trainer.tis_cap; > 1 for MIS), got {cap}")
    level = sequence_log_ratio(log_ratio, mask) if kind in SEQUENCE_LEVEL else log_ratio
    if kind.endswith("_tis"):
        # The exponent is bounded before exp: a sequence's summed log-ratio can be large, and only
        # min(r, C) is needed, so anything above log C is C.
        weight = torch.exp(level.clamp(max=math.log(cap)))
        return Corrected(weight=weight, keep=mask, capped=mask & (level > math.log(cap)))
    inside = level.abs() <= math.log(cap)  # r in [1/C, C]
    return Corrected(weight=None, keep=mask & inside, capped=none)


def mismatch_k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(behaviour || trainer): r - 1 - log r with log r = logp_theta - logp_behaviour."""
    return torch.exp(log_ratio) - 1.0 - log_ratio
