"""Rollout replicas as Ray actors: `models[].replicas` engines of one model spread over a Ray cluster.

`ReplicaActor` is one replica's engine inside a Ray actor (built as a replica process builds it,
`core.engine.replica_child.build_replica`), with its own `models[].ray` reservation (`num_gpus` each).
`RayReplica` is the driver's handle on it, with the replica interface the router
(`core.engine.replicas.ReplicaEngine`) routes over: generate, admission, `sync(layout, version)`,
and health from a heartbeat the handle polls.

Weights reach a replica actor as they reach a replica process (`core.engine.weight_sync`): over a
process group of two, the model actor (rank 0, which holds the trainer's module and builds no engine
of its own, `core.ray.weights.WeightHost`) and the replica actor (rank 1, a `WeightReceiver`), built
when the replica actor starts: the handle asks the model actor for its node's address and a free
port, and has both actors join there. NCCL when both are on GPUs (each actor sees its own as cuda:0;
a replica reserves a whole GPU, so the two are distinct), gloo otherwise. A sync is: the layout
(names, shapes, dtypes) to the replica when it changed, then the model actor's broadcast and the
replica's receive at once, under one deadline (SYNC_S). Nothing goes through Ray's object store:
per sync the driver sends the layout (once) and two small calls. A transfer that fails or hangs (the
replica died, or its actor stopped answering) leaves that group out of step: the replica actor is
killed and its group dropped, and the router starts a new actor with a new group; the other
replicas' groups never wait on it.

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
import uuid
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from core.config import ModelConfig, RunConfig
from core.engine import EngineLoad, Generation, SamplingParams
from core.engine.process import SILENT_S, START_S, ReplicaHandle, ReplicaLost
from core.engine.replica_child import GROUP_FACTOR, HEARTBEAT_S, SYNC_S, ReplicaSpec, build_replica, replica_receiver
from core.engine.replicas import ReplicaEngine
from core.engine.weight_sync import Layout, sync_replica

log = logging.getLogger(__name__)


class ReplicaActor:
    """One replica engine in a Ray actor; every method is async, blocking work runs on a thread."""

    def __init__(self, spec: ReplicaSpec):
        # As a replica process: a vLLM replica keeps no module copy, a full fine-tune's buckets go into vLLM.
        self.engine, self.policy = build_replica(spec, stream_weights=True)
        self.receiver = replica_receiver(self.engine, self.policy, spec.model["device"])

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        return await self.engine.generate(prompt_ids, params)

    async def hold(self) -> None:
        self.engine.hold()

    async def pause(self) -> None:
        await asyncio.to_thread(self.engine.pause_blocking)

    async def resume(self, new_version: int | None) -> None:
        self.engine.resume(new_version)

    async def join_weights(self, host: str, port: int, backend: str) -> str:
        """Rank 1 of this replica's weights group, hosted by the model actor at `host`:`port`."""
        return await asyncio.to_thread(self.receiver.join, port, backend, GROUP_FACTOR * SYNC_S, host)

    async def expect(self, layout: Layout) -> str:
        """Check the layout against the module (raises naming the parameter) and take it for the syncs."""
        return self.receiver.expect(layout)

    async def sync(self, version: int) -> int:
        """Receive the weights the model actor broadcasts now, between two decode steps; serve `version`.
        A receive torn part-way (part old, part new weights) ends this actor: it must never serve them."""
        try:
            return await asyncio.to_thread(sync_replica, self.engine, self.receiver.receive, version)
        except Exception:
            if self.receiver.torn:
                os._exit(1)  # the handle sees the actor die and the router starts a new one
            raise

    async def weights_digest(self) -> str:
        """`weights_digest` of the parameters the layout names, as this replica holds them."""
        return self.receiver.digest()

    async def beat(self) -> tuple[int, dict, int]:
        return self.engine.version, asdict(self.engine.load()), os.getpid()

    async def close(self) -> None:
        self.engine.close()


class RayReplica(ReplicaHandle):
    """The driver's handle on one `ReplicaActor` (the replica interface of `core.engine.replicas`)."""

    def __init__(self, spec: ReplicaSpec, resources: dict[str, Any], hang_s: float,
                 on_lost: Callable[[RayReplica, str], None], source: Any, backend: str):
        """`source`: the model actor's handle (it hosts the weights group); `backend`: the group's."""
        self.spec, self.hang_s, self.on_lost = spec, hang_s, on_lost
        self.source, self.backend = source, backend
        self.key = f"{spec.index}-{uuid.uuid4().hex[:8]}"  # this actor's group at the model actor
        self.layout: Layout | None = None  # the one the replica accepted
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
        self._join_weights_group()
        threading.Thread(target=self._watch, name=f"ray-replica-{spec.index}", daemon=True).start()

    def _join_weights_group(self) -> None:
        """The model actor hosts this replica's group while the replica actor joins it; either failing kills it."""
        try:
            host, port = ray.get(self.source.weights_address.remote(), timeout=START_S)
            both([self.source.host_weights.remote(self.key, host, port, self.backend, self.device),
                  self.actor.join_weights.remote(host, port, self.backend)], START_S)
        except Exception as e:  # noqa: BLE001 - dead, hung or refused: this replica cannot take weights
            self.kill(f"could not join its weights group: {e}")
            raise ReplicaLost(f"replica actor {self.spec.index} could not start: {self.lost}") from e

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

    def sync(self, layout: Layout, version: int) -> int:
        """The trainer's weights (laid out as `layout`, the model actor's) to the replica, which serves
        `version` from its next decode step; returns the version it serves. The layout goes first when
        it changed: refused, nothing is sent. The model actor's broadcast and the replica's receive run
        at once under one deadline; a failure or hang of either kills the replica (`ReplicaLost`)."""
        self.in_service()
        if layout != self.layout:
            self.layout = None
            self._call("expect", layout)
            self.layout = layout
        try:
            _, served = both([self.source.send_weights.remote(self.key, layout, SYNC_S),
                              self.actor.sync.remote(version)], SYNC_S)
        except (RayActorError, RayTaskError, GetTimeoutError) as e:  # the group is out of step now
            self.kill(f"the weight transfer failed: {type(e).__name__}: {e}")
            raise ReplicaLost(f"replica {self.spec.index} was lost during a weight transfer: {e}") from e
        self.version = served
        return served

    def weights_digest(self) -> str:
        return self._call("weights_digest")

    def kill(self, why: str) -> None:
        with self._lock:
            if self.lost:
                return
            self.lost = why
        log.error("replica actor %d (%s) lost: %s", self.spec.index, self.device, why)
        ray.kill(self.actor, no_restart=True)
        self.source.drop_weights.remote(self.key)  # its end of the group too (aborted: nothing left pending)
        self.on_lost(self, why)

    def close(self) -> None:
        with self._lock:
            self.lost = self.lost or "closed"
        try:
            ray.get(self.actor.close.remote(), timeout=30)
        except Exception as e:  # noqa: BLE001 - a dead actor has nothing left to close
            log.info("closing replica actor %d: %s", self.spec.index, e)
        ray.kill(self.actor, no_restart=True)
        self.source.drop_weights.remote(self.key)

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


def both(refs: list[ray.ObjectRef], timeout_s: float) -> list[Any]:
    """The results of the two ends of one collective, in order; the first failure of either is raised at
    once (the other end may be blocked on it), GetTimeoutError when both are not done by `timeout_s`."""
    deadline, pending = time.monotonic() + timeout_s, list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not done:
            raise GetTimeoutError(f"the two ends did not finish within {timeout_s:g} s")
        ray.get(done[0])  # raises that end's failure now
    return ray.get(list(refs))


def ray_replicas(cfg: RunConfig, mc: ModelConfig, source: Any, layout: Callable[[], Layout], max_context: int,
                 on_lost: Callable[[list[str]], None] | None = None,
                 is_open: Callable[[str], bool] | None = None) -> ReplicaEngine:
    """`mc.replicas` replica actors behind one router; each reserves `models[].ray.num_cpus`, one GPU for a
    model on cuda (the actor then sees it as cuda:0), and `models[].ray.resources`. `source`: the model
    actor (it sends the weights over each replica's group); `layout()`: the model actor's weights layout,
    asked once a sync (the driver's call, which restores a lost model actor first); `on_lost`, `is_open`:
    as `core.engine.replicas.ReplicaEngine` takes them."""
    on_gpu = mc.device.startswith("cuda") or mc.ray.num_gpus > 0
    backend = "nccl" if on_gpu else "gloo"  # the model actor is on a GPU too then; a replica's is its own
    resources = {"num_cpus": mc.ray.num_cpus, "num_gpus": 1 if on_gpu else 0, "resources": mc.ray.resources or None,
                 "max_concurrency": max(cfg.server.max_open_episodes, 64)}

    def start(i: int, on_lost: Callable) -> RayReplica:
        spec = ReplicaSpec(index=i, model=mc.model_copy(update={"device": "cuda:0" if on_gpu else "cpu"}).model_dump(),
                           engine=cfg.engine.model_dump(), max_context=max_context, seed=cfg.trainer.seed + i)
        return RayReplica(spec, resources, cfg.server.request_timeout_s, on_lost, source, backend)

    return ReplicaEngine(layout, start, mc.replicas, cfg.trainer.max_staleness, max_context,
                         route_wait_s=cfg.server.request_timeout_s, on_lost=on_lost, is_open=is_open)
