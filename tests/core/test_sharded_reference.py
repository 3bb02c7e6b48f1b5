"""The FSDP2 trainer's KL reference (core/train/sharded.py, core/train/meta.py `shard_frozen`), sharded
like the policy, at world size 2 on gloo with the tiny model.

No rank holds the whole reference: each of its parameters on rank 0 is a DTensor shard of about half
the parameter (rank 1 runs the same `_Shard` code). The KL it gives equals one unsharded trainer's,
whose reference is a whole frozen copy: after a first step moves the policy off the reference, the
second step's loss and KL agree to the float tolerance of tests/core/test_sharded_trainer.py.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.distributed.tensor import DTensor

from core.models import build_tiny
from core.train.sharded import ShardedTrainer
from core.train.trainer import Trainer, seed_everything
from tests.core.test_distributed_trainer import CFG, groups_for
from tests.core.test_sharded_trainer import KL_SEED, MC
from tests.core.test_trainer import MODEL

pytestmark = pytest.mark.timeout(300)  # spawns a rank; a collective that hangs would wait far longer


def test_the_kl_reference_is_sharded_on_every_rank_and_gives_the_unsharded_kl():
    seed_everything(0)
    base, _ = build_tiny(KL_SEED)
    cfg = CFG.model_copy(update={"kl_coef": 0.1})
    single = Trainer(copy.deepcopy(base), cfg, MODEL, lora=False)
    fsdp = ShardedTrainer(copy.deepcopy(base), cfg, MC, ["cpu", "cpu"])
    try:
        reference = fsdp.shard.reference
        assert reference is not None
        for (name, p), whole in zip(reference.named_parameters(), base.parameters()):
            assert isinstance(p, DTensor) and p.device_mesh.size() == 2, name
            assert p.to_local().numel() <= math.ceil(whole.shape[0] / 2) * whole[0].numel(), name
        assert not any(p.requires_grad for p in reference.parameters())
        batch = groups_for(base)
        for t in (single, fsdp):  # the first step moves the policy off the reference: the KL then grows
            t.step(batch)
        one, two = single.step(batch), fsdp.step(batch)
        assert one["train/kl"] > 0 and two["train/kl"] == pytest.approx(one["train/kl"], rel=1e-4)
        assert two["train/loss"] == pytest.approx(one["train/loss"], rel=1e-4)
    finally:
        fsdp.close()
