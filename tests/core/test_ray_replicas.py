"""Replicas under Ray placement (core/ray/replicas.py): the replica run's config on a local Ray cluster.

One model with 2 replica actors and 2 trainer ranks (in the model actor), multi-turn client actors:
the run trains to the end, both replica actors serve every new version after each step and hold the
model actor's weights bit for bit (they arrive as one object in Ray's store a sync), both get
episodes, and what trained is whole. The cluster is a throwaway `ray start --head` (tests/ray_cluster.py).
"""

from __future__ import annotations

import pytest
import ray

from core.config_io import load_config
from core.engine.replicas import ReplicaEngine
from core.engine.weight_sync import weights_digest
from core.ray.replicas import RayReplica
from tests.core.turns_agent import TURNS
from tests.ray_cluster import local_ray_cluster

STEPS = 3


@pytest.mark.slow
def test_a_ray_run_serves_rollouts_from_replica_actors_synced_after_every_step(tmp_path):
    from core.run.placement import core_run  # imports Ray's driver: only in the tests that start a cluster

    with local_ray_cluster(num_cpus=2) as (address, _):
        cfg = load_config({
            "placement": {"kind": "ray", "address": address},
            "models": [{"device": "cpu", "replicas": 2, "trainer": {"world_size": 2}, "ray": {"num_cpus": 0.25}}],
            "server": {"port": 0},
            "engine": {"default_max_tokens": 6},
            "trainer": {"steps": STEPS, "batch_groups": 1, "group_size": 2, "max_staleness": 0, "lr": 0.01,
                        "checkpoint_every_s": 0, "checkpoint_dir": str(tmp_path / "ckpt")},
            "clients": [{"agent": "tests.core.turns_agent", "concurrency": 4, "ray": {"num_cpus": 0.25}}],
        })
        core = core_run(cfg)
        engine = core.server.policies["policy"].engine
        assert isinstance(engine, ReplicaEngine) and all(isinstance(r, RayReplica) for r in engine.replicas)
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
            trainer = weights_digest(ray.get(engine.weights()).items())  # the model actor's, as the sync puts them
            digests.append((trainer, [r.weights_digest() for r in engine.replicas]))
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
