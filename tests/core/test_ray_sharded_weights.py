"""The model actor of an FSDP2 trainer whose model is served by replica actors (core/ray/actors.py,
core/ray/weights.py), built in this process without a Ray cluster (world size 2 on gloo, the tiny
model), with a replica's receiving end (`WeightReceiver`) in a thread.

Until its first step the actor keeps the run's module (a restore loads through it); from then on
it keeps none (meta device), and every send streams from the shards: the replica's weights equal
the shards' (the actor's digest, streamed too) after each step. Two sends from two threads at once,
as the driver's parallel syncs arrive, stream one after another and both arrive whole.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from core.config_io import load_config
from core.engine.groups import free_port
from core.engine.weight_sync import WeightReceiver
from core.models import build_tiny
from core.ray.actors import ModelActor
from core.train.sharded import ShardedTrainer
from tests.core.test_distributed_trainer import groups_for
from tests.core.test_ray_replicas import ROOT
from tests.core.test_weight_sync import TIMEOUT_S

pytestmark = pytest.mark.timeout(300)  # spawns a rank; a collective that hangs would wait far longer


def _joined(actor: ModelActor, key: str) -> WeightReceiver:
    """A replica's end of `key`'s weights group, on a tiny model of other weights, joined and laid out."""
    receiver, port = WeightReceiver(build_tiny(1)[0], "cpu"), free_port()
    joining = threading.Thread(target=receiver.join, args=(port, "gloo", TIMEOUT_S))
    joining.start()
    asyncio.run(actor.host_weights(key, "127.0.0.1", port, "gloo", "cpu"))
    joining.join(TIMEOUT_S)
    receiver.expect(asyncio.run(actor.weights_layout()))
    return receiver


def _send(actor: ModelActor, key: str, receiver: WeightReceiver) -> None:
    receiving = threading.Thread(target=receiver.receive)
    receiving.start()
    asyncio.run(actor.send_weights(key, receiver.layout, TIMEOUT_S))
    receiving.join(TIMEOUT_S)


def test_a_model_actor_of_an_fsdp2_trainer_keeps_no_module_after_its_first_step_and_streams_every_send(tmp_path):
    cfg = load_config(ROOT / "configs/tiny.yaml", [
        f"trainer.checkpoint_dir={tmp_path}",
        "models=[{source: tiny, device: cpu, replicas: 2, trainer: {world_size: 2, sharding: fsdp2}}]"])
    actor = ModelActor(cfg.model_dump(), "policy")
    try:
        asyncio.run(actor.adopt())
        trainer = actor.trainer
        assert isinstance(trainer, ShardedTrainer) and trainer.keeps_module
        base = build_tiny(0)[0]
        replicas = {key: _joined(actor, key) for key in ("a", "b")}
        for _ in range(2):
            if asyncio.run(actor.prepare(groups_for(base))):
                asyncio.run(actor.backward())
                assert asyncio.run(actor.apply(False))
            assert not trainer.keeps_module and all(p.is_meta for p in trainer.policy.parameters())
            sends = [threading.Thread(target=_send, args=(actor, key, r)) for key, r in replicas.items()]
            for t in sends:
                t.start()
            for t in sends:
                t.join(TIMEOUT_S)
            digest = asyncio.run(actor.weights_digest())
            assert [r.digest() for r in replicas.values()] == [digest, digest]
            assert not any(r.torn for r in replicas.values())
    finally:
        asyncio.run(actor.close())
