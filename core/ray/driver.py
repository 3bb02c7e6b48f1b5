"""Ray placement, the driver's side: the run's models and clients as actors on a Ray cluster.

`swarm run` stays the driver: it serves the gateway and the episode registry over HTTP and runs the
training loop (`core.run.loop.CoreRun`) unchanged. What changes is behind two proxies:

- `RemoteEngine` is an `Engine` (core/engine) whose calls go to the model's `ModelActor`, so the
  gateway serves a model on another node as if it were local; `RemoteTrainer` is the trainer the
  loop steps, its prepare/backward/apply running in the same actor. Weight sync stays inside the
  actor (colocated engine and trainer): per step only the episodes go out and metrics come back.
- `RayRun` (`core.ray.clients`) is the run; its clients are actors that reach the gateway by URL.
- A model with `replicas` generates on replica actors (`core.ray.replicas`); its model actor holds
  the trainer and no engine, and sends the weights to each replica over a process group of two.

A model actor that dies (node lost, OOM, killed) is restarted by Ray (`placement.max_restarts`);
the first call that sees the death restores the new actor's weights and optimizer from the last
checkpoint and gives it a new weight version; the step that was in flight fails (logged) and the
run goes on. Past the restart budget the run ends FAILED. Streaming (`on_token`) sees the tokens
when the generation is done, not one by one: token-by-token streaming across actors is not built.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayActorError

from core.run import checkpoint
from core import models
from core.serve.chat import ChatRenderer
from core.config import RunConfig
from core.engine import Engine, EngineLoad, Generation, SamplingParams
from core.run.plan import PlacementError
from core.ray.actors import ModelActor, NotAdopted
from core.ray.clients import RayRun
from core.ray.replicas import ray_replicas
from core.serve.server import Server
from core.serve.state import Policy
from core.train.outcome import StepOutcome

log = logging.getLogger(__name__)

# How long a restarted model actor may take to come back (it reloads its model): seconds for the
# shipped CPU models, minutes for a 32B model read from network storage onto a GPU.
RESTART_WAIT_S = 600.0
RESTART_POLL_S = 0.2  # how often a waiting call looks again while another call restores the actor
# Environment every actor gets: offline model loading as in `swarm run`, and this project importable
# for agent modules named by module path (nodes need the code at the same path: a shared folder or image).
ACTOR_ENV = ("HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM", "MLFLOW_TRACKING_URI")


class ModelLost(RuntimeError):
    """A model actor died while serving a call; the call failed (the actor is restored if it can be)."""


class ActorLink:
    """The driver's handle on one model actor: calls, the served weight version, and recovery."""

    def __init__(self, handle: Any, name: str, cfg: RunConfig, on_lost: Callable[[BaseException], None]):
        self.handle, self.name, self.on_lost = handle, name, on_lost
        self.checkpoint_dir, self.max_restarts = cfg.trainer.checkpoint_dir, cfg.placement.max_restarts
        self.info = ray.get(handle.adopt.remote())
        self.version: int = self.info["version"]
        self.restarts = 0
        self.epoch = 0  # goes up with each recovery, so calls that failed together recover once
        self.dead: str | None = None
        self.swapping = False  # set by RemoteEngine.swap_weights: the trainer's apply must swap in the actor
        self._lock = threading.Lock()

    def call(self, method: str, *args: Any, retry: bool = False) -> Any:
        epoch = self.epoch
        try:
            return ray.get(getattr(self.handle, method).remote(*args))
        except (RayActorError, NotAdopted) as e:  # died, or restarted by Ray behind our back
            self.recover(epoch, e)
            if retry and self.dead is None:
                return ray.get(getattr(self.handle, method).remote(*args))
            raise ModelLost(f"model actor {self.name!r} died during {method}: {e}") from e

    async def acall(self, method: str, *args: Any, retry: bool = False) -> Any:
        epoch = self.epoch
        try:
            return await getattr(self.handle, method).remote(*args)
        except (RayActorError, NotAdopted) as e:
            if self._lock.locked():  # another call is restoring it: wait without holding a thread
                while self.epoch == epoch and self.dead is None:
                    await asyncio.sleep(RESTART_POLL_S)
            else:
                await asyncio.to_thread(self.recover, epoch, e)
            if retry and self.dead is None:
                return await getattr(self.handle, method).remote(*args)
            raise ModelLost(f"model actor {self.name!r} died during {method}: {e}") from e

    def recover(self, epoch: int, error: BaseException) -> None:
        """Wait for Ray's restart of the actor, restore the last checkpoint into it, serve a new version."""
        with self._lock:
            if epoch != self.epoch or self.dead is not None:
                return  # recovered (or given up) by another call meanwhile
            self.restarts += 1
            if self.restarts > self.max_restarts:
                return self._give_up(f"model actor {self.name!r} died {self.restarts} times "
                                     f"(placement.max_restarts {self.max_restarts}): {error}")
            log.error("model actor %r died (%s); restoring it from the last checkpoint", self.name, error)
            try:
                info = self._wait_restarted()
                ckpt = checkpoint.load_latest(self.checkpoint_dir)
                if info["trainable"] and ckpt is not None and self.name in ckpt.models:
                    ray.get(self.handle.restore.remote(str(ckpt.path)))
                    log.warning("model %r restored from %s (run step %d at save)", self.name, ckpt.path, ckpt.step)
                elif info["trainable"]:
                    log.warning("model %r restarted from its initial weights: no checkpoint yet", self.name)
                # New weights, new version: episodes generated before stay older than what is served now.
                self.version = ray.get(self.handle.resume.remote(self.version + 1))
                self.info = ray.get(self.handle.adopt.remote())
            except Exception as e:  # cannot come back: the run cannot train this model any more
                return self._give_up(f"model actor {self.name!r} could not be restored: {e}")
            self.epoch += 1

    def _wait_restarted(self) -> dict[str, Any]:
        deadline = time.monotonic() + RESTART_WAIT_S
        while True:
            try:
                return ray.get(self.handle.info.remote(), timeout=max(deadline - time.monotonic(), 1.0))
            except RayActorError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(RESTART_POLL_S)

    def _give_up(self, why: str) -> None:
        self.dead = why
        log.error("%s", why)
        self.on_lost(ModelLost(why))


class RemoteEngine(Engine):
    """The `Engine` protocol over a model actor; the gateway uses it as it uses a local engine."""

    def __init__(self, link: ActorLink):
        self.link = link
        self.max_context: int = link.info["max_context"]

    @property
    def version(self) -> int:
        return self.link.version

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       on_token: Callable[[int], None] | None = None) -> Generation:
        gen: Generation = await self.link.acall("generate", list(prompt_ids), params, retry=True)
        if on_token is not None:
            for token in gen.token_ids:
                on_token(token)
        return gen

    async def pause(self) -> None:
        await self.link.acall("pause", retry=True)

    def pause_blocking(self) -> None:
        self.link.call("pause", retry=True)

    def hold(self) -> None:
        self.link.call("hold", retry=True)

    def resume(self, new_version: int | None = None) -> None:
        self.link.version = self.link.call("resume", new_version, retry=True)

    def swap_weights(self, apply: Callable[[], bool]) -> bool:
        """`apply` is the loop's `trainer.apply`: a RemoteTrainer, which sees `swapping` and has the actor
        apply the step between two of its decode steps; the actor's version then goes up, and so does ours."""
        self.link.swapping = True
        try:
            changed = bool(apply())
        finally:
            self.link.swapping = False
        if changed:
            self.link.version += 1
        return changed

    def load(self) -> EngineLoad:  # no retry: an actor that cannot answer is the watchdog's diagnosis
        return self.link.call("load")

    def close(self) -> None:
        try:
            ray.get(self.link.handle.close.remote(), timeout=30)
        except Exception as e:  # a dead actor has nothing left to close
            log.info("closing model actor %r: %s", self.link.name, e)
        ray.kill(self.link.handle, no_restart=True)


@dataclass
class RemotePrepared:
    """The driver's view of a step prepared in the actor (the samples stay there)."""

    needs_update: bool


class RemoteTrainer:
    """The trainer the run loop steps (`core.run.loop`), running in the model's actor."""

    def __init__(self, link: ActorLink):
        self.link = link
        self.lora: bool = link.info["lora"]
        self.overlap_safe: bool = link.info["overlap_safe"]

    @property
    def step_count(self) -> int:  # read by checkpoint manifests
        return self.link.call("info", retry=True)["step_count"]

    def prepare(self, groups: list[list[Any]]) -> RemotePrepared:
        return RemotePrepared(self.link.call("prepare", groups, retry=True))

    def backward(self, prepared: RemotePrepared) -> None:
        self.link.call("backward")

    def apply(self, prepared: RemotePrepared) -> bool:
        return self.link.call("apply", self.link.swapping)

    def outcome(self, prepared: RemotePrepared) -> StepOutcome:
        outcome: StepOutcome = self.link.call("outcome")
        outcome.metrics["placement/restarts"] = float(self.link.restarts)
        return outcome

    def discard(self) -> None:
        try:
            self.link.call("discard")
        except ModelLost:
            pass  # the gradients died with the actor

    def remote_save(self, folder: str) -> None:  # `core.run.checkpoint` writes this model's part through the actor
        self.link.call("save", folder)

    def remote_restore(self, path: str) -> None:
        self.link.call("restore", path)


class RayServer(Server):
    """The gateway serving remote engines; closing it ends the actors and, if it joined Ray, leaves it."""

    def close(self) -> None:
        try:
            super().close()
        finally:
            if ray.is_initialized():
                ray.shutdown()


def ray_core_run(cfg: RunConfig) -> RayRun:
    """Join (or start) the Ray cluster, place each model's actor, and build the run around them."""
    try:
        connect(cfg)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise PlacementError(f"cannot join the Ray cluster at {cfg.placement.address!r}: {e}") from e
    run: RayRun | None = None

    def lost(error: BaseException) -> None:  # a model beyond recovery: the run ends FAILED
        if run is not None:
            run.failure = error
            run.stop.set()

    # Replica actors come before the run; they reach it through `run`, set before anything is served.
    def episodes_lost(episode_ids: list[str]) -> None:  # a lost replica's open episodes: the run aborts them
        if run is not None:
            run.abort_lost(episode_ids)

    policies, trainers = {}, {}
    try:
        for mc in cfg.models:
            actor = ray.remote(ModelActor).options(
                num_cpus=mc.ray.num_cpus, num_gpus=mc.ray.num_gpus, resources=mc.ray.resources or None,
                max_restarts=cfg.placement.max_restarts, max_concurrency=max(cfg.server.max_open_episodes, 64),
            ).remote(cfg.model_dump(), mc.name)
            link = ActorLink(actor, mc.name, cfg, lost)
            tok = models.load_tokenizer(mc)
            engine = RemoteEngine(link)
            if mc.replicas > 1:  # rollouts on replica actors, synced from this model actor's trainer
                engine = ray_replicas(cfg, mc, actor, lambda link=link: link.call("weights_layout", retry=True),
                                      link.info["max_context"], on_lost=episodes_lost,
                                      is_open=lambda e: run is None or run.server.registry.is_open(e))
            policies[mc.name] = Policy(mc.name, None, tok, ChatRenderer(tok), engine, trainable=mc.trainable)
            if mc.trainable:
                trainers[mc.name] = RemoteTrainer(link)
    except RayActorError as e:  # an actor that cannot even start (its model does not load)
        ray.shutdown()
        raise PlacementError(f"a model actor failed to start: {e}") from e
    except Exception:
        ray.shutdown()
        raise
    # The policies' engines have their callbacks; the server's on_lost is for engines it loads itself.
    run = RayRun(cfg, lambda cfg, on_lost, **hooks: RayServer(cfg, policies, **hooks), trainers)
    return run


def connect(cfg: RunConfig) -> None:
    address = cfg.placement.address
    env = {k: os.environ[k] for k in ACTOR_ENV if k in os.environ}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH", "")) if p)
    if not ray.is_initialized():
        ray.init(address=None if address == "local" else address, namespace=cfg.placement.namespace,
                 runtime_env={"env_vars": env}, log_to_driver=True)
    log.info("Ray placement on %s: %s", address, ray.cluster_resources())
