"""A bf16 policy trains on fp32 master weights: RL-sized steps accumulate instead of rounding away.

At lr 1e-5 an AdamW step is far below half a bf16 ulp of most weights, so stepping bf16 weights in
place loses it; the trainer steps fp32 copies and rounds them into the model after each step.
"""

from __future__ import annotations

import pytest
import torch

from core.config import TrainerConfig
from core.models import build_tiny, prepare_policy
from core.run import checkpoint
from core.train.trainer import Trainer, seed_everything
from tests.core.test_trainer import MODEL, x_groups

LR = 1e-5  # the RL learning rate of bench/vs_trl.py and configs/smollm2-*.yaml


def bf16_trainer(dtype: torch.dtype = torch.bfloat16, master_weights: bool = True) -> Trainer:
    seed_everything(0)
    model, _ = build_tiny(seed=0)
    cfg = TrainerConfig(lr=LR, master_weights=master_weights)
    return Trainer(prepare_policy(model.to(dtype), None), cfg, MODEL, lora=False)


def changed_fraction(now: list[torch.Tensor], before: list[torch.Tensor]) -> float:
    return sum(int((a != b).sum()) for a, b in zip(now, before)) / sum(b.numel() for b in before)


def test_a_bf16_policy_keeps_the_update_that_stepping_bf16_weights_would_round_away():
    trainer = bf16_trainer()
    params = list(trainer.policy.parameters())
    assert trainer.master.pairs and all(m.dtype == torch.float32 for m in trainer.master.params)
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
    resumed.policy.load_state_dict(weights)  # core.run.checkpoint loads the weights first, then the trainer
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


def test_a_run_may_resume_in_another_dtype_but_master_weights_of_another_model_are_refused():
    bf16, fp32 = bf16_trainer(), bf16_trainer(torch.float32)
    assert fp32.master.pairs == []  # fp32 weights are stepped in place
    fp32.load_state_dict(bf16.state_dict())  # bf16 -> fp32: the model's weights are what it loaded
    bf16.load_state_dict(fp32.state_dict())  # fp32 -> bf16 (a CPU checkpoint on a GPU): copies of the weights
    for p, m in bf16.master.pairs:
        assert torch.equal(m.detach(), p.detach().float())
    state = bf16.state_dict()
    with pytest.raises(ValueError, match="do not fit the policy"):
        bf16_trainer().load_state_dict({**state, "master": state["master"][:-1]})


def test_without_master_weights_a_bf16_policy_is_stepped_in_place_and_loses_most_of_the_step():
    trainer = bf16_trainer(master_weights=False)
    assert trainer.master.pairs == [] and all(m.dtype == torch.bfloat16 for m in trainer.master.params)
    before = [p.detach().clone() for p in trainer.policy.parameters()]
    for step in range(4):
        trainer.step(x_groups(trainer.policy, step=step))
    assert changed_fraction([p.detach() for p in trainer.policy.parameters()], before) < 0.2


def test_a_checkpoint_round_trip_keeps_the_master_weights_and_a_misfit_is_refused_untouched(tmp_path):
    trainer = bf16_trainer()
    trainer.step(x_groups(trainer.policy))
    folder = checkpoint.save(tmp_path, 1, {MODEL: trainer}, [], {MODEL: 1}, {})
    resumed = bf16_trainer()
    checkpoint.restore(checkpoint.load(folder), {MODEL: resumed})
    for (p, saved), (q, loaded) in zip(trainer.master.pairs, resumed.master.pairs):
        assert torch.equal(saved.detach(), loaded.detach()) and torch.equal(p.detach(), q.detach())

    state_file = folder / "models" / MODEL / checkpoint.TRAINER_STATE
    state = torch.load(state_file, weights_only=True)
    torch.save({**state, "master": state["master"][1:]}, state_file)  # copies of some other model
    other = bf16_trainer()
    before = [p.detach().clone() for p in other.policy.parameters()]
    with pytest.raises(checkpoint.CheckpointError, match="master weights do not fit"):
        checkpoint.restore(checkpoint.load(folder), {MODEL: other})
    assert all(torch.equal(b, p.detach()) for b, p in zip(before, other.policy.parameters()))  # checked before loading
