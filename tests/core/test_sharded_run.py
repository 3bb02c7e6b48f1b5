"""A whole run whose trainer is FSDP2 over 2 gloo ranks (`trainer: {world_size: 2, sharding: fsdp2}`).

The config of tests/core/test_replica_run.py without replicas (one in-process engine, which reads
rank 0's full module), so it is cheap: two steps over HTTP with multi-turn clients, the engine
serving each new version; its checkpoint is DCP shards (each rank writes its own, no rank gathers the
optimizer state), resumed at world size 1 with the same weights and AdamW moments for one more step.
"""

from __future__ import annotations

import pytest
import torch

from core.run import checkpoint
from core.run.loop import CoreRun
from core.train.sharded import ShardedTrainer
from tests.core.test_replica_run import config
from tests.support import train_in_process

pytestmark = pytest.mark.timeout(600)  # spawns a rank; a collective that hangs would wait 600 s more
STEPS = 2


def test_an_fsdp2_run_trains_serves_its_versions_and_resumes_at_world_size_one(tmp_path):
    cfg = config(tmp_path, trainer={"world_size": 2, "sharding": "fsdp2"})
    cfg.trainer.steps = STEPS
    core = CoreRun(cfg)
    trainer = core.trainers["policy"]
    assert isinstance(trainer, ShardedTrainer)
    before = [p.detach().clone() for p in trainer.policy.parameters()]
    versions: list[int] = []
    try:
        train_in_process(core, lambda step, metrics: versions.append(core.server.versions()["policy"]))
        assert core.failure is None and core.step == STEPS
        assert versions[-1] >= 1  # the engine serves the weights the shards trained
        # The engine's module is rank 0's full one, gathered from the shards after each step.
        assert core.server.policies["policy"].model is trainer.policy
        assert any(not torch.equal(p, q) for p, q in zip(trainer.policy.parameters(), before))
        trained = {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}
        moments = [s["exp_avg"] for s in trainer.state_dict()["optimizer"]["state"].values()]  # gathered whole
    finally:
        core.server.close()
        trainer.close()
    folder = checkpoint.load_latest(cfg.trainer.checkpoint_dir).path / "models" / "policy"
    assert "optimizer" not in torch.load(folder / checkpoint.TRAINER_STATE, weights_only=True)
    files = sorted(p.name for p in (folder / "sharded").iterdir())  # DCP: each rank wrote its own shards
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    cfg = config(tmp_path)
    cfg.trainer.steps = STEPS + 1
    resumed = CoreRun(cfg)
    try:
        assert resumed.resume() is not None and resumed.step == STEPS
        one = resumed.trainers["policy"]
        assert not isinstance(one, ShardedTrainer)
        for name, p in one.policy.named_parameters():
            torch.testing.assert_close(p, trained[name], rtol=0, atol=0, msg=name)
        got = [s["exp_avg"] for s in one.optimizer.state_dict()["state"].values()]
        assert len(got) == len(moments) > 0 and all(torch.equal(a, b) for a, b in zip(got, moments))
        train_in_process(resumed)
        assert resumed.failure is None and resumed.step == STEPS + 1
    finally:
        resumed.server.close()
