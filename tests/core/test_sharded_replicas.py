"""Replica processes of an FSDP2 trainer's model (world size 2 on gloo, the tiny model, 2 CPU replicas):
every sync streams from the shards (`ShardedTrainer.stream_to`, `core.engine.replica_sync`), one
replica after another, and rank 0 keeps no whole module.

Rank 0's `full_tensor` results are counted: a step makes nothing whole (the old path gathered every
weight into rank 0's module after each step), each sync makes every weight whole once per replica,
one weight at a time; the run's module is on the meta device. Each replica ends a step with the
shards' weights bit for bit. A replica killed while a step runs is restarted and catches up, from the
shards, to the version the others serve; the checkpoint's weights file is written from the shards too.
A whole run so configured (`trainer: {world_size: 2, sharding: fsdp2}`, `replicas: 2`) does the same.
"""

from __future__ import annotations

import copy
import os
import signal

import pytest
import torch
from safetensors.torch import load_file

from core import models
from core.config_io import load_config
from core.engine.replicas import make_model_engine
from core.engine.weight_sync import layout_of, weights_digest, weights_of
from core.run import checkpoint
from core.run.checkpoint import FULL_WEIGHTS, save_trainer
from core.run.loop import CoreRun
from core.train.sharded import ShardedTrainer
from tests.core.test_distributed_trainer import CFG, groups_for
from tests.core.test_replica_run import config
from tests.core.test_replicas import _wait_all_healthy
from tests.core.weight_pairs import count_full_tensors
from tests.support import train_in_process

pytestmark = pytest.mark.timeout(600)  # a rank and two replica processes, restarted once, on a loaded box


def _gathered(trainer: ShardedTrainer) -> dict[str, torch.Tensor]:
    """The shards' weights made whole (the test's own copy, to compare with)."""
    out: dict[str, torch.Tensor] = {}
    trainer.stream_weights(lambda weights: out.update({n: t.full_tensor().clone() for n, t in weights.items()}))
    return out


def _step(trainer: ShardedTrainer, engine, base) -> None:
    """An on-policy step as the run loop drives it: hold and drain, step, sync the new version."""
    engine.hold()
    engine.pause_blocking()
    assert trainer.step(groups_for(base))["train/updated"] == 1.0
    engine.resume(engine.version + 1)


def test_replicas_of_an_fsdp2_trainer_stream_every_sync_and_catch_up_from_the_shards_with_no_module_on_rank_0(
        tmp_path, monkeypatch):
    cfg = load_config({"models": [{"device": "cpu", "replicas": 2}], "trainer": {"max_staleness": 0}})
    mc = cfg.models[0]
    model, tok = models.load(mc)
    base = copy.deepcopy(model)  # the episodes' tokens come from it
    engine = make_model_engine(cfg, mc, model, tok, 256)
    trainer = ShardedTrainer(model, CFG, mc, ["cpu", "cpu"])
    try:
        trainer.stream_to(engine)
        assert not trainer.keeps_module and all(p.is_meta for p in trainer.policy.parameters())
        assert layout_of(weights_of(trainer.policy)) == layout_of(weights_of(base))  # names, shapes, ties kept
        sizes = [p.numel() for p in base.parameters()]
        live = count_full_tensors(monkeypatch)
        for _ in range(2):
            live.update(calls=0, peak=0, now=0)
            _step(trainer, engine, base)
            assert live["calls"] == 2 * len(sizes)  # a stream per replica; the step itself made nothing whole
            assert live["peak"] <= max(sizes) < sum(sizes) / 4  # one weight at a time, never the model
            digest = weights_digest(_gathered(trainer).items())
            assert [r.weights_digest() for r in engine.replicas] == [digest, digest]
        pid = engine.status()[0]["pid"]
        os.kill(pid, signal.SIGKILL)
        _step(trainer, engine, base)  # the lost replica restarts meanwhile; its catch-up waits for the boundary
        _wait_all_healthy(engine)
        rows = engine.status()
        assert rows[0]["pid"] != pid and [r["version"] for r in rows] == [engine.version] * 2
        trained = _gathered(trainer)
        digest = weights_digest(trained.items())
        assert [r.weights_digest() for r in engine.replicas] == [digest, digest]
        assert all(p.is_meta for p in trainer.policy.parameters())
        save_trainer(tmp_path / "policy", trainer)
        saved = load_file(tmp_path / "policy" / FULL_WEIGHTS)
        assert set(trained) <= set(saved)
        for name, t in trained.items():
            assert torch.equal(saved[name], t), name
    finally:
        engine.close()
        trainer.close()


def test_an_fsdp2_run_served_by_replica_processes_alone_keeps_no_module_and_its_replicas_get_the_shards_weights(
        tmp_path):
    cfg = config(tmp_path, replicas=2, trainer={"world_size": 2, "sharding": "fsdp2"})
    cfg.trainer.steps = 2
    core = CoreRun(cfg)
    trainer, engine = core.trainers["policy"], core.server.policies["policy"].engine
    assert isinstance(trainer, ShardedTrainer) and trainer.keeps_module  # until the run trains (after a resume)
    digests: list[tuple[list[str], str]] = []
    try:
        train_in_process(core, lambda step, metrics: digests.append(
            ([r.weights_digest() for r in engine.replicas], weights_digest(_gathered(trainer).items()))))
        assert core.failure is None and core.step == 2 and engine.version >= 1
        assert not trainer.keeps_module and all(p.is_meta for p in trainer.policy.parameters())
        assert len(digests) == 2 and all(got == [want, want] for got, want in digests)
        trained = _gathered(trainer)
    finally:
        core.server.close()
        trainer.close()
    saved = load_file(checkpoint.load_latest(cfg.trainer.checkpoint_dir).path / "models" / "policy" / FULL_WEIGHTS)
    for name, t in trained.items():
        assert torch.equal(saved[name], t), name
