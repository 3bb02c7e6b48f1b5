"""A run checkpoint's DCP folder read by a trainer that is not sharded (core/train/sharded_checkpoint.py
`resolve`), in one process without ranks: what a world-size-1 or replicated resume of an fsdp2 run's
checkpoint does. The single-trainer state it reads whole holds the saved AdamW moments; a folder
whose tensors do not fit the model is refused naming the tensor, before anything is read; and a
trainer.pt naming any folder but its own is refused.
"""

from __future__ import annotations

import pytest
import torch

from core.models import build_tiny
from core.train import sharded_checkpoint
from core.train.rng import rng_state
from core.train.trainer import Trainer, seed_everything
from tests.core.test_distributed_trainer import CFG, groups_for
from tests.core.test_trainer import MODEL


def _saved(folder, trainer: Trainer) -> dict:
    """What an fsdp2 trainer's `save_run` leaves: the DCP folder, and trainer.pt's small state naming it."""
    sharded_checkpoint.save(trainer, str(folder / sharded_checkpoint.RUN_DIR))
    return {"step": trainer.step_count, "rng": rng_state(), sharded_checkpoint.DCP: sharded_checkpoint.RUN_DIR}


def test_a_dcp_run_checkpoint_resolves_to_the_whole_single_trainer_state_for_one_rank(tmp_path):
    seed_everything(0)
    trained = Trainer(build_tiny(0)[0], CFG, MODEL, lora=False)
    trained.step(groups_for(trained.policy))
    small = _saved(tmp_path, trained)
    resumed = Trainer(build_tiny(1)[0], CFG, MODEL, lora=False)
    state = sharded_checkpoint.resolve(small, tmp_path, resumed)
    resumed.load_state_dict(state)
    assert resumed.step_count == 1
    want = trained.optimizer.state_dict()["state"]
    got = resumed.optimizer.state_dict()["state"]
    assert got.keys() == want.keys() and want
    for index in want:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(got[index][key], want[index][key]), (index, key)


def test_a_dcp_folder_of_another_model_is_refused_naming_the_tensor(tmp_path):
    small = _saved(tmp_path, Trainer(torch.nn.Linear(3, 4), CFG, MODEL, lora=False))
    other = Trainer(torch.nn.Linear(3, 5), CFG, MODEL, lora=False)
    with pytest.raises(ValueError, match=r"model.weight: saved shape \(4, 3\) does not fit the trainer's \(5, 3\)"):
        sharded_checkpoint.resolve(small, tmp_path, other)


def test_a_trainer_state_naming_another_folder_is_refused(tmp_path):
    trainer = Trainer(torch.nn.Linear(3, 4), CFG, MODEL, lora=False)
    small = {**_saved(tmp_path, trainer), sharded_checkpoint.DCP: "../elsewhere"}
    with pytest.raises(ValueError, match="names the sharded folder '../elsewhere'"):
        sharded_checkpoint.resolve(small, tmp_path, trainer)
