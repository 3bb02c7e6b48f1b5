"""A bf16 policy trains on fp32 master weights: RL-sized steps accumulate instead of rounding away.

At lr 1e-5 an AdamW step is far below half a bf16 ulp of most weights, so stepping bf16 weights in
place loses it; the trainer steps fp32 copies and rounds them into the model after each step.
"""

from __future__ import annotations

import pytest
import torch

from core.config import TrainerConfig
from core.models import build_tiny
from core.train.trainer import Trainer, prepare_policy, seed_everything
from tests.core.test_trainer import MODEL, x_groups

LR = 1e-5  # the RL learning rate of bench/vs_trl.py and configs/smollm2-*.yaml


def bf16_trainer(dtype: torch.dtype = torch.bfloat16) -> Trainer:
    seed_everything(0)
    model, _ = build_tiny(seed=0)
    return Trainer(prepare_policy(model.to(dtype), None), TrainerConfig(lr=LR), MODEL, lora=False)


def changed_fraction(now: list[torch.Tensor], before: list[torch.Tensor]) -> float:
    return sum(int((a != b).sum()) for a, b in zip(now, before)) / sum(b.numel() for b in before)


def test_a_bf16_policy_keeps_the_update_that_stepping_bf16_weights_would_round_away():
    trainer = bf16_trainer()
    params = list(trainer.master.model_params)
    assert trainer.master.pairs and all(m.dtype == torch.float32 for m in trainer._params)
    before = [p.detach().clone() for p in params]
    prepared = trainer.prepare(x_groups(trainer.policy))
    trainer.backward(prepared)
    # The same gradients stepped on bf16 weights in place, as an optimizer without master weights would.
    in_place = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for q, p in zip(in_place, params):
        q.grad = None if p.grad is None else p.grad.clone()
    torch.optim.AdamW(in_place, lr=LR, weight_decay=trainer.cfg.weight_decay).step()
    assert trainer.apply(prepared)

    masters = [m.detach() for _, m in trainer.master.pairs]
    assert changed_fraction(in_place, before) < 0.2  # most of the bf16 step was rounded away
    assert changed_fraction([m.to(torch.bfloat16) for m in masters], before) < 0.2  # the model's view, the same
    moved = changed_fraction(masters, [b.float() for b in before])
    assert moved > 0.9  # ...while the fp32 copies hold every weight's step
    for p, m in trainer.master.pairs:  # the model runs on the copies, rounded
        assert p.dtype == torch.bfloat16 and torch.equal(p.detach(), m.detach().to(torch.bfloat16))
        assert p.grad is None and m.grad is None

    # Steps accumulate on the copies until they cross a bf16 spacing, so the model's weights move.
    one_step = changed_fraction(params, before)
    for step in range(1, 16):
        trainer.step(x_groups(trainer.policy, step=step))
    assert changed_fraction(params, before) > one_step + 0.1


def test_a_checkpoint_restores_the_master_weights_not_their_rounding():
    trainer = bf16_trainer()
    trainer.step(x_groups(trainer.policy))
    state = trainer.state_dict()
    weights = {k: v.clone() for k, v in trainer.policy.state_dict().items()}

    resumed = bf16_trainer()
    resumed.policy.load_state_dict(weights)  # core.checkpoint loads the weights first, then the trainer
    resumed.load_state_dict(state)
    for (_, saved), (_, loaded) in zip(trainer.master.pairs, resumed.master.pairs):
        assert torch.equal(saved.detach(), loaded.detach())
    assert any(not torch.equal(m.detach(), p.detach().float()) for p, m in resumed.master.pairs)

    # A checkpoint from before master weights existed: the copies start from the loaded weights.
    old = bf16_trainer()
    old.policy.load_state_dict(weights)
    old.load_state_dict({k: v for k, v in state.items() if k != "master"})
    for p, m in old.master.pairs:
        assert torch.equal(m.detach(), p.detach().float())


def test_master_weights_of_another_dtype_are_refused_with_a_reason():
    bf16_state = bf16_trainer().state_dict()
    fp32 = bf16_trainer(torch.float32)
    assert fp32.master.pairs == [] and bf16_state["master"]  # fp32 weights are stepped in place
    with pytest.raises(ValueError, match="do not fit the policy"):
        fp32.load_state_dict(bf16_state)
    with pytest.raises(ValueError, match="do not fit the policy"):
        bf16_trainer().load_state_dict(fp32.state_dict())
