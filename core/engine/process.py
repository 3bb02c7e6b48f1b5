"""One engine in a process of its own: a rollout replica of a model, on its own device.

`ProcessEngine` starts a child process (spawn) that builds the model's engine and serves it over a
pipe (`core.engine.replica_child`). This, the parent side, offers
`generate`, admission (`hold`, `pause_blocking`, `resume`) and `sync(weights, version)`: the
trainer's trainable parameters (all of them for a full fine-tune, the adapters for LoRA), applied
by the child between two decode steps (`WorkerEngine.replace_weights`), after which it serves
`version`; `weights_digest` says what it holds. The child reports its version, load and liveness
in a heartbeat. `sleep`/`wake` (a drained replica colocated on a trainer rank's GPU, during the
step) are the engine's own, and the child answers with its state. The engine is the run's kind, `hf` or `vllm`.

Health: the replica is `healthy` while its process lives, its heartbeat is recent and no request
has waited longer than `hang_s`. A replica found dead or hung is killed (SIGKILL) and every
request waiting on it fails with `ReplicaLost`; the router (`core.engine.replicas`) then restarts it.
A replica that does not answer a command (a sync, a pause, sleep or wake) within its timeout is hung
too, and goes the same way, even while its heartbeat is recent: never left in service and behind.
A sync's transfer and answer share one deadline (SYNC_S), and the weights group's own timeout is
GROUP_FACTOR times longer, so the deadline acts first (under NCCL, before the group's watchdog).

The child sees its own device alone (`core.engine.devices`): it is told cuda:0 (`pinned_spec`), while
this side keeps the run's name for it, from which the weights group's backend follows.

Weights travel over a process group of two, this process and the replica (`core.engine.weight_sync`:
gloo, or NCCL between two GPUs), built when the replica starts; the pipe carries only the layout
(names, shapes, dtypes, when it changes) and the sync's command and answer. A transfer that fails
(the replica died or hung mid-broadcast) leaves the group out of step, so the replica is killed and
the router restarts it with a fresh group. Deliberately not here: routing, restarts, versions
policy (the router's), and anything of the trainer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import multiprocessing
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch

from core.engine import EngineLoad, Generation, GenerationError, SamplingParams
from core.engine.devices import local_device, spawn_pinned
from core.engine.groups import free_port
from core.engine.replica_child import GROUP_FACTOR, SYNC_S, ReplicaSpec, replica_main
from core.engine.weight_sync import WeightSender, layout_of

log = logging.getLogger(__name__)

# A replica silent this long is taken for hung: far beyond a heartbeat's period, long enough that a
# loaded 2-core machine (six agents at once) does not take a slow scheduler for a hang.
SILENT_S = 60.0
# How long a replica may take to start (spawn, import torch and transformers, load the model).
START_S = 300.0


def pinned_spec(spec: ReplicaSpec) -> ReplicaSpec:
    """`spec` as its pinned child sees it: its device named as the child's only one (cuda:0)."""
    return dataclasses.replace(spec, model={**spec.model, "device": local_device(spec.model["device"])})


class ReplicaLost(GenerationError):
    """The replica serving a request died or hung; the request failed (its episode is aborted)."""


def hung(last_beat: float, load: EngineLoad, hang_s: float) -> str | None:
    """Why a replica last heard from at `last_beat` (monotonic) with `load` counts as hung, or None."""
    if time.monotonic() - last_beat > SILENT_S:
        return f"no heartbeat for {SILENT_S:g} s"
    if load.oldest_s is not None and load.oldest_s > hang_s:
        return f"a request waited {load.oldest_s:.0f} s (hang_s {hang_s:g})"
    return None


class ReplicaHandle(ABC):
    """What the router asks of any replica handle (a process here, a Ray actor in `core.ray.replicas`):
    `healthy`, `load` and `in_service`, from the heartbeat's `_beat`/`_load` and `lost`."""

    spec: ReplicaSpec
    hang_s: float
    lost: str | None
    _beat: float
    _load: EngineLoad

    @abstractmethod
    def kill(self, why: str) -> None:
        """Take the replica out of service for `why` and end its process or actor."""

    def exited(self) -> str | None:
        """Why the replica is known gone without a heartbeat's help (a process that exited), or None."""
        return None

    def healthy(self) -> bool:
        """Alive, heard from lately, and no request older than `hang_s`; a replica found otherwise is killed."""
        if self.lost:
            return False
        why = self.exited() or hung(self._beat, self._load, self.hang_s)
        if why:
            self.kill(why)
        return self.lost is None

    def load(self) -> EngineLoad:
        return self._load

    def in_service(self) -> None:
        """Raise `ReplicaLost` for a request to a replica taken out of service."""
        if self.lost:
            raise ReplicaLost(f"replica {self.spec.index} is out of service: {self.lost}")


class ProcessEngine(ReplicaHandle):
    """The parent's handle on one replica process (see the module doc)."""

    def __init__(self, spec: ReplicaSpec, hang_s: float, on_lost: Callable[[ProcessEngine, str], None],
                 weights_device: str = "cpu"):
        """`weights_device`: where the trainer's weights live (the group's backend follows from it)."""
        self.spec, self.hang_s, self.on_lost = spec, hang_s, on_lost
        self.device = spec.model["device"]
        self._sender = WeightSender(weights_device, self.device)
        self.max_context = spec.max_context
        self.version = -1  # what the child last reported serving
        self.lost: str | None = None  # why it was taken out of service, once it was
        self.asleep = False  # what the child last said after `sleep` / `wake`
        self._pending: dict[int, tuple[asyncio.Future, asyncio.AbstractEventLoop, Callable | None]] = {}
        self._acks: dict[int, tuple[threading.Event, list]] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._load = EngineLoad(queued=0, active=0, admitting=True, oldest_s=None)
        here, there = multiprocessing.get_context("spawn").Pipe()
        self._conn = here
        # The child sees its device alone, as cuda:0 (`core.engine.devices`): vLLM's executor takes local rank 0.
        self.proc = spawn_pinned(self.device, replica_main, (there, pinned_spec(spec)), f"swarm-replica-{spec.index}")
        there.close()
        self._beat = time.monotonic()
        self._ready = threading.Event()
        threading.Thread(target=self._read, name=f"replica-{spec.index}-reader", daemon=True).start()
        if not self._ready.wait(START_S) or self.lost:
            self.kill(self.lost or f"did not start within {START_S:g} s")
            raise ReplicaLost(f"replica {spec.index} on {self.device} could not start: {self.lost}")
        self._join_weights_group()

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    @property
    def inflight(self) -> int:
        return len(self._pending)

    def exited(self) -> str | None:
        return None if self.proc.is_alive() else f"its process exited (code {self.proc.exitcode})"

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       on_token: Callable[[int], None] | None = None) -> Generation:
        self.in_service()
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        rid = next(self._ids)
        self._pending[rid] = (fut, loop, on_token)
        try:
            self._send("gen", rid, list(prompt_ids), params, on_token is not None)
            gen = await fut
            gen.timings["replica"] = float(self.spec.index)  # which replica made it (sticky routing shows here)
            return gen
        except asyncio.CancelledError:
            self._send("cancel", rid)
            raise
        finally:
            self._pending.pop(rid, None)

    def hold(self) -> None:
        self._send("hold")

    def pause_blocking(self) -> None:
        self._request("pause", timeout=SYNC_S)

    def resume(self, new_version: int | None = None) -> None:
        self._send("resume", new_version)

    def sleep(self) -> dict:
        """Drained (`pause_blocking` first): the replica releases its device memory until `wake`.
        Returns the child's answer: {"asleep": True, "freed_bytes": n} (n is 0 on CPU)."""
        return self._rest("sleep")

    def wake(self) -> dict:
        """Take the memory back; the replica serves again once resumed."""
        return self._rest("wake")

    def _rest(self, kind: str) -> dict:
        answer = self._request(kind, timeout=SYNC_S)
        if isinstance(answer, str):
            raise RuntimeError(f"replica {self.spec.index} could not {kind}: {answer}")
        self.asleep = answer["asleep"]
        return answer

    def sync(self, weights: dict[str, torch.Tensor], version: int) -> int:
        """Broadcast `weights` (the trainer's trainable parameters) to the replica, which serves `version`
        from its next decode step; returns the version it then serves (raises if it could not). The layout
        goes first when it changed since the replica last accepted one: refused, nothing is sent. A
        replica that does not take the weights and answer within SYNC_S is hung: it is killed (and the
        router restarts it, as a dead one) and `ReplicaLost` raised."""
        layout = layout_of(weights)
        if layout != self._sender.layout:
            self._sender.layout = None
            answer = self._request("layout", layout, timeout=SYNC_S)
            if answer != "ok":
                raise RuntimeError(f"replica {self.spec.index} refused the weights: {answer}")
            self._sender.layout = layout
        answer = self._request("sync", version, timeout=SYNC_S, during=lambda deadline: self._transfer(weights, deadline))
        if isinstance(answer, str):
            raise RuntimeError(f"replica {self.spec.index} could not load the weights: {answer}")
        self.version = answer
        return answer

    def weights_digest(self) -> str:
        """The replica's `weights_digest` of the parameters it was last synced (a check for tests and ops)."""
        answer = self._request("digest", timeout=SYNC_S)
        if isinstance(answer, str) and not answer.startswith("error:"):
            return answer
        raise RuntimeError(f"replica {self.spec.index} could not digest its weights: {answer}")

    def _transfer(self, weights: dict[str, torch.Tensor], deadline: float) -> None:
        try:
            self._sender.send(weights, deadline)
        except Exception as e:  # the group is out of step now: the replica goes (and restarts with a new one)
            self.kill(f"the weight transfer failed: {type(e).__name__}: {e}")
            raise ReplicaLost(f"replica {self.spec.index} was lost during a weight transfer: {e}") from e

    def _join_weights_group(self) -> None:
        """Host the replica's weights group while the child joins it; a failure on either side kills it."""
        port = free_port()

        def host() -> None:
            try:
                self._sender.join(port, GROUP_FACTOR * SYNC_S)
            except Exception as e:  # noqa: BLE001 - the child would wait on the store for ever: kill it
                self.kill(f"could not host its weights group: {type(e).__name__}: {e}")
        hosting = threading.Thread(target=host, name=f"replica-{self.spec.index}-group", daemon=True)
        hosting.start()
        try:
            answer = self._request("weights_group", port, self._sender.backend, timeout=START_S)
        except (ReplicaLost, RuntimeError) as e:
            answer = f"error: {e}"
        hosting.join(START_S if answer == "ok" else 0)
        if answer != "ok" or self._sender.group is None:
            self.kill(f"could not join its weights group: {answer}")
            raise ReplicaLost(f"replica {self.spec.index} on {self.device} could not start: {self.lost}")

    def kill(self, why: str) -> None:
        """Take it out of service: SIGKILL the process, fail what waits on it, tell the router (once)."""
        with self._lock:
            if self.lost:
                return
            self.lost = why
        log.error("replica %d (%s, pid %s) lost: %s", self.spec.index, self.device, self.pid, why)
        if self.proc.is_alive():
            self.proc.kill()
        self._sender.close()
        error = ReplicaLost(f"replica {self.spec.index} was lost: {why}")
        for fut, loop, _ in list(self._pending.values()):
            loop.call_soon_threadsafe(lambda f=fut: f.done() or f.set_exception(error))
        for event, box in list(self._acks.values()):
            box.append(f"error: {error}")
            event.set()
        self.on_lost(self, why)

    def close(self) -> None:
        with self._lock:
            self.lost = self.lost or "closed"
        try:
            self._send("close")
        except ReplicaLost:
            pass
        self.proc.join(timeout=5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self._sender.close()

    def _on_beat(self, version: int, load: EngineLoad) -> None:
        """A heartbeat: alive now, with its load. Its version only ever moves the recorded one forward: a
        beat the child sent just before a sync's answer can arrive after it, one version back."""
        self._beat = time.monotonic()
        self.version, self._load = max(self.version, version), load

    # -- the pipe ----------------------------------------------------------------------------------
    def _send(self, *msg: Any) -> None:
        try:
            with self._lock:
                self._conn.send(msg)
        except (OSError, ValueError) as e:
            self.kill(f"its pipe broke: {e}")
            raise ReplicaLost(f"replica {self.spec.index} was lost: {e}") from e

    def _request(self, kind: str, *args: Any, timeout: float, during: Callable[[float], None] | None = None) -> Any:
        """Send a request and wait for its answer; `during(deadline)` runs in between (a sync's broadcast),
        within the same `timeout`. A replica that does not answer in time is hung: killed, `ReplicaLost`."""
        seq = next(self._ids)
        event, box = threading.Event(), []
        self._acks[seq] = (event, box)
        deadline = time.monotonic() + timeout
        try:
            self._send(kind, seq, *args)
            if during is not None:
                during(deadline)
            if not event.wait(max(0.0, deadline - time.monotonic())):
                why = f"did not answer {kind} within {timeout:g} s"
                self.kill(why)  # a hang is a death: restarted, never left "healthy" and behind
                raise ReplicaLost(f"replica {self.spec.index} {why}")
            return box[0]
        finally:
            self._acks.pop(seq, None)

    def _read(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                if not self.lost:
                    self.kill(f"its pipe closed (exit code {self.proc.exitcode})")
                self._ready.set()
                return
            kind = msg[0]
            if kind == "ready":
                self.version = msg[2]
                self._ready.set()
            elif kind == "beat":
                self._on_beat(msg[1], EngineLoad(**msg[2]))
            elif kind in ("done", "error", "tok"):
                entry = self._pending.get(msg[1])
                if entry is None:
                    continue  # cancelled meanwhile
                fut, loop, on_token = entry
                if kind == "tok":
                    if on_token is not None:
                        loop.call_soon_threadsafe(on_token, msg[2])
                elif kind == "done":
                    loop.call_soon_threadsafe(lambda f=fut, g=msg[2]: f.done() or f.set_result(g))
                else:
                    err = GenerationError(f"replica {self.spec.index}: {msg[2]}")
                    loop.call_soon_threadsafe(lambda f=fut, e=err: f.done() or f.set_exception(e))
            elif kind == "ack":
                waiting = self._acks.get(msg[1])
                if waiting is not None:
                    waiting[1].append(msg[2])
                    waiting[0].set()
