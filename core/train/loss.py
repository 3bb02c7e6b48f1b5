"""The policy loss: token-level PPO-clip (or CISPO) with asymmetric bounds, rollout correction and an optional k3 KL penalty.

For every loss-masked token t with advantage A (its episode's), weight w (its sample's) and
ratio r = exp(logp_new - logp_behaviour):

    loss_t = -min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A) + kl_coef * k3_t
    k3_t   = exp(logp_ref - logp_new) - (logp_ref - logp_new) - 1       (Schulman's k3 estimator)

With ``tis_cap`` C (truncated importance sampling, as verl and TRL use against training-inference
mismatch and staleness) the PPO-clip term is replaced by

    loss_t = -min(r, C) * A * logp_new        (the weight min(r, C) is a constant: no gradient)

so the gradient is the policy gradient weighted by the truncated ratio. On-policy tokens have r = 1
and get the same gradient as PPO-clip at r = 1; off-policy ones are down- or up-weighted (to at most
C) instead of being cut off by the clip range. Since the trainer takes one optimizer step per batch,
pi_theta during the forward pass is the proximal policy, so no clipping is lost. The other
corrections (sequence-level TIS, token- and sequence-level MIS) are ``core.train.correction``'s: MIS
drops the tokens (or sequences) whose ratio leaves [1/C, C] from the loss and counts them.

With ``loss="cispo"`` (MiniMax-M1's CISPO) the clip moves from the term to the weight:

    loss_t = -clip(r, cispo_min, cispo_max) * A * logp_new      (the weight is a constant: no gradient)

so no token ever loses its gradient to the clip (PPO-clip zeroes a clipped token's), it is only
re-weighted; ScaleRL found it learns better at scale than DAPO-style clipping.

and a micro-batch contributes sum_t(w_t * loss_t) / normalizer. The trainer passes the same
normalizer (the weighted token count of the WHOLE batch) to every micro-batch, so accumulating
gradients over micro-batches gives exactly the gradient of one big batch, however it was packed.

This module computes tensors and a few detached sums for telemetry. It does not run the model,
choose the normalizer, or step an optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from core.train.correction import Correction, correct, mismatch_k3

# Bound on |logp_new - logp_behaviour| before exponentiating. A token this far off-policy carries no
# useful signal, and the bound keeps exp() finite (float32 overflows near 88) so one stale token
# cannot turn the whole loss into inf.
MAX_LOG_RATIO = 20.0


# The order of `LossTerms.stats`: unweighted sums over the masked tokens, kept on the device.
STAT_NAMES = ("pg_sum", "kl_sum", "clipped", "tokens", "behaviour_diff_sum", "behaviour_diff_max", "masked_out",
              "ratio_sum", "mismatch_kl_sum")

LossKind = Literal["ppo_clip", "cispo"]
LOSS_KINDS: tuple[LossKind, ...] = ("ppo_clip", "cispo")


@dataclass
class LossTerms:
    """One micro-batch's loss (with grad) and unweighted sums over its masked tokens.

    The sums stay one detached device tensor (`stats`, in `STAT_NAMES` order) so a caller reads them
    with its other scalars in one host sync (the trainer does); the named properties read them on
    first use, in one sync too.
    - pg_sum: sum of the PPO-clip term; kl_sum: of k3 (0 without a reference);
    - clipped: tokens whose clipped term was selected (PPO), whose weight hit tis_cap (TIS) or whose
      CISPO weight was clipped;
    - tokens: masked tokens;
    - masked_out: masked tokens a masked-IS correction dropped from the loss;
    - ratio_sum, mismatch_kl_sum: r = pi_theta / pi_behaviour and its k3 mismatch estimate, summed;
    - behaviour_diff_sum/max: |logp_new - logp_behaviour| summed and at its largest: before the first
      update of a step's weights this is the engine/trainer mismatch alone (numerics: dtype, batch
      shape, kernels); with max_staleness > 0 it also holds how far the policy moved since sampling.
    """

    loss: torch.Tensor  # scalar: this micro-batch's share of the batch loss
    stats: torch.Tensor  # [len(STAT_NAMES)], detached
    _read: list[float] | None = None

    def value(self, name: str) -> float:
        if self._read is None:
            self._read = self.stats.tolist()
        return self._read[STAT_NAMES.index(name)]

    pg_sum = property(lambda self: self.value("pg_sum"))
    kl_sum = property(lambda self: self.value("kl_sum"))
    clipped = property(lambda self: int(self.value("clipped")))
    tokens = property(lambda self: int(self.value("tokens")))
    behaviour_diff_sum = property(lambda self: self.value("behaviour_diff_sum"))
    behaviour_diff_max = property(lambda self: self.value("behaviour_diff_max"))
    masked_out = property(lambda self: int(self.value("masked_out")))
    ratio_sum = property(lambda self: self.value("ratio_sum"))
    mismatch_kl_sum = property(lambda self: self.value("mismatch_kl_sum"))


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    normalizer: float,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    tis_cap: float | None = None,
    correction: Correction | None = None,
    loss: LossKind = "ppo_clip",
    cispo_min: float = 0.0,
    cispo_max: float = 5.0,
) -> LossTerms:
    """PPO-clip or CISPO (+ k3 KL) over [B, T] per-token tensors; `mask` is bool, True on trained tokens.

    `correction` None means token TIS when `tis_cap` is given, else none (the settings before
    ``trainer.correction`` existed); `tis_cap` is the bound C of every correction."""
    shapes = {t.shape for t in (logp, old_logp, advantages, mask, weights)}
    if ref_logp is not None:
        shapes.add(ref_logp.shape)
    if len(shapes) != 1:
        raise ValueError(f"policy_loss needs per-token tensors of one shape, got {sorted(map(tuple, shapes))}")
    if normalizer <= 0:
        raise ValueError(f"normalizer must be positive, got {normalizer}")
    if kl_coef > 0 and ref_logp is None:
        raise ValueError("kl_coef > 0 needs the reference logprobs (ref_logp)")
    if tis_cap is not None and not tis_cap > 0:
        raise ValueError(f"tis_cap must be positive, got {tis_cap}")
    if loss not in LOSS_KINDS:
        raise ValueError(f"unknown loss {loss!r}; expected one of {LOSS_KINDS}")
    kind: Correction = correction if correction is not None else ("token_tis" if tis_cap is not None else "none")
    if loss == "cispo" and kind.endswith("_tis"):
        raise ValueError("CISPO's clipped weight is already a truncated importance weight; use a MIS correction or none")
    if loss == "cispo" and not 0.0 <= cispo_min < 1.0 < cispo_max:
        raise ValueError(f"CISPO needs 0 <= cispo_min < 1 < cispo_max, got {cispo_min}, {cispo_max}")

    old = old_logp.to(logp.dtype)
    log_ratio = (logp - old).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    fix = correct(log_ratio.detach(), mask, kind, tis_cap)
    # exp(logp - logp.detach()) is 1 in value with gradient d logp: a weighted term reads -w * A.
    score = torch.exp(logp - logp.detach())
    if loss == "cispo":
        weight = ratio.detach().clamp(cispo_min, cispo_max)
        per_token = -weight * advantages * score
        hit = (ratio.detach() < cispo_min) | (ratio.detach() > cispo_max)
    elif fix.weight is not None:
        per_token = -fix.weight * advantages * score
        hit = fix.capped
    else:
        unclipped = ratio * advantages
        clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
        per_token = -torch.minimum(unclipped, clipped)
        hit = clipped < unclipped
    pg = per_token
    if ref_logp is not None:
        delta = (ref_logp.to(logp.dtype) - logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        k3 = torch.exp(delta) - delta - 1.0
        per_token = per_token + kl_coef * k3
    else:
        k3 = torch.zeros_like(per_token)

    # torch.where, not multiplication: padding may hold anything, and NaN * 0 is still NaN.
    zero = torch.zeros((), dtype=per_token.dtype, device=per_token.device)
    # A token MIS dropped leaves the sum but not the normaliser (TRL sets its weight to 0 the same way).
    total = torch.where(fix.keep, weights * per_token, zero).sum() / normalizer
    with torch.no_grad():
        diff = torch.where(mask, (logp - old).abs(), zero)
        most = diff.max() if diff.numel() else zero
        stats = torch.stack([torch.where(fix.keep, pg, zero).sum(), torch.where(fix.keep, k3, zero).sum(),
                             (fix.keep & hit).sum().to(zero.dtype), mask.sum().to(zero.dtype), diff.sum(), most,
                             (mask & ~fix.keep).sum().to(zero.dtype), torch.where(mask, ratio, zero).sum(),
                             torch.where(mask, mismatch_k3(log_ratio), zero).sum()])
        return LossTerms(loss=total, stats=stats)
