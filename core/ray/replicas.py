"""Rollout replicas as Ray actors: `models[].replicas` engines of one model spread over a Ray cluster.

`ReplicaActor` is one replica's engine inside a Ray actor (built as a replica process builds it,
`core.engine.replica_child.build_replica`), with its own `models[].ray` reservation (`num_gpus` each).
`RayReplica` is the driver's handle on it, with the replica interface the router
(`core.engine.replicas.ReplicaEngine`) routes over: generate, admission, `sync(weights, version)`,
and health from a heartbeat the handle polls. Weights reach the replicas from the model actor
(rank 0 of the trainer, `ModelActor.weights`, a dict of CPU tensors: LoRA adapters or full weights)
through Ray's object store: the driver puts them once a sync (`ray.put`) and every replica actor gets
the same object reference, which Ray resolves in the actor (one fetch per node, not one copy per
actor). A torch.distributed group between actors on other nodes is not built (the process replicas'
group, `core.engine.weight_sync`, is for one machine).

A replica actor is started with `max_restarts=0`: a dead one is replaced by the router (a new actor,
synced before it is routed to), not restarted by Ray behind its back with initial weights.
Deliberately not here: routing and restarts (the router's), the trainer (the model actor's).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError

from core.config import ModelConfig, RunConfig
from core.engine import EngineLoad, Generation, SamplingParams
from core.engine.process import SILENT_S, START_S, ReplicaHandle, ReplicaLost
from core.engine.replica_child import HEARTBEAT_S, SYNC_S, ReplicaSpec, build_replica
from core.engine.replicas import ReplicaEngine
from core.engine.weight_sync import apply_weights, sync_replica, weights_digest

log = logging.getLogger(__name__)


class ReplicaActor:
    """One replica engine in a Ray actor; every method is async, blocking work runs on a thread."""

    def __init__(self, spec: ReplicaSpec):
        self.engine, self.policy = build_replica(spec)
        self.synced: list[str] = []  # the parameter names the last sync carried

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        return await self.engine.generate(prompt_ids, params)

    async def hold(self) -> None:
        self.engine.hold()

    async def pause(self) -> None:
        await asyncio.to_thread(self.engine.pause_blocking)

    async def resume(self, new_version: int | None) -> None:
        self.engine.resume(new_version)

    async def sync(self, weights: dict[str, torch.Tensor], version: int) -> int:
        """`weights` arrive resolved from the object reference the driver passed (Ray fetches it)."""
        if not isinstance(weights, dict):
            raise TypeError(f"a replica sync takes a dict of tensors, got {type(weights).__name__}")
        self.synced = list(weights)
        return await asyncio.to_thread(sync_replica, self.engine, lambda: apply_weights(self.policy, weights), version)

    async def weights_digest(self) -> str:
        """`weights_digest` of the parameters the last sync named, as this replica holds them."""
        params = dict(self.policy.named_parameters())
        return weights_digest((n, params[n]) for n in self.synced)

    async def beat(self) -> tuple[int, dict, int]:
        return self.engine.version, asdict(self.engine.load()), os.getpid()

    async def close(self) -> None:
        self.engine.close()


class RayReplica(ReplicaHandle):
    """The driver's handle on one `ReplicaActor` (the replica interface of `core.engine.replicas`)."""

    def __init__(self, spec: ReplicaSpec, resources: dict[str, Any], hang_s: float,
                 on_lost: Callable[[RayReplica, str], None]):
        self.spec, self.hang_s, self.on_lost = spec, hang_s, on_lost
        self.device = spec.model["device"]
        self.max_context = spec.max_context
        self.lost: str | None = None
        self.inflight = 0
        self._lock = threading.Lock()
        self._load = EngineLoad(queued=0, active=0, admitting=True, oldest_s=None)
        self.actor = ray.remote(ReplicaActor).options(max_restarts=0, **resources).remote(spec)
        try:
            self.version, load, self.pid = ray.get(self.actor.beat.remote(), timeout=START_S)
        except (RayActorError, GetTimeoutError) as e:
            ray.kill(self.actor)
            raise ReplicaLost(f"replica actor {spec.index} could not start: {e}") from e
        self._load = EngineLoad(**load)
        self._beat = time.monotonic()
        threading.Thread(target=self._watch, name=f"ray-replica-{spec.index}", daemon=True).start()

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       on_token: Callable[[int], None] | None = None) -> Generation:
        self.in_service()
        self.inflight += 1
        try:
            gen: Generation = await self.actor.generate.remote(list(prompt_ids), params)
        except RayActorError as e:
            self.kill(f"its actor died: {e}")
            raise ReplicaLost(f"replica {self.spec.index} was lost: {e}") from e
        finally:
            self.inflight -= 1
        for token in gen.token_ids if on_token is not None else ():  # tokens arrive with the generation
            on_token(token)
        gen.timings["replica"] = float(self.spec.index)
        return gen

    def hold(self) -> None:
        self._call("hold")

    def pause_blocking(self) -> None:
        self._call("pause")

    def resume(self, new_version: int | None = None) -> None:
        self._call("resume", new_version)

    def sync(self, weights: ray.ObjectRef, version: int) -> int:
        """`weights`: the one object reference of this sync, the same for every replica actor."""
        self.version = self._call("sync", weights, version)
        return self.version

    def weights_digest(self) -> str:
        return self._call("weights_digest")

    def kill(self, why: str) -> None:
        with self._lock:
            if self.lost:
                return
            self.lost = why
        log.error("replica actor %d (%s) lost: %s", self.spec.index, self.device, why)
        ray.kill(self.actor, no_restart=True)
        self.on_lost(self, why)

    def close(self) -> None:
        with self._lock:
            self.lost = self.lost or "closed"
        try:
            ray.get(self.actor.close.remote(), timeout=30)
        except Exception as e:  # noqa: BLE001 - a dead actor has nothing left to close
            log.info("closing replica actor %d: %s", self.spec.index, e)
        ray.kill(self.actor, no_restart=True)

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return ray.get(getattr(self.actor, method).remote(*args), timeout=SYNC_S)
        except (RayActorError, GetTimeoutError) as e:
            self.kill(f"{method} failed: {e}")
            raise ReplicaLost(f"replica {self.spec.index} was lost during {method}: {e}") from e

    def _watch(self) -> None:
        while not self.lost:
            try:
                self.version, load, _ = ray.get(self.actor.beat.remote(), timeout=SILENT_S)
                self._load, self._beat = EngineLoad(**load), time.monotonic()
            except (RayActorError, GetTimeoutError) as e:
                if not self.lost:
                    self.kill(f"its heartbeat failed: {e}")
                return
            time.sleep(HEARTBEAT_S)


def ray_replicas(cfg: RunConfig, mc: ModelConfig, weights: Callable[[], dict], max_context: int,
                 on_lost: Callable[[list[str]], None] | None = None,
                 is_open: Callable[[str], bool] | None = None) -> ReplicaEngine:
    """`mc.replicas` replica actors behind one router; each reserves `models[].ray.num_cpus`, one GPU for a
    model on cuda (the actor then sees it as cuda:0), and `models[].ray.resources`. `weights()`: the
    trainer's trainable weights (the model actor's), put in the object store once a sync; `on_lost`,
    `is_open`: as `core.engine.replicas.ReplicaEngine` takes them."""
    on_gpu = mc.device.startswith("cuda") or mc.ray.num_gpus > 0
    resources = {"num_cpus": mc.ray.num_cpus, "num_gpus": 1 if on_gpu else 0, "resources": mc.ray.resources or None,
                 "max_concurrency": max(cfg.server.max_open_episodes, 64)}

    def start(i: int, on_lost: Callable) -> RayReplica:
        spec = ReplicaSpec(index=i, model=mc.model_copy(update={"device": "cuda:0" if on_gpu else "cpu"}).model_dump(),
                           engine=cfg.engine.model_dump(), max_context=max_context, seed=cfg.trainer.seed + i)
        return RayReplica(spec, resources, cfg.server.request_timeout_s, on_lost)

    return ReplicaEngine(lambda: ray.put(weights()), start, mc.replicas, cfg.trainer.max_staleness, max_context,
                         route_wait_s=cfg.server.request_timeout_s, on_lost=on_lost, is_open=is_open)
