"""Replicas under Ray placement (core/ray/replicas.py): the replica run's config on a local Ray cluster.

A model with replicas has a model actor that holds the trainer and no engine of its own; its replica
actors take the weights from it over a process group of two each (gloo here, on CPU), never through
Ray's object store. One model with 2 replica actors and 2 trainer ranks (in the model actor),
multi-turn client actors: the run trains to the end, both replica actors serve every new version
after each step and hold the model actor's weights bit for bit, both get episodes, and what trained
is whole. A replica actor killed, or stopped (hung), as a sync starts is replaced (a new actor, a
new group) while the other replica and the run go on. The cluster is a throwaway `ray start --head` (tests/ray_cluster.py), shared by the module.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
import ray

from core.config_io import load_config
from core.engine import SamplingParams
from core.engine.replicas import ReplicaEngine
from core.ray.actors import ModelActor
from core.ray import replicas
from core.ray.replicas import RayReplica
from tests.core.turns_agent import TURNS
from tests.ray_cluster import local_ray_cluster

STEPS = 3
HUNG_SYNC_S = 20.0  # the sync's deadline in the hang test: above a sync's time on a busy host, below SILENT_S
BACK_S = 180.0  # how long a replaced replica actor may take to start and catch up on a busy 2-core host
ROOT = Path(__file__).resolve().parents[2]


def replica_run_config(address: str, tmp_path: Path, steps: int = STEPS):
    return load_config({
        "placement": {"kind": "ray", "address": address},
        "models": [{"device": "cpu", "replicas": 2, "trainer": {"world_size": 2}, "ray": {"num_cpus": 0.25}}],
        "server": {"port": 0},
        "engine": {"default_max_tokens": 6},
        "trainer": {"steps": steps, "batch_groups": 1, "group_size": 2, "max_staleness": 0, "lr": 0.01,
                    "checkpoint_every_s": 0, "checkpoint_dir": str(tmp_path / "ckpt")},
        "clients": [{"agent": "tests.core.turns_agent", "concurrency": 4, "ray": {"num_cpus": 0.25}}],
    })


@pytest.fixture(scope="module")
def ray_address():
    with local_ray_cluster(num_cpus=2) as (address, _):
        yield address


@pytest.fixture
def puts(monkeypatch):
    """Every `ray.put` the driver makes, counted (the object-store path put the weights once a sync)."""
    made: list[type] = []
    put = ray.put

    def counting(value, *args, **kwargs):
        made.append(type(value))
        return put(value, *args, **kwargs)

    monkeypatch.setattr(ray, "put", counting)
    return made


def test_a_model_actor_with_replicas_builds_no_engine_of_its_own(tmp_path):
    # The in-process engine took GPU memory and torch.distributed's default group beside the trainer
    # (so a sharded trainer refused to start); with replicas the actor only trains and sends weights.
    cfg = load_config(ROOT / "configs/tiny.yaml", [f"trainer.checkpoint_dir={tmp_path}", "models=[{source: tiny, replicas: 2}]"])
    actor = ModelActor(cfg.model_dump(), "policy")
    try:
        info = asyncio.run(actor.adopt())
        assert actor.engine is None and info["engine"] is None and info["trainable"] is True
        assert info["max_context"] > 0 and info["version"] == 0
        assert asyncio.run(actor.resume(3)) == 3 and asyncio.run(actor.info())["version"] == 3
        assert asyncio.run(actor.weights_layout())  # what a sync sends: the trainable weights' layout
        with pytest.raises(RuntimeError, match="generates on its replica actors"):
            asyncio.run(actor.generate([1, 2, 3], SamplingParams(max_tokens=2)))
    finally:
        asyncio.run(actor.close())


@pytest.mark.slow
def test_a_ray_run_syncs_replica_actors_over_process_groups_after_every_step(ray_address, tmp_path, puts):
    from core.run.placement import core_run  # imports Ray's driver: only in the tests that start a cluster

    core = core_run(replica_run_config(ray_address, tmp_path))
    engine = core.server.policies["policy"].engine
    assert isinstance(engine, ReplicaEngine) and all(isinstance(r, RayReplica) for r in engine.replicas)
    link = core.trainers["policy"].link
    model_actor = link.call("info")
    assert model_actor["engine"] is None  # the model actor trains and sends; only the replica actors serve
    assert len(model_actor["weights_groups"]) == 2  # one group per replica actor, hosted by the model actor
    seen: list[tuple[int, list[int | None]]] = []
    digests: list[tuple[str, list[str]]] = []
    trained = []
    train_batch = core._train_batch

    def observed(batch):
        trained.extend(batch.episodes)
        return train_batch(batch)

    core._train_batch = observed
    last: list[dict] = []

    def on_step(step, metrics):
        rows = engine.status()
        seen.append((core.server.versions()["policy"], [r["version"] for r in rows]))
        digests.append((link.call("weights_digest"), [r.weights_digest() for r in engine.replicas]))
        last[:] = rows

    try:
        core.server.start()
        core.start_clients()
        core.train(on_step=on_step)
        core.stop_clients()
    finally:
        core.server.close()
    assert core.failure is None and core.step == STEPS
    assert all(replicas == [version, version] for version, replicas in seen), seen
    assert len(digests) == STEPS and all(replicas == [trainer] * 2 for trainer, replicas in digests)
    assert seen[-1][0] >= 1
    assert all(r["episodes_total"] > 0 and r["healthy"] for r in last)
    assert trained and all(e.state == "finished" and len(e.calls_of("policy")) == TURNS for e in trained)
    assert puts == []  # no weights (nor anything else) went into the object store: the groups carried them


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_a_replica_actor_killed_or_hung_in_a_sync_alone_is_replaced_and_the_run_goes_on(ray_address, tmp_path,
                                                                                       monkeypatch, sig):
    from core.run.placement import core_run

    # A hung replica is found by the sync's deadline (its heartbeat would wait SILENT_S, 60 s).
    monkeypatch.setattr(replicas, "SYNC_S", HUNG_SYNC_S)
    core = core_run(replica_run_config(ray_address, tmp_path, steps=4))
    engine = core.server.policies["policy"].engine
    link = core.trainers["policy"].link
    first, other = engine.replicas
    other_pid = other.pid
    killed: list[int] = []
    sync = first.sync

    def dying_sync(layout, version):  # SIGKILL (or SIGSTOP) the replica actor's process as its sync starts
        if not killed and version >= 1:
            killed.append(first.pid)
            os.kill(first.pid, sig)
        return sync(layout, version)

    first.sync = dying_sync
    try:
        core.server.start()
        core.start_clients()
        core.train()
        deadline = time.monotonic() + BACK_S
        while engine.replicas[0] is None and time.monotonic() < deadline:
            time.sleep(0.5)  # restarted in the background; the run did not wait for it
        back, rows, still = engine.replicas[0], engine.status(), (engine.replicas[1], other.lost, other.pid)
        groups = link.call("info")["weights_groups"]
        digests = {link.call("weights_digest")} | {r.weights_digest() for r in engine.replicas if r is not None}
        core.stop_clients()
    finally:
        core.server.close()
    assert killed and core.failure is None and core.step == 4  # the run went on past the lost replica
    assert first.lost  # found dead by the transfer or its heartbeat, whichever came first: killed, not behind
    if sig == signal.SIGSTOP:  # alive but silent: only the transfer's deadline finds it (then it is killed)
        assert "weight transfer failed: GetTimeoutError" in first.lost, first.lost
    assert still == (other, None, other_pid)  # only that replica went: the other kept its actor and group
    assert back is not None and back is not first and back.pid != killed[0]
    # The new actor joined a new group; the dead one's was dropped by the model actor.
    assert sorted(groups) == sorted(r.key for r in engine.replicas) and first.key not in groups
    version = core.server.versions()["policy"]
    assert [r["version"] for r in rows] == [version, version] and all(r["healthy"] for r in rows)
    assert len(digests) == 1  # both replica actors hold the model actor's weights bit for bit
