"""Rollout replicas of one model behind one `Engine`: sticky routing by episode, weight sync, faults.

`ReplicaEngine` is what the gateway sees when `models[].replicas` is 2 or more. It reads the
trainer's weights through a callable (rank 0's module, updated in place and never generating, or
the model actor under Ray) and holds N replica engines, each a process on its own device (`core.engine.process.ProcessEngine`) or, under Ray
placement, an actor (`core.ray.replicas`), anything with the replica methods used here.

Routing. Each call's episode is the `core.engine.routing.EPISODE` context variable (set where the
request's key resolves to its episode). The first
call of an episode goes to the least loaded replica (fewest open episodes pinned to it, then
fewest requests in flight) among those that are healthy and serve a version within
`max_staleness` of the trainer's; every later call of the episode goes to the same replica, so its
prefix (KV) cache serves the next turn. A call without an episode is routed but not pinned.

Weight sync. The run loop drives this engine as it drives a local one: `hold`/`pause_blocking`
before a step, `resume(version)` after it (on-policy), or `swap_weights(apply)` (overlapped).
When the version moves, the trainer's trainable parameters are sent to every replica (in parallel,
or one after another when streamed from an FSDP2 trainer's shards, `core.engine.replica_sync`:
a broadcast over each replica's own group, `core.engine.weight_sync`: from this process to a replica
process, from the model actor to a replica actor under Ray), which then reports the new version; a replica that does not
is a `ReplicaBehind` error, raised to the loop: the run fails loudly instead of training on while
inference serves old weights. Every generation carries the version the replica that made it
served, so every recorded call (and so episode) names it.

Sleep. With `layout: colocated`, the replicas on a GPU that holds a trainer rank (`sleepers`) give
their memory back during an on-policy step: the run loop calls `sleep_during_step` after draining
and `wake_after_step` before `resume` (which syncs). One that cannot wake is killed, restarted and synced.

Faults. A replica found dead or hung (`ProcessEngine.healthy`, checked on each routing decision and
by a monitor thread) leaves routing at once; the episodes pinned to it are handed to `on_lost`
(the run aborts them, so they never train half-done and their clients start new ones) and its
waiting requests fail with `ReplicaLost`. It is then restarted, synced to the current weights
and version, and routed to again. The restarted replica catches up only while the trainer's module holds the
version it is labelled with (`_stable`: not between `hold` and `resume`, nor inside `swap_weights`,
when the step writes it), so it never serves a mix of two versions under one label. Deliberately
not here: the trainer, episodes and HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from core.config import ModelConfig, RunConfig
from core.engine.devices import model_devices, sleeping_replicas
from core.engine import Engine, EngineLoad, Generation, GenerationError, SamplingParams
from core.engine.factory import make_engine
from core.engine.routing import EPISODE
from core.engine.process import ProcessEngine, ReplicaLost, ReplicaSpec
from core.engine.replica_sync import Stream, send_to, sync_replicas
from core.engine.weight_sync import weights_of

log = logging.getLogger(__name__)

MONITOR_S = 1.0  # how often the monitor looks at every replica's health
ROUTE_WAIT_S = 0.05  # how often a call with no eligible replica (all restarting or behind) looks again
# Pins kept at most: the oldest are forgotten first. Far above the episodes a run keeps open
# (server.max_open_episodes, 512 by default), so an open episode is never forgotten.
MAX_PINS = 65536
RESTARTS = 3  # restarts of one replica slot in a row (without a sync in between) before it stays out


class ReplicaBehind(RuntimeError):
    """A replica does not serve the trainer's version after a sync: inference would train on old weights."""


class ReplicaEngine(Engine):
    """N replicas of one model as one `Engine` (see the module doc)."""

    def __init__(self, weights: Callable[[], Any], start: Callable[[int, Callable], Any], count: int,
                 max_staleness: int, max_context: int, route_wait_s: float, sleepers: tuple[int, ...] = (),
                 on_lost: Callable[[list[str]], None] | None = None, is_open: Callable[[str], bool] | None = None):
        """`weights()` gives the trainer's current trainable weights as the replicas' `sync` takes them (a
        dict of the live tensors for processes, the model actor's layout under Ray); `start(i, on_lost)`
        builds replica slot i (a `ProcessEngine` or an actor handle); `route_wait_s` bounds how long a new
        episode waits for an eligible replica before its call fails; `sleepers`: the slots colocated on a
        trainer rank's GPU (`core.engine.devices.sleeping_replicas`), put to sleep during the step (`sleep_during_step`);
        `on_lost(episode_ids)`: told the open episodes of a lost replica (the run aborts them); `is_open(episode_id)`:
        whether a pinned episode is still open (a pin of one that ended is forgotten). Without them (a
        server that trains nothing) a lost replica's episodes fail at their next call and pins age out."""
        self.weights, self._start, self.max_staleness = weights, start, max_staleness
        self.sleepers = tuple(sleepers)
        self.max_context, self.route_wait_s = max_context, route_wait_s
        self.version = 0
        self.last_sync_s = 0.0  # seconds the last weight sync took (layout, transfer, every replica's ack)
        self.on_lost, self.is_open = on_lost, is_open
        self.failure: BaseException | None = None  # a replica that could not be brought back, for the run
        self._lock = threading.RLock()  # pins and slots; held briefly, also on the event loop
        self._version_lock = threading.Lock()  # a sync, or a restarted replica catching up: never both
        # The trainer's module holds `version`'s weights and nothing writes it (a step starts at `hold`
        # and ends at `resume`; an overlapped one is `swap_weights`): only then may a restarted replica
        # read it. Waited on under `_version_lock`; False also after a sync that did not go through.
        self._stable, self._held = True, False
        self._settled = threading.Condition(self._version_lock)
        self._stream: Stream | None = None  # the trainer's shards, once it keeps no module (`stream_syncs`)
        self._pins: OrderedDict[str, int] = OrderedDict()
        self.restarts = [0] * count
        self.episodes_total = [0] * count  # episodes ever routed to each replica slot
        self._closed = threading.Event()
        self.replicas: list[Any] = [None] * count
        starters = [threading.Thread(target=self._start_slot, args=(i,), daemon=True) for i in range(count)]
        for t in starters:
            t.start()
        for t in starters:
            t.join()
        if any(r is None for r in self.replicas):
            self.close()
            raise ReplicaLost(f"replicas could not start: {self.failure}")
        self._sync_all(self.version)  # the trainer's weights, whatever the replicas loaded
        self._monitor = threading.Thread(target=self._watch, name="replica-monitor", daemon=True)
        self._monitor.start()

    # -- routing ---------------------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       on_token: Callable[[int], None] | None = None) -> Generation:
        episode = EPISODE.get()
        replica = await self._route(episode)
        return await replica.generate(prompt_ids, params, on_token)

    async def _route(self, episode: str | None) -> Any:
        with self._lock:
            if episode is not None and episode in self._pins:
                index = self._pins[episode]
                self._pins.move_to_end(episode)
                replica = self.replicas[index]
                if replica is None or not replica.healthy():
                    raise ReplicaLost(f"episode {episode} was served by replica {index}, which was lost; "
                                      "the episode is aborted")
                return replica
        waited = 0.0
        while True:
            with self._lock:
                index = self._least_loaded()
                if index is not None:
                    if episode is not None:
                        self._pins[episode] = index
                        self.episodes_total[index] += 1
                        while len(self._pins) > MAX_PINS:
                            self._pins.popitem(last=False)
                    return self.replicas[index]
            if waited >= self.route_wait_s or self._closed.is_set():
                raise GenerationError(f"no replica serves version {self.version} (within max_staleness "
                                      f"{self.max_staleness}) after {waited:.0f} s: {self.health_line()}")
            await asyncio.sleep(ROUTE_WAIT_S)
            waited += ROUTE_WAIT_S

    def _least_loaded(self) -> int | None:
        self._prune_pins()
        pinned = [0] * len(self.replicas)
        for index in self._pins.values():
            pinned[index] += 1
        eligible = [i for i, r in enumerate(self.replicas)
                    if r is not None and r.healthy() and r.version >= self.version - self.max_staleness]
        if not eligible:
            return None
        return min(eligible, key=lambda i: (pinned[i], self.replicas[i].inflight, i))

    def _prune_pins(self) -> None:
        if self.is_open is None:
            return
        for episode in [e for e in self._pins if not self.is_open(e)]:
            del self._pins[episode]

    def replica_of(self, episode: str) -> int | None:
        """The replica an episode is pinned to, if it is."""
        with self._lock:
            return self._pins.get(episode)

    # -- admission and weight sync ----------------------------------------------------------------
    def hold(self) -> None:
        self._stable, self._held = False, True  # a step may write the module from here (`pause_blocking`)
        for r in self._live():
            r.hold()

    async def pause(self) -> None:
        await asyncio.to_thread(self.pause_blocking)

    def pause_blocking(self) -> None:
        self._held = True
        self._unsettle()  # once this returns the step may write the module: no catch-up reads it then
        for r in self._live():
            try:
                r.pause_blocking()
            except (ReplicaLost, RuntimeError) as e:  # a replica lost while draining has nothing left to drain
                log.warning("replica pause: %s", e)

    def resume(self, new_version: int | None = None) -> None:
        """Admit again; with a new version, first bring every replica to the trainer's weights."""
        if new_version is not None and new_version != self.version:
            self._sync_all(new_version)  # raises ReplicaBehind: the module's version was not published
        self._settle()
        for r in self._live():
            r.resume(None)

    def sleep_during_step(self) -> int:
        """While the trainer steps (after `pause_blocking`): the colocated replicas give their device
        memory back; returns how many went to sleep. Nothing to do without colocated GPU replicas."""
        slept = 0
        for i in self.sleepers:
            r = self.replicas[i]
            if r is not None and r.healthy():
                try:
                    r.sleep()
                    slept += 1
                except (ReplicaLost, RuntimeError) as e:  # it keeps its memory; the step may run short of it
                    log.warning("replica %d could not sleep: %s", i, e)
        return slept

    def wake_after_step(self) -> None:
        """After the step, before `resume`: the sleeping replicas take their memory back. One that cannot
        is taken out of service (restarted and synced), never left to serve without its weights."""
        for i in self.sleepers:
            r = self.replicas[i]
            if r is not None and r.healthy() and r.asleep:
                try:
                    r.wake()
                except (ReplicaLost, RuntimeError) as e:
                    r.kill(f"could not wake after the step: {e}")

    def swap_weights(self, apply: Callable[[], bool]) -> bool:
        """`apply` changes the trainer's module (nothing generates with it); the replicas then take the
        new weights between two of their decode steps, and the version goes up by one."""
        self._unsettle()
        changed = bool(apply())
        if changed:
            self._sync_all(self.version + 1)
        self._settle()
        return changed

    def stream_syncs(self, stream: Stream) -> bool:
        """Every later sync (a restarted replica's catch-up too) streams from a trainer that keeps no whole
        module, one replica after another (`core.engine.replica_sync`); a catch-up still waits for the
        step boundary (`_stable`), and the trainer's lock keeps its stream off the step's collectives."""
        with self._version_lock:  # not while a sync or a catch-up reads the module
            self._stream = stream
        return True

    def _unsettle(self) -> None:
        """The module is about to be written: wait out a catch-up sync reading it, then let none start."""
        with self._settled:
            self._stable = False

    def _settle(self) -> None:
        """The module holds `version` again (published to the replicas): restarted replicas may catch up."""
        with self._settled:
            self._stable, self._held = True, False
            self._settled.notify_all()

    def _sync_all(self, version: int) -> None:
        """Every live replica to the trainer's weights at `version`; raises ReplicaBehind if one is not."""
        with self._version_lock:
            self._sync_locked(version)

    def _sync_locked(self, version: int) -> None:
        started = time.perf_counter()
        behind = sync_replicas(list(self.replicas), version, self.weights, self._stream)
        self.last_sync_s = time.perf_counter() - started
        if behind:
            raise ReplicaBehind(f"weights version {version} did not reach every replica: {'; '.join(behind)}")
        with self._lock:
            self.version = version
            self.restarts = [0] * len(self.replicas)

    # -- faults ------------------------------------------------------------------------------------
    def _lost(self, replica: Any, why: str) -> None:
        """A replica left service: abort its episodes, forget their pins, restart it in the background."""
        with self._lock:
            index = next((i for i, r in enumerate(self.replicas) if r is replica), None)
            if index is None:
                return
            episodes = [e for e, i in self._pins.items() if i == index]
            for e in episodes:
                del self._pins[e]
            self.replicas[index] = None
        if episodes and self.on_lost is not None:
            self.on_lost(episodes)
        if not self._closed.is_set():
            threading.Thread(target=self._restart, args=(index,), name=f"replica-{index}-restart", daemon=True).start()

    def _start_slot(self, index: int) -> None:
        try:
            self.replicas[index] = self._start(index, self._lost)
        except Exception as e:  # noqa: BLE001 - reported through `failure` and the missing slot
            self.failure = e
            log.error("replica %d could not start: %s", index, e)

    def _restart(self, index: int) -> None:
        while not self._closed.is_set():
            self.restarts[index] += 1
            if self.restarts[index] > RESTARTS:
                self.failure = ReplicaLost(f"replica {index} was lost {RESTARTS} times in a row; it stays out")
                log.error("%s", self.failure)
                return
            log.warning("restarting replica %d (attempt %d)", index, self.restarts[index])
            try:
                replica = self._start(index, self._lost)
                with self._settled:  # the version and the module cannot move while a new replica catches up
                    while not self._stable and not self._closed.is_set():  # a step writes the module now
                        self._settled.wait(MONITOR_S)
                    if self._closed.is_set():  # closed while it started or waited: it must not outlive the engine
                        replica.close()
                        return
                    send_to(replica, self.version, self.weights, self._stream)  # streamed: between steps
                    if self._held:  # a step began while it caught up: admit nothing until its resume
                        replica.hold()
                    self.replicas[index] = replica
                log.warning("replica %d is back, serving version %d", index, replica.version)
                return
            except Exception as e:  # noqa: BLE001 - try again, up to RESTARTS
                log.error("replica %d restart failed: %s", index, e)

    def _watch(self) -> None:
        while not self._closed.wait(MONITOR_S):
            for r in self._live():
                r.healthy()  # finds a dead or hung replica even when no call is routed to it

    def _live(self) -> list[Any]:
        return [r for r in self.replicas if r is not None and r.healthy()]

    # -- status ------------------------------------------------------------------------------------
    def status(self) -> list[dict[str, Any]]:
        """Each replica's device, process, health, served version, load and pinned episodes."""
        with self._lock:
            pinned = [0] * len(self.replicas)
            for i in self._pins.values():
                pinned[i] += 1
            rows = []
            for i, r in enumerate(self.replicas):
                healthy = r is not None and r.healthy()
                rows.append({"replica": i, "healthy": healthy, "version": r.version if r is not None else None,
                             "device": getattr(r, "device", None), "pid": getattr(r, "pid", None),
                             "inflight": r.inflight if r is not None else 0, "episodes": pinned[i],
                             "episodes_total": self.episodes_total[i],
                             "asleep": bool(getattr(r, "asleep", False)),
                             "restarts": self.restarts[i]})
            return rows

    def health_line(self) -> str:
        return ", ".join(f"replica {s['replica']}: {'up' if s['healthy'] else 'down'} v{s['version']}"
                         for s in self.status())

    def load(self) -> EngineLoad:
        loads = [r.load() for r in self._live()]
        ages = [x.oldest_s for x in loads if x.oldest_s is not None]
        return EngineLoad(queued=sum(x.queued for x in loads), active=sum(x.active for x in loads),
                          admitting=any(x.admitting for x in loads), oldest_s=max(ages) if ages else None)

    def close(self) -> None:
        self._closed.set()
        for r in self.replicas:
            if r is not None:
                r.close()


def make_model_engine(cfg: RunConfig, mc: ModelConfig, model: torch.nn.Module, tokenizer: Any,
                      max_context: int, on_lost: Callable[[list[str]], None] | None = None,
                      is_open: Callable[[str], bool] | None = None) -> Any:
    """The engine `models[mc.name]` asks for: the run's engine kind around `model` in this process,
    or (`replicas` >= 2) a `ReplicaEngine` of replica processes, with `on_lost` and `is_open` (`ReplicaEngine`)."""
    if mc.replicas < 2:
        return make_engine(cfg.engine.kind, model, tokenizer, cfg.engine, max_context, seed=cfg.trainer.seed)
    return process_replicas(cfg, mc, model, max_context, on_lost=on_lost, is_open=is_open)


def process_replicas(cfg: RunConfig, mc: ModelConfig, model: torch.nn.Module, max_context: int,
                     threads: int | None = None, on_lost: Callable[[list[str]], None] | None = None,
                     is_open: Callable[[str], bool] | None = None) -> ReplicaEngine:
    """`mc.replicas` replica processes (even one: bench/replicas.py compares 1 with 2), each on its
    device (`model_devices`), synced from `model`; `threads`: torch threads of a CPU replica (None:
    the cores split between the CPU replicas); `on_lost`, `is_open`: as `ReplicaEngine` takes them."""
    gpus = torch.cuda.device_count()
    _, replica_devices = model_devices(mc, gpus)

    def start(i: int, on_lost: Callable) -> ProcessEngine:
        device = replica_devices[i]
        cpu_share = max(1, (os.cpu_count() or 1) // replica_devices.count("cpu")) if device == "cpu" else 0
        cpu_share = threads if threads is not None and device == "cpu" else cpu_share
        spec = ReplicaSpec(index=i, model=mc.model_copy(update={"device": device}).model_dump(),
                           engine=cfg.engine.model_dump(), max_context=max_context, seed=cfg.trainer.seed + i,
                           threads=cpu_share)
        return ProcessEngine(spec, cfg.server.request_timeout_s, on_lost, weights_device)

    weights_device = str(next(model.parameters()).device)
    return ReplicaEngine(lambda: weights_of(model), start, mc.replicas, cfg.trainer.max_staleness,
                         max_context, route_wait_s=cfg.server.request_timeout_s,
                         sleepers=tuple(sleeping_replicas(mc, gpus)), on_lost=on_lost, is_open=is_open)
