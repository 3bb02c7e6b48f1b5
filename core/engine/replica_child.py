"""The child side of a rollout replica: build the model's engine and serve it over a pipe.

`replica_main` is what a replica process runs (`core.engine.process.ProcessEngine` spawns it) and
`build_replica` is what both it and a Ray replica actor (`core.ray.replicas`) build: the model loaded
the way a run loads it, LoRA-wrapped like the trainer's so the adapters' names match, inside the
run's engine kind (hf or vllm). The child answers generation, admission, weight syncs (received over
its weights group, `core.engine.weight_sync`), sleep/wake and digests, and reports its version and
load in a heartbeat. A vLLM replica holds its weights once, in vLLM: the module is kept on the meta
device for its names and shapes (and LoRA's adapters), and a full fine-tune's sync goes from the group
straight into vLLM's model (`replica_receiver`). A sync that fails part-way leaves a mix of two versions
(`WeightReceiver.torn`): the child then exits unanswered, so the parent restarts it and it catches up.

Deliberately not here: health, restarts and timeouts of the parent side (`core.engine.process`),
routing (`core.engine.replicas`).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from core import models
from core.config import EngineConfig, ModelConfig
from core.engine import SamplingParams
from core.engine.factory import make_engine
from core.engine.weight_sync import WeightReceiver, sync_replica

HEARTBEAT_S = 0.5  # how often the child reports version, load and that it lives
SYNC_S = 300.0  # how long one weight sync may take before the replica counts as hung (killed, restarted)
GROUP_FACTOR = 2  # the weights group's timeout in SYNC_S: the parent's deadline comes first (core.engine.process)


@dataclass(frozen=True)
class ReplicaSpec:
    """What a replica process needs to build its engine: plain data, sent to the child."""

    index: int
    model: dict  # ModelConfig dumped; `device` is this replica's
    engine: dict  # EngineConfig dumped
    max_context: int
    seed: int  # the run's trainer.seed plus the replica's index: each replica its own sampling stream
    # torch threads (0: torch's default, all cores). CPU replicas split the cores between them: N
    # replicas each using every core would oversubscribe them N times over.
    threads: int = 0


def build_replica(spec: ReplicaSpec, stream_weights: bool = False) -> tuple[Any, torch.nn.Module]:
    """A replica's engine and the module it generates with (LoRA-wrapped like the trainer's, so the
    adapters' names match), as a replica process or a Ray replica actor builds them. `stream_weights`:
    a vLLM engine frees the module's copy of the weights (`VLLMEngine.drop_module_weights`); the syncs
    must then come through `replica_receiver`."""
    mc, engine_cfg = ModelConfig.model_validate(spec.model), EngineConfig.model_validate(spec.engine)
    torch.manual_seed(spec.seed)
    if spec.threads:
        torch.set_num_threads(spec.threads)
    model, tok = models.load(mc)
    policy = models.prepare_policy(model, mc.lora) if mc.lora is not None and mc.trainable else model
    engine = make_engine(engine_cfg.kind, policy, tok, engine_cfg, spec.max_context, spec.seed)
    if engine_cfg.kind == "vllm":
        # A replica sleeps when the run says (`sleep`: colocated on a trainer rank's GPU), not each time
        # it drains as an engine in the trainer's own process does.
        engine.sleep_when_drained = False
        if stream_weights:
            engine.drop_module_weights()
    return engine, policy


def replica_receiver(engine: Any, policy: torch.nn.Module, device: str) -> WeightReceiver:
    """The replica's end of its weights group: into the module's parameters, or, for a vLLM engine that
    dropped the module's copy of a full fine-tune's weights, into vLLM's model bucket by bucket."""
    direct = not getattr(engine, "module_weights", True) and not getattr(engine, "lora", False)
    return WeightReceiver(policy, device, load=engine.load_weights if direct else None)


def replica_main(conn: Any, spec: ReplicaSpec) -> None:
    """The child: build the engine, then serve requests from the pipe until it closes."""
    engine, policy = build_replica(spec, stream_weights=True)
    send_lock = threading.Lock()

    def send(*msg: Any) -> None:
        with send_lock:
            conn.send(msg)

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name="replica-loop", daemon=True).start()
    running: dict[int, Any] = {}

    async def serve(rid: int, prompt: list[int], params: SamplingParams, stream: bool) -> None:
        try:
            gen = await engine.generate(prompt, params, (lambda t: send("tok", rid, t)) if stream else None)
            send("done", rid, gen)
        except asyncio.CancelledError:
            send("error", rid, "cancelled")
        except Exception as e:  # noqa: BLE001 - the parent raises it for the request's caller
            send("error", rid, f"{type(e).__name__}: {e}")
        finally:
            running.pop(rid, None)

    receiver = replica_receiver(engine, policy, spec.model["device"])

    def answer(seq: int, work: Callable[[], Any]) -> None:
        try:
            send("ack", seq, work())
        except Exception as e:  # noqa: BLE001 - the parent fails the request loudly with it
            if receiver.torn:  # part old, part new weights: never serve them; the parent restarts this replica
                os._exit(1)
            send("ack", seq, f"error: {type(e).__name__}: {e}")

    def rest(seq: int, kind: str) -> None:
        try:
            freed = engine.sleep() if kind == "sleep" else engine.wake()
            send("ack", seq, {"asleep": engine.asleep, "freed_bytes": freed or 0})
        except Exception as e:  # noqa: BLE001 - the parent fails the call loudly with it
            send("ack", seq, f"error: {type(e).__name__}: {e}")

    def beat() -> None:
        while True:
            send("beat", engine.version, asdict(engine.load()))
            time.sleep(HEARTBEAT_S)

    send("ready", os.getpid(), engine.version)
    threading.Thread(target=beat, name="replica-beat", daemon=True).start()
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            os._exit(0)  # the parent is gone: the daemon threads go with this process
        kind = msg[0]
        if kind == "gen":
            _, rid, prompt, params, stream = msg
            running[rid] = asyncio.run_coroutine_threadsafe(serve(rid, prompt, params, stream), loop)
        elif kind == "cancel":
            fut = running.get(msg[1])
            if fut is not None:
                fut.cancel()
        elif kind == "weights_group":  # joins while the parent hosts the group: on a thread of its own
            _, seq, port, backend = msg
            threading.Thread(target=answer, args=(seq, lambda p=port, b=backend: receiver.join(p, b, GROUP_FACTOR * SYNC_S)),
                             daemon=True).start()
        elif kind == "layout":
            answer(msg[1], lambda layout=msg[2]: receiver.expect(layout))
        elif kind == "sync":  # received inside the swap: decode waits out the transfer
            _, seq, version = msg
            threading.Thread(target=answer, args=(seq, lambda v=version: sync_replica(engine, receiver.receive, v)),
                             daemon=True).start()
        elif kind == "digest":
            answer(msg[1], receiver.digest)
        elif kind in ("sleep", "wake"):
            threading.Thread(target=rest, args=(msg[1], kind), daemon=True).start()
        elif kind == "hold":
            engine.hold()
        elif kind == "pause":
            threading.Thread(target=lambda seq=msg[1]: (engine.pause_blocking(), send("ack", seq, engine.version)),
                             daemon=True).start()
        elif kind == "resume":
            engine.resume(msg[1])
        elif kind == "close":
            engine.close()
            os._exit(0)
