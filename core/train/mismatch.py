"""Mismatch telemetry: how far the sampler was from the trainer on one step, and the alarm when it jumps.

From the summed per-token statistics of a step (``core.train.loss.STAT_NAMES``, summed by the trainer):

- ``train/mismatch_kl``: the mean k3 estimate of KL(pi_behaviour || pi_theta) over the trained tokens
  (``core.train.correction.mismatch_k3``). The trainer scores the tokens before the step's update, so
  on-policy this is the engine/trainer mismatch alone: numerics, or a sampling setting the trainer does
  not reproduce (a temperature the engine used but did not record). prime-rl caught an FP8 regression
  by its rise (0.0038 -> 0.0059).
- ``train/ratio_mean``: the mean of r = pi_theta / pi_behaviour (1 when they agree);
- ``train/masked_frac``: the share of trained tokens a masked-IS correction dropped (``train/clip_frac``
  is the clipped share).

``check`` compares the step's mismatch with ``trainer.mismatch_kl_bound``: past it, a warning naming the
step, the value and the bound; with ``mismatch_action: stop`` it also raises ``MismatchExceeded``
before the optimizer step, so the weights stay as they were and the run loop counts the step as failed
(``trainer.max_failed_steps`` of them end the run).

It reads sums and a config. It computes no loss and steps no optimizer.
"""

from __future__ import annotations

import logging

from core.config import TrainerConfig

log = logging.getLogger(__name__)


class MismatchExceeded(RuntimeError):
    """A step's sampler/trainer mismatch passed `trainer.mismatch_kl_bound` under `mismatch_action: stop`."""


def mismatch_metrics(sums: dict[str, float]) -> dict[str, float]:
    """The step's mismatch metrics; empty when no token went through the model (nothing was measured)."""
    trained = sums.get("masked", 0.0)
    if trained <= 0:
        return {}
    return {"train/mismatch_kl": sums.get("mismatch_kl", 0.0) / trained,
            "train/ratio_mean": sums.get("ratio", 0.0) / trained,
            "train/masked_frac": sums.get("masked_out", 0.0) / trained}


def check(sums: dict[str, float], cfg: TrainerConfig, model_name: str, step: int) -> None:
    """Warn (and under `stop` raise) when the step's mismatch KL exceeds the configured bound."""
    if cfg.mismatch_kl_bound is None:
        return
    kl = mismatch_metrics(sums).get("train/mismatch_kl")
    if kl is None or kl <= cfg.mismatch_kl_bound:  # a NaN mismatch is not <= anything: it alarms too
        return
    message = (f"model {model_name} step {step}: sampler/trainer mismatch KL {kl:.4g} exceeds "
               f"trainer.mismatch_kl_bound {cfg.mismatch_kl_bound:g}: the engine samples from another "
               "distribution than it records (temperature, top_p, dtype, kernels) or the weights it serves are stale")
    log.warning(message)
    if cfg.mismatch_action == "stop":
        raise MismatchExceeded(message + "; trainer.mismatch_action is stop, so the step is not applied")
