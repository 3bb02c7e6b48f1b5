"""Through the run loop: a batch without signal after a real step takes AdamW's momentum step (as TRL's
optimizer does, tests/core/test_trl_parity.py), so the weights change and the version goes up, both when
the step drains the engine and when it overlaps generation; with `no_signal_steps: skip` nothing changes."""

from __future__ import annotations

import pytest
import torch

from core.config_io import load_config
from core.run.loop import CoreRun
from tests.core.test_run_loop import GROUP, finish_group, train_one


def run_with(tmp_path, mode: str, staleness: int) -> CoreRun:
    cfg = load_config(overrides=["server.port=0", "trainer.batch_groups=1", f"trainer.group_size={GROUP}",
                                 "trainer.steps=1", f"trainer.max_staleness={staleness}", "trainer.lr=0.01",
                                 f"trainer.no_signal_steps={mode}", f"trainer.checkpoint_dir={tmp_path / 'ckpt'}"])
    return CoreRun(cfg)


def weights(core: CoreRun) -> list[torch.Tensor]:
    return [p.detach().clone() for p in core.trainers["policy"].policy.parameters()]


@pytest.mark.parametrize("staleness", [0, 1], ids=["drain", "overlap"])
def test_a_batch_without_signal_after_a_real_step_moves_the_weights_and_bumps_the_version(tmp_path, staleness):
    core = run_with(tmp_path, "momentum", staleness)
    try:
        finish_group(core, [1.0, 0.0])
        assert train_one(core)["train/updated"] == 1.0
        version, before = core.server.versions()["policy"], weights(core)
        finish_group(core, [1.0, 1.0])  # tied: every advantage zero
        metrics = train_one(core)
        assert metrics["train/updated"] == 1.0 and metrics["train/tokens"] == 0.0
        assert core.server.versions()["policy"] == version + 1
        assert any(not torch.equal(a, b) for a, b in zip(before, weights(core)))
    finally:
        core.server.close()


def test_with_skip_a_batch_without_signal_keeps_weights_and_version(tmp_path):
    core = run_with(tmp_path, "skip", 0)
    try:
        finish_group(core, [1.0, 0.0])
        train_one(core)
        version, before = core.server.versions()["policy"], weights(core)
        finish_group(core, [1.0, 1.0])
        assert train_one(core)["train/updated"] == 0.0
        assert core.server.versions()["policy"] == version
        assert all(torch.equal(a, b) for a, b in zip(before, weights(core)))
    finally:
        core.server.close()
