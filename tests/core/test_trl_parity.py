"""The core's GRPO update against TRL's (trl 1.16 `GRPOTrainer`, the settings of bench/vs_trl.py) on one fixed batch.

TRL is not a dependency of the test suite, so its update is written out here from its source, with
the lines it comes from (trl/trainer/grpo_trainer.py and grpo_config.py of trl 1.16.0):

- advantages (`_generate_and_score_completions`, ~L2763-2788, `scale_rewards="group"` the default):
  A = (r - group mean) / (nanstd(group) + 1e-4), where `nanstd` (trl/trainer/utils.py L1021) applies
  Bessel's correction (n - 1);
- the loss (`_compute_loss`, L3095-3120 and L3168-3173, `loss_type="dapo"` the default): with one
  iteration per generation batch `old_per_token_logps` is `per_token_logps.detach()` (L3068), so
  coef_1 = exp(logp - logp.detach()); per_token_loss = -min(coef_1 * A, clip(coef_1, 1 - eps, 1 + eps) * A);
  loss = sum(per_token_loss * completion_mask) / num_items_in_batch, the completion tokens of the whole
  generation batch (L2498), tied groups included; the mask holds every completion token up to and
  including EOS;
- the optimizer: transformers' TrainingArguments defaults, AdamW (`adamw_torch_fused`) with betas
  (0.9, 0.999), eps 1e-8, weight decay 0, `max_grad_norm` 1.0; `lr_scheduler_type` is "linear" by
  default, bench/vs_trl.py sets "constant" (the core has no schedule), no warmup; every step calls
  `optimizer.step()`, also on a batch whose advantages are all zero (its gradient is zero, not absent).

What the tests establish:
1. same advantages in, same gradient out: TRL's DAPO aggregation over the same tokens gives the core's
   gradient (mask, clip, normaliser and tied groups in the normaliser agree);
2. the advantages differ by one factor per group, (std_pop + 1e-6) / (std_bessel + 1e-4), about
   sqrt((n - 1) / n): kept (a group of one gets 0, not NaN, and the factor cancels in AdamW's
   normalised step and in gradient clipping), shown by the whole first update agreeing;
3. the difference that was real: on a batch without signal the core skipped the optimizer step, TRL's
   AdamW keeps moving the weights with its momentum. With 2 groups of 8 at low reward about a third of
   the steps have no signal (docs/benchmarks.md: 4 of 12 for TRL), so TRL moved on ~1.5x as many
   steps. `trainer.no_signal_steps: momentum` (now the default) does what TRL does.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from core.records import Episode
from core.train.advantages import group_advantages
from tests.core.test_trainer import CANDIDATES, make_episode, tiny_trainer, weights

EPSILON = 0.2  # bench/vs_trl.py's epsilon, both sides
LR = 1e-3
TRL_STD_EPS = 1e-4  # grpo_trainer.py L2787


def nanstd(xs: list[float]) -> float:
    """TRL's nanstd without NaNs: Bessel-corrected."""
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def trl_advantages(rewards: list[list[float]]) -> list[list[float]]:
    return [[(r - sum(g) / len(g)) / (nanstd(g) + TRL_STD_EPS) for r in g] for g in rewards]


def batch(trainer) -> tuple[list[list[Episode]], list[list[float]]]:
    """Two groups of four on-policy episodes: one with signal (rewards by 'x' share), one tied."""
    groups = [[make_episode(trainer.policy, f"g0-{i}", [t], t.count("x") / len(t), task_id="t0")
               for i, t in enumerate(CANDIDATES)],
              [make_episode(trainer.policy, f"g1-{i}", [t], 1.0, task_id="t1") for i, t in enumerate(CANDIDATES)]]
    return groups, [[e.reward["policy"] for e in g] for g in groups]


def trl_gradient(model: torch.nn.Module, groups: list[list[Episode]], advantages: list[list[float]]) -> dict:
    """TRL's DAPO loss over each episode's prompt + completion, backpropagated; the gradient by name."""
    model.zero_grad(set_to_none=True)
    episodes = [(e, a) for g, ga in zip(groups, advantages) for e, a in zip(g, ga)]
    num_items = sum(len(e.calls[0].completion_ids) for e, _ in episodes)  # the whole batch's completion tokens
    for episode, advantage in episodes:
        call = episode.calls[0]
        ids = torch.tensor([call.prompt_ids + call.completion_ids])
        logits = model(input_ids=ids).logits[0, len(call.prompt_ids) - 1:-1].float()  # T = 1: no scaling
        logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(call.completion_ids)[:, None])[:, 0]
        coef_1 = torch.exp(logp - logp.detach())
        coef_2 = coef_1.clamp(1 - EPSILON, 1 + EPSILON)
        per_token_loss = -torch.minimum(coef_1 * advantage, coef_2 * advantage)
        (per_token_loss.sum() / num_items).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def core_gradient(trainer, groups: list[list[Episode]]) -> dict:
    prepared = trainer.prepare(groups)
    trainer.backward(prepared)
    grads = {n: p.grad.clone() for n, p in trainer.policy.named_parameters() if p.grad is not None}
    trainer.discard()
    return grads


def test_with_the_same_advantages_trls_dapo_loss_gives_the_cores_gradient():
    trainer = tiny_trainer(lr=LR, clip_low=EPSILON, clip_high=EPSILON)
    groups, rewards = batch(trainer)
    ours = core_gradient(trainer, groups)
    theirs = trl_gradient(trainer.policy, groups, group_advantages(rewards))
    assert ours.keys() == theirs.keys()
    for name in ours:  # float32 sums in another order (packing, shared prompt): relative 1e-4
        assert torch.allclose(ours[name], theirs[name], rtol=1e-4, atol=1e-7), name


def test_the_advantages_differ_by_one_named_factor_per_group():
    rewards = [[0.5, 0.0, 0.5, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]
    ours, theirs = group_advantages(rewards), trl_advantages(rewards)
    for g, ours_g, theirs_g in zip(rewards, ours, theirs):
        m = sum(g) / len(g)
        pop = math.sqrt(sum((r - m) ** 2 for r in g) / len(g))
        factor = (pop + 1e-6) / (nanstd(g) + TRL_STD_EPS)
        assert theirs_g == pytest.approx([a * factor for a in ours_g], rel=1e-9, abs=1e-12)
    assert ours[2] == [0.0] * 4 and theirs[2] == [0.0] * 4  # a tied group has no signal on either side


def test_the_first_update_equals_trls_adamw_step_after_clipping():
    trainer = tiny_trainer(lr=LR, clip_low=EPSILON, clip_high=EPSILON, grad_clip=1.0)
    groups, rewards = batch(trainer)
    before = weights(trainer.policy)
    theirs = trl_gradient(trainer.policy, groups, trl_advantages(rewards))
    params = dict(trainer.policy.named_parameters())
    twin = {n: torch.nn.Parameter(before[n].clone()) for n in theirs}
    for n, p in twin.items():
        p.grad = theirs[n]
    torch.nn.utils.clip_grad_norm_(list(twin.values()), 1.0)
    torch.optim.AdamW(list(twin.values()), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0).step()
    trainer.policy.zero_grad(set_to_none=True)
    metrics = trainer.step(groups)
    assert metrics["train/updated"] == 1.0
    for n, p in twin.items():
        ours, trl = params[n].detach() - before[n], p.detach() - before[n]
        # AdamW's first step is lr * g / (|g| + eps) elementwise: the advantage factor cancels except
        # where |g| is near eps; 2% of lr bounds that on this batch.
        assert (ours - trl).abs().max().item() <= 0.02 * LR, n


def test_the_cores_adamw_has_trls_settings():
    group = tiny_trainer(lr=LR).optimizer.param_groups[0]
    assert (group["betas"], group["eps"], group["weight_decay"], group["lr"]) == ((0.9, 0.999), 1e-8, 0.0, LR)


def stepped_then_tied(mode: str):
    """A trainer after one real step, its weights, and the weights of a twin AdamW that then takes TRL's step
    on a batch without signal: `optimizer.step()` on a zero gradient (zero, not absent)."""
    trainer = tiny_trainer(lr=LR, no_signal_steps=mode)
    groups, _ = batch(trainer)
    trainer.step(groups)  # a real step: AdamW now has moments
    twin = [torch.nn.Parameter(p.detach().clone()) for p in trainer.master.params]
    twin_opt = torch.optim.AdamW(twin, lr=LR, weight_decay=0.0)
    twin_opt.load_state_dict(copy.deepcopy(trainer.optimizer.state_dict()))  # its own moments, not shared
    for p in twin:
        p.grad = torch.zeros_like(p)
    twin_opt.step()
    before = weights(trainer.policy)
    tied = [[make_episode(trainer.policy, f"t-{i}", [t], 1.0) for i, t in enumerate(CANDIDATES)]]
    return trainer, before, twin, trainer.step(tied)


def test_a_batch_without_signal_moves_the_weights_by_adams_momentum_exactly_as_trls_optimizer_does():
    trainer, before, twin, metrics = stepped_then_tied("momentum")
    assert metrics["train/tokens"] == 0.0  # nothing went through the model
    assert metrics["train/updated"] == 1.0  # so the run loop bumps the weight version
    assert all(not torch.equal(p.detach(), before[n]) for n, p in trainer.policy.named_parameters())
    for p, t in zip(trainer.master.params, twin):
        assert torch.allclose(p.detach(), t.detach(), rtol=0, atol=1e-7)


def test_no_signal_steps_skip_leaves_weights_and_moments_alone_as_the_core_did_before():
    trainer, before, twin, metrics = stepped_then_tied("skip")
    assert metrics["train/updated"] == 0.0
    assert all(torch.equal(p.detach(), before[n]) for n, p in trainer.policy.named_parameters())
    assert not all(torch.equal(p.detach(), t.detach()) for p, t in zip(trainer.master.params, twin))  # TRL's moved
