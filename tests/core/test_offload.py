"""A trainer's state offloaded between steps (core/train/offload.py), as CPU can show it.

What moves: the policy's weights, the fp32 master copies, the AdamW moments and the KL reference;
the step counters stay. A CPU machine has one device, so the move itself (and the memory it frees)
is a check of bench/gpu_check.sh; here, what would move, that a CPU trainer moves nothing, and that
a trainer built with offload on a CPU model steps exactly as one without.
"""

from __future__ import annotations

import copy

import torch

from core.config_io import load_config
from core.models import build_tiny
from core.train.distributed import build_trainer
from core.train.offload import HostOffload
from core.train.trainer import Trainer
from tests.core.test_distributed_trainer import CFG, groups_for

def stepped_trainer() -> Trainer:
    """A bf16 tiny model's trainer with a KL reference, after one step: moments and master copies exist."""
    model, _ = build_tiny(0)
    trainer = Trainer(model.to(torch.bfloat16), CFG.model_copy(update={"kl_coef": 0.1}), "policy", lora=False)
    prepared = trainer.prepare(groups_for(build_tiny(0)[0]))
    trainer.backward(prepared)
    assert trainer.apply(prepared)
    return trainer


def test_offload_takes_the_weights_master_copies_reference_and_moments_but_not_the_step_counters():
    trainer = stepped_trainer()
    offload = HostOffload(trainer, "cpu")
    moving = {id(t) for t in offload.parameters()}
    held = [*trainer.policy.parameters(), *(m for _, m in trainer.master.pairs), *trainer.reference.parameters()]
    assert trainer.master.pairs and moving == {id(t) for t in held} and len(offload.parameters()) == len(held)
    moments = offload.moments()
    assert {key for _, key in moments} == {"exp_avg", "exp_avg_sq"}
    assert len(moments) == 2 * len(trainer.optimizer.state)


def test_offload_on_a_cpu_trainer_moves_nothing():
    trainer = stepped_trainer()
    offload = HostOffload(trainer, "cpu")
    offload.to_host()
    assert not offload.on_host


def test_a_trainer_built_with_offload_on_cpu_steps_as_one_without():
    cfg = load_config({"models": [{"device": "cpu", "trainer": {"offload": True}}], "trainer": {"lr": 1e-2}})
    base, _ = build_tiny(0)
    with_offload = build_trainer(copy.deepcopy(base), cfg, cfg.models[0].name)
    plain = Trainer(copy.deepcopy(base), cfg.trainer, cfg.models[0].name, lora=False)
    batch = groups_for(base)
    for t in (with_offload, plain):
        prepared = t.prepare(batch)
        t.backward(prepared)
        assert t.apply(prepared)
    for p, q in zip(with_offload.policy.parameters(), plain.policy.parameters()):
        assert torch.equal(p, q)
