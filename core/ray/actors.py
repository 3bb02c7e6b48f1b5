"""The Ray actors of a Ray-placed run: one per model (engine and trainer together) and per client.

`ModelActor` hosts one model exactly as a local run does, on the actor's node: the model, its
engine and its trainer share the module, so weight sync after a step is the engine's own pause or
swap, inside the actor, and no weights cross the network. The driver (`core.ray.driver`) calls
it step by step: generate, hold/pause/resume, prepare/backward/apply, save/restore. Every method
is async and runs blocking work on a thread, so generation goes on while the trainer works.

A model with `replicas` (2 or more) generates on its replica actors only (`core.ray.replicas`):
its model actor builds no engine (no in-process vLLM takes GPU memory or torch.distributed's
default group beside the trainer), keeps the served version, and is rank 0 of one weights group
of two per replica actor (`core.ray.weights.WeightHost`): the weights go over those groups in
buckets (`core.engine.weight_sync`), never through Ray's object store.

`ClientActor` runs the client runner (`core.clients.runner.run_agent`) against the gateway's URL, like
`swarm client` does, so agent code spreads over the cluster's CPUs.

The classes are plain: the driver makes them actors (`ray.remote(ModelActor).options(...)`) with
the resources from the config, so this module does not import Ray (`core.ray.weights` asks it for
the node's address). It runs inside Ray workers and
deliberately holds no recovery or scheduling logic (that is the driver's, `core.ray.driver`).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from core.run import checkpoint
from core.config import ClientConfig, RunConfig
from core.engine import Engine, EngineLoad, Generation, SamplingParams
from core.records import Episode
from core.clients.runner import run_agent
from core.clients.sandbox import load_agent
from core.serve.server import load_model, load_policies
from core.ray.weights import WeightHost
from core.train.distributed import DistributedTrainer, build_trainer
from core.train.sharded import ShardedTrainer
from core.train.outcome import StepOutcome
from core.train.trainer import PreparedStep, Trainer, seed_everything


class NotAdopted(RuntimeError):
    """A call reached a model actor the driver has not adopted: Ray restarted it, and it holds initial weights."""


class ModelActor:
    """One model's engine and trainer; `cfg_data` is the run config dumped, `name` the model's.

    Ray restarts a dead actor by running `__init__` again, and calls then reach the new process as
    if nothing had happened. Until the driver adopts it (`adopt`, after restoring the last checkpoint
    into it), the engine and trainer calls raise `NotAdopted`: a fresh actor must not serve initial
    weights, train on from them, or save them as the run's next checkpoint.
    """

    def __init__(self, cfg_data: dict[str, Any], name: str):
        self.adopted = False
        cfg = RunConfig.model_validate(cfg_data)
        seed_everything(cfg.trainer.seed)
        mc = next(m for m in cfg.models if m.name == name)
        self.name = name
        self.engine: Engine | None = None
        if mc.replicas > 1:  # they generate, as actors of their own (`core.ray.replicas`): no engine here
            self.model, _, self.max_context = load_model(mc)
        else:
            policy = load_policies(cfg.model_copy(update={"models": [mc]}))[name]
            self.model, self.engine, self.max_context = policy.model, policy.engine, policy.engine.max_context
        self.version = 0  # the served version without an engine (the driver moves it, as an engine's)
        self.trainer = build_trainer(self.model, cfg, name) if mc.trainable else None
        # Replicas alone: an FSDP2 trainer's syncs stream from its shards (it drops its module at its first step).
        stream = getattr(self.trainer, "stream_weights", None) if self.engine is None else None
        self.weights = WeightHost(self.model, stream)
        self.prepared: PreparedStep | None = None

    async def adopt(self) -> dict[str, Any]:
        """The driver takes this actor on (first start, or restored after a restart): it serves from now on."""
        self.adopted = True
        return await self.info()

    async def info(self) -> dict[str, Any]:
        t = self.trainer
        return {"pid": os.getpid(), "version": self._version(), "max_context": self.max_context,
                "trainable": t is not None, "lora": bool(t and t.lora), "overlap_safe": bool(t and t.overlap_safe),
                "step_count": t.step_count if t else 0, "engine": type(self.engine).__name__ if self.engine else None,
                "weights_groups": self.weights.keys()}

    # -- the engine -------------------------------------------------------------------------------
    # Without an engine (replicas) admission is the replicas' and the version is only counted here.
    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        self._serving()
        if self.engine is None:
            raise RuntimeError(f"model {self.name!r} generates on its replica actors, not in its model actor")
        return await self.engine.generate(prompt_ids, params)

    async def pause(self) -> None:
        self._serving()
        if self.engine is not None:
            await asyncio.to_thread(self.engine.pause_blocking)

    async def hold(self) -> None:
        self._serving()
        if self.engine is not None:
            self.engine.hold()

    async def resume(self, new_version: int | None) -> int:
        if self.engine is not None:
            self.engine.resume(new_version)
        elif new_version is not None:
            self.version = new_version
        return self._version()

    async def load(self) -> EngineLoad:
        if self.engine is None:
            return EngineLoad(queued=0, active=0, admitting=True, oldest_s=None)
        return self.engine.load()

    def _version(self) -> int:
        return self.engine.version if self.engine is not None else self.version

    # -- the trainer ------------------------------------------------------------------------------
    async def prepare(self, groups: list[list[Episode]]) -> bool:
        trainer = self._trainer()
        if self.weights.stream is not None and trainer.keeps_module:  # after any restore, which loads through it
            await asyncio.to_thread(trainer.drop_module)
        self.prepared = await asyncio.to_thread(trainer.prepare, groups)
        return self.prepared.needs_update

    async def backward(self) -> None:
        await asyncio.to_thread(self._trainer().backward, self._prepared())

    async def apply(self, swap: bool) -> bool:
        """The optimizer step; with `swap`, between two decode steps while generation goes on (the
        engine's version then goes up here), else directly (the engine is paused; the driver resumes it)."""
        trainer, prepared = self._trainer(), self._prepared()
        if swap and self.engine is not None:
            return await asyncio.to_thread(self.engine.swap_weights, lambda: trainer.apply(prepared))
        return await asyncio.to_thread(trainer.apply, prepared)

    async def outcome(self) -> StepOutcome:
        return self._trainer().outcome(self._prepared())

    async def discard(self) -> None:
        self._trainer().discard()
        self.prepared = None

    async def save(self, folder: str) -> None:
        """This model's part of a checkpoint, written where the driver's checkpoint folder is (shared storage)."""
        await asyncio.to_thread(checkpoint.save_trainer, Path(folder), self._trainer())

    async def restore(self, path: str) -> None:
        ckpt = checkpoint.load(path)
        await asyncio.to_thread(checkpoint.restore_one, ckpt, self.name, self._trainer(adopted=False))

    # -- the replica actors' weights groups (`core.ray.weights`) -------------------------------
    async def weights_address(self) -> tuple[str, int]:
        """Where a replica actor's weights group meets: this node's address and a free port on it."""
        return self.weights.address()

    async def host_weights(self, key: str, host: str, port: int, backend: str, replica_device: str) -> None:
        """Rank 0 of the replica actor `key`'s group; returns once the replica actor joined it."""
        await asyncio.to_thread(self.weights.host, key, host, port, backend, replica_device)

    async def weights_layout(self) -> list:
        """The trainable weights' layout (names, shapes, dtypes): what one sync sends."""
        self._serving()
        return self.weights.layout()

    async def send_weights(self, key: str, layout: list, timeout_s: float) -> None:
        """Broadcast the trainable weights on `key`'s group (the replica accepted `layout`)."""
        self._serving()
        await asyncio.to_thread(self.weights.send, key, layout, timeout_s)

    async def drop_weights(self, key: str) -> None:
        self.weights.drop(key)

    async def weights_digest(self) -> str:
        return await asyncio.to_thread(self.weights.digest)

    async def close(self) -> None:
        self.weights.close()
        if self.engine is not None:
            self.engine.close()
        if isinstance(self.trainer, DistributedTrainer | ShardedTrainer):  # their rank processes
            self.trainer.close()

    def _serving(self) -> None:
        if not self.adopted:
            raise NotAdopted(f"model actor {self.name!r} was restarted and is not restored yet")

    def _trainer(self, adopted: bool = True) -> Trainer:
        if adopted:
            self._serving()
        if self.trainer is None:
            raise RuntimeError(f"model {self.name!r} is not trainable")
        return self.trainer

    def _prepared(self) -> PreparedStep:
        if self.prepared is None:
            raise RuntimeError(f"no prepared step for {self.name!r} (lost with a restart, or discarded)")
        return self.prepared


class ClientActor:
    """One client: `run` keeps its episodes in flight against the gateway until `stop` or its task budget."""

    def __init__(self) -> None:
        self._stop: asyncio.Event | None = None

    async def run(self, client_data: dict[str, Any], url: str, group_size: int, client_id: str,
                  seed: str | None = None, credential: str | None = None) -> dict[str, int]:
        """`seed`: the train split's task order (`core.clients.runner.run_agent`); `credential`: the one the
        driver issued this client (`core.episodes.credentials`)."""
        c = ClientConfig.model_validate(client_data)
        self._stop = asyncio.Event()
        stats = await run_agent(load_agent(c.agent), url, concurrency=c.concurrency, group_size=group_size,
                                kind=c.kind, split=c.split, max_tasks=c.tasks, stop=self._stop, client_id=client_id,
                                episode_timeout_s=c.episode_timeout, seed=seed, credential=credential)
        return {"finished": stats.finished, "failed": stats.failed, "pid": os.getpid()}

    async def stop(self) -> None:
        if self._stop is not None:
            self._stop.set()

    async def pid(self) -> int:
        return os.getpid()
