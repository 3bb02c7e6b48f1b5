"""The RL update of one policy: a batch of finished groups in, one optimizer step out.

One `Trainer.step` is `prepare` (no model), `backward` (forward and backward passes, weights
untouched) and `apply` (the optimizer step, the only part that changes weights), so the run loop can
keep the engine generating through `backward` and swap weights in between two decode steps. In order:

1. rewards: each episode's reward for this model (``episode.reward[model_name]``);
2. advantages: group-relative (``core.train.advantages``), one per episode;
3. samples: each episode's calls of this model merged into training samples (``core.train.timelines``),
   carrying their episode's advantage and, with ``episode_weighting``, a weight of 1 / the
   episode's trained tokens so that every episode counts the same however long it ran;
4. micro-batches: with ``share_prompt``, each group's samples first become tree samples holding the
   group's common prompt once (``core.train.prompt_sharing.share_prompt``); then samples are packed to
   ``micro_batch_tokens`` padded tokens (``core.train.packing``);
5. loss: token-level PPO-clip or CISPO (``trainer.loss``), with the rollout correction of
   ``trainer.correction`` (``core.train.correction``: token/sequence TIS or MIS), on the behaviour
   logprobs the engine recorded, each token scored at its call's sampling temperature, plus an optional k3 KL
   to the reference (a frozen copy of the initial weights, or the base model with LoRA adapters
   off), normalised by the batch's weighted token count (``core.train.loss``);
6. gradients accumulated over the micro-batches, clipped by norm, then one AdamW step. A non-finite
   loss or gradient norm skips the step (gradients dropped, weights untouched, a warning logged).
   A bf16 or fp16 model's step is taken on fp32 master copies of its weights (``core.train.master``),
   since most of an RL-sized step is below half a bf16 ulp.

Samples with zero advantage contribute nothing to the PPO term, so without a KL term they are not
run through the model at all; their tokens still count in the normaliser, as in plain GRPO. A step
with nothing to run takes AdamW's step on zero gradients once AdamW has moments (its momentum moves
the weights, as TRL's optimizer does; ``trainer.no_signal_steps: momentum``); before that, or with
``skip``, it changes no weights and says so (``train/updated`` 0): the run loop then keeps the
weight version, so no episode goes stale for it. Each step also reports the sampler/trainer mismatch
(``core.train.mismatch``) and warns past ``trainer.mismatch_kl_bound``.

The trainer does not fetch batches, pause engines, bump weight versions, write checkpoints or log
to MLflow; ``core.run.loop`` does, with the ``core.train.outcome.StepOutcome`` a step comes to.
"""

from __future__ import annotations

import copy
import logging
import math
import random
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from core.config import TrainerConfig
from core.records import Episode
from core.train.prompt_sharing import share_prompt
from core.train.rng import rng_state, set_rng_state
from core.train.timelines import Sample
from core.train import mismatch
from core.train.advantages import group_advantages
from core.train.correction import SEQUENCE_LEVEL
from core.train.group_samples import group_samples
from core.train.loss import STAT_NAMES, policy_loss
from core.train.master import MasterWeights
from core.train.outcome import StepOutcome
from core.train.packing import pack, token_logprobs

log = logging.getLogger(__name__)

# Keys of `Trainer.state_dict`; checked on load so a foreign or truncated file fails loudly.
STATE_KEYS = ("optimizer", "step", "rng")


@dataclass
class PreparedStep:
    """One step in the making: its samples (from `prepare`), then its sums (`backward`), then its outcome (`apply`)."""

    groups: list[list[Episode]]
    rewards: list[list[float]]
    samples: list[Sample]
    active: list[Sample]  # the samples that go through the model; empty means no weight can change
    normalizer: float
    unmerged_tokens: int
    linear_tokens: int
    started: float = field(default_factory=time.perf_counter)
    sums: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    grad_norm: float = 0.0
    skipped: bool = False  # non-finite loss or gradient: optimizer step skipped
    updated: bool = False  # the optimizer changed the weights
    momentum: bool = False  # nothing to run, but AdamW's momentum still moves the weights (no_signal_steps)

    @property
    def needs_update(self) -> bool:
        return bool(self.active) or self.momentum


def seed_everything(seed: int) -> None:
    """Seed torch, Python's `random` and numpy: call once per process, before building models."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _is_peft(module: torch.nn.Module) -> bool:
    # A module can only be a PeftModel if peft was imported, so full fine-tunes never import it.
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(module, peft.PeftModel)


def _reward(episode: Episode, model_name: str) -> float:
    if episode.reward is None:
        raise ValueError(f"episode {episode.id} has no reward; only finished episodes can train")
    if model_name not in episode.reward:
        raise ValueError(
            f"episode {episode.id} has rewards for {sorted(episode.reward)} but not for model {model_name!r}"
        )
    return float(episode.reward[model_name])


class Trainer:
    """Owns one policy's optimizer and reference; `step` applies one RL update to the policy in place."""

    def __init__(self, policy: torch.nn.Module, cfg: TrainerConfig, model_name: str, lora: bool):
        if lora != _is_peft(policy):
            raise ValueError(
                f"lora={lora} but the policy is {'not ' if lora else ''}a PEFT model; "
                "build it with prepare_policy"
            )
        params = [p for p in policy.parameters() if p.requires_grad]
        if not params:
            raise ValueError(f"policy {model_name!r} has no trainable parameters")
        self.policy = policy
        self.cfg = cfg
        self.model_name = model_name
        self.lora = lora
        self.step_count = 0
        # The optimizer steps `master.params`: fp32 copies of low-precision weights, the others as they are.
        self.master = MasterWeights(params, cfg.master_weights)
        self.optimizer = torch.optim.AdamW(self.master.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        # With LoRA the reference is the same module with adapters off, so nothing is copied.
        self.reference: torch.nn.Module | None = None
        if cfg.kl_coef > 0 and not lora:
            self.reference = self._make_reference(policy)

    # -- the update ------------------------------------------------------------------------------
    def step(self, groups: list[list[Episode]]) -> dict[str, float]:
        """One optimizer step on `groups` (each a list of finished episodes of one task)."""
        prepared = self.prepare(groups)
        self.backward(prepared)
        self.apply(prepared)
        return self.outcome(prepared).logged()

    def prepare(self, groups: list[list[Episode]]) -> PreparedStep:
        """Rewards, advantages and merged samples; touches no model. Raises ValueError on a malformed episode."""
        started = time.perf_counter()
        rewards = [[_reward(e, self.model_name) for e in group] for group in groups]
        advantages = group_advantages(rewards, self.cfg.advantage, self.cfg.max_abs_reward)
        grouped, unmerged, linear = group_samples(groups, rewards, advantages, self.cfg, self.model_name)
        samples = [s for group in grouped for s in group]
        active: list[Sample] = []
        # A sequence-level correction reads one row as one sequence: no row may hold several episodes.
        share = self.cfg.share_prompt and self.cfg.correction not in SEQUENCE_LEVEL
        for group in grouped:
            # Zero-advantage tokens have a zero PPO term; without KL they need no forward pass.
            running = group if self.cfg.kl_coef > 0 else [s for s in group if s.advantage != 0.0]
            active += share_prompt(running, self.cfg.micro_batch_tokens) if share else running
        return PreparedStep(groups, rewards, samples, active, sum(s.weight * s.num_masked for s in samples),
                            unmerged, linear, started=started, momentum=not active and self._has_momentum())

    def backward(self, prepared: PreparedStep) -> None:
        """Forward and backward passes; gradients accumulate in `.grad`, the weights stay as they are."""
        was_training = self.policy.training
        self.policy.train()
        try:
            prepared.sums = self._accumulate(prepared.active, prepared.normalizer)
        finally:
            self.policy.train(was_training)

    def apply(self, prepared: PreparedStep) -> bool:
        """The optimizer step (the only weight change); returns whether the weights changed."""
        mismatch.check(prepared.sums, self.cfg, self.model_name, self.step_count + 1)  # raises under `stop`
        prepared.grad_norm, prepared.skipped, prepared.updated = self._apply(prepared.sums["loss"])
        self.step_count += 1
        return prepared.updated

    def discard(self) -> None:
        """Drop gradients a failed step left behind, so they cannot leak into the next one."""
        self.optimizer.zero_grad(set_to_none=True)
        self.policy.zero_grad(set_to_none=True)  # a bf16 model's own gradients, not yet moved to its copies

    @property
    def overlap_safe(self) -> bool:
        """Whether `backward` may run while the engine generates with the same module: only if it does
        not change what the module computes (no active dropout in train mode, no adapters switched off)."""
        if self.lora and self.cfg.kl_coef > 0:
            return False  # the KL reference pass disables the adapters the engine generates with
        config = getattr(self.policy, "config", None)
        if float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
            return False
        return not any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in self.policy.modules())

    def outcome(self, prepared: PreparedStep) -> StepOutcome:
        """What the applied step came to: its metrics (names per DESIGN §3.6) and whether it was skipped."""
        return StepOutcome(self._metrics(prepared), skipped=prepared.skipped)

    def _metrics(self, prepared: PreparedStep) -> dict[str, float]:
        sums = prepared.sums
        flat = [r for g in prepared.rewards for r in g]
        trained = max(sums["masked"], 1.0)
        metrics = {
            "train/loss": sums["loss"],
            "train/kl": sums["kl"] / trained,
            "train/entropy": sums["entropy"] / trained,
            "train/clip_frac": sums["clipped"] / trained,
            "train/grad_norm": prepared.grad_norm,
            "train/tokens": sums["tokens"],
            "train/trained_tokens": sums["masked"],
            "train/samples": float(len(prepared.samples)),
            "train/updated": float(prepared.updated),
            "train/step_time_s": time.perf_counter() - prepared.started,
            "merge/ratio": prepared.unmerged_tokens / prepared.linear_tokens if prepared.linear_tokens else 1.0,
            "reward/mean": float(np.mean(flat)) if flat else 0.0,
            "reward/std": float(np.std(flat)) if flat else 0.0,
        }
        if sums["masked"] > 0:  # only tokens that went through the model have a trainer logprob
            metrics["train/behaviour_logp_diff"] = sums["behaviour_diff"] / sums["masked"]
            metrics["train/behaviour_logp_diff_max"] = sums["behaviour_diff_max"]
        metrics.update(mismatch.mismatch_metrics(sums))
        metrics.update(_per_sandbox_rewards(prepared.groups, prepared.rewards))
        return metrics

    def _accumulate(self, samples: list[Sample], normalizer: float) -> dict[str, float]:
        """Forward and backward every micro-batch; gradients sum in `.grad`. Returns detached sums."""
        sums: dict[str, float] = defaultdict(float)
        if not samples or normalizer <= 0:
            return sums
        device = next(self.policy.parameters()).device
        for mb in pack(samples, self.cfg.micro_batch_tokens):
            loss = self._micro_batch(mb.to(device), normalizer, sums)
            if not math.isfinite(sums["loss"]):
                break  # the step will be skipped; more backward passes would only cost time
            loss.backward()
        return sums

    def _micro_batch(self, mb: Any, normalizer: float, sums: dict[str, float]) -> torch.Tensor:
        """One micro-batch's forward pass: adds its detached sums to `sums`, returns its loss to backward."""
        logp, entropy = self._logprobs(mb)
        ref_logp = self._reference_logprobs(mb) if self.cfg.kl_coef > 0 else None
        terms = policy_loss(
            logp,
            mb.old_logprobs,
            mb.advantages,
            mb.loss_mask,
            mb.weights,
            clip_low=self.cfg.clip_low,
            clip_high=self.cfg.clip_high,
            normalizer=normalizer,
            ref_logp=ref_logp,
            kl_coef=self.cfg.kl_coef,
            tis_cap=self.cfg.tis_cap,
            correction=None if self.cfg.correction == "none" else self.cfg.correction,
            loss=self.cfg.loss,
            cispo_min=self.cfg.cispo_min,
            cispo_max=self.cfg.cispo_max,
        )
        # The micro-batch's scalars in one host sync: each float() would be a device round trip.
        read = torch.cat([torch.stack([terms.loss.detach(), entropy[mb.loss_mask].sum().to(terms.stats.dtype)]),
                          terms.stats]).tolist()
        loss, entropy_sum, stats = read[0], read[1], dict(zip(STAT_NAMES, read[2:]))
        sums["loss"] += loss
        sums["kl"] += stats["kl_sum"]
        sums["clipped"] += stats["clipped"]
        sums["masked"] += stats["tokens"]
        sums["tokens"] += mb.num_tokens
        sums["entropy"] += entropy_sum
        sums["behaviour_diff"] += stats["behaviour_diff_sum"]
        sums["behaviour_diff_max"] = max(sums["behaviour_diff_max"], stats["behaviour_diff_max"])
        for name, key in (("masked_out", "masked_out"), ("ratio", "ratio_sum"), ("mismatch_kl", "mismatch_kl_sum")):
            sums[name] += stats[key]  # for core.train.mismatch
        return terms.loss

    def _logprobs(self, mb: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy's logprobs (with grad) and entropy of a micro-batch's trained tokens."""
        return token_logprobs(self.policy, mb, positions=mb.loss_mask)

    def _make_reference(self, policy: torch.nn.Module) -> torch.nn.Module:
        """The frozen KL reference of a full fine-tune: a copy of the initial weights."""
        return copy.deepcopy(policy).eval().requires_grad_(False)

    def _clip(self, params: list[torch.nn.Parameter]) -> float:
        """Clip the gradients to `grad_clip` by their global norm; returns the norm before clipping."""
        return float(torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip))

    def _has_momentum(self) -> bool:
        """Whether AdamW on zero gradients would move the weights (`no_signal_steps: momentum`, moments exist)."""
        return self.cfg.no_signal_steps == "momentum" and bool(self.optimizer.state)

    def _reference_logprobs(self, mb: Any) -> torch.Tensor:
        with torch.no_grad(), self._reference() as ref:
            return token_logprobs(ref, mb, positions=mb.loss_mask)[0]

    @contextmanager
    def _reference(self) -> Iterator[torch.nn.Module]:
        if self.lora:
            # Eval mode so adapter dropout cannot differ between the two passes.
            was_training = self.policy.training
            self.policy.eval()
            try:
                with self.policy.disable_adapter():
                    yield self.policy
            finally:
                self.policy.train(was_training)
        else:
            assert self.reference is not None  # built in __init__ whenever kl_coef > 0
            yield self.reference

    def _apply(self, loss: float) -> tuple[float, bool, bool]:
        """Clip and step; returns (pre-clip grad norm, skipped, stepped). Gradients are always cleared."""
        self.master.take_grads()
        have_grads = any(p.grad is not None for p in self.master.params)
        if not have_grads and math.isfinite(loss) and self._has_momentum():
            for p in self.master.params:  # a batch without signal: AdamW's step on zero gradients (no_signal_steps)
                p.grad = torch.zeros_like(p)
            have_grads = True
        if not have_grads and math.isfinite(loss):
            return 0.0, False, False  # nothing in the batch could move the weights
        grad_norm = self._clip(self.master.params) if have_grads else 0.0
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            log.warning(
                "model %s step %d: non-finite loss (%s) or grad norm (%s); optimizer step skipped",
                self.model_name,
                self.step_count,
                loss,
                grad_norm,
            )
            self.optimizer.zero_grad(set_to_none=True)
            return grad_norm, True, False
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.master.write_back()
        return grad_norm, False, True

    # -- checkpoint state ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Optimizer, step, RNG state and the fp32 master weights of a low-precision model (the model's
        own weights are stored by `core.run.checkpoint`)."""
        return {"optimizer": self.optimizer.state_dict(), "step": self.step_count, "rng": rng_state(),
                "master": self.master.state()}

    def check_state(self, state: dict[str, Any]) -> None:
        """Raise ValueError if `state` cannot load into this trainer, before anything is changed."""
        missing = [k for k in STATE_KEYS if k not in state]
        if missing:
            raise ValueError(f"trainer state for {self.model_name!r} lacks {missing}")
        self.master.check(state.get("master"))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        try:
            self.optimizer.load_state_dict(state["optimizer"])
        except (ValueError, KeyError) as e:
            raise ValueError(
                f"optimizer state does not fit policy {self.model_name!r} (LoRA setting or model changed?): {e}"
            ) from e
        # Called after the weights are loaded: the master copies start from them, then take the saved
        # fp32 bits where the checkpoint has them (one written before master weights existed does not).
        self.master.read_model()
        self.master.load(state.get("master"))
        self.step_count = int(state["step"])
        set_rng_state(state["rng"])


def _per_sandbox_rewards(groups: list[list[Episode]], rewards: list[list[float]]) -> dict[str, float]:
    by_sandbox: dict[str, list[float]] = defaultdict(list)
    for group, group_rewards in zip(groups, rewards):
        for episode, r in zip(group, group_rewards):
            by_sandbox[episode.sandbox].append(r)
    return {f"reward/{name}/mean": float(np.mean(rs)) for name, rs in by_sandbox.items()}
