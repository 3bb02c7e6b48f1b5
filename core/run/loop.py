"""A core run, start to finish: server, trainers, local clients, telemetry, checkpoints.

This is the one file that holds the whole RL loop:

    start the server (policies behind the gateway) and the configured clients (isolated ones as
        processes that `core.run.supervisor` restarts when they die, contained per `containment.clients`)
    repeat `trainer.steps` times, under the hang watchdog (`core.run.watchdog`):
        wait for `batch_groups` ready groups (episodes that clients finished; admission control
            refuses new groups beyond what the staleness budget can train, so none is wasted)
        for each trainable policy, one trainer step (prepare, backward, apply):
            on-policy (max_staleness 0): hold new generations, drain, step, resume
            overlapped (max_staleness >= 1): keep generating; swap weights between two decode steps
            the version goes up only if the weights changed (not on zero advantages, skips, errors)
        log metrics (`time/*` breakdown; the rollout's, `core.run.rollout_metrics`) and a few trajectories to MLflow;
        checkpoint every N steps
    checkpoint, stop clients, stop the server

Colocated weight sync is just the pause or the swap: engine and trainer share the same module, so
the new weights are live at the next decode step. Any exception in a step is logged with the step;
the engine always resumes and the run goes on, unless `trainer.max_failed_steps` steps in a row
failed: then the run ends FAILED (`failure` set), rather than reporting FINISHED having learnt nothing. A checkpoint never interleaves with a step.
`/admin/shutdown` (and Ctrl-C or SIGTERM, through `core.run.processes`) stops after the current step.
The processes around this loop (`swarm run`, `swarm serve`: resume, signals, the MLflow run's final
status) live in `core.run.processes`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from core.run import checkpoint
from core.config import RunConfig
from core.contain.contained import require_bwrap
from core.local_state import token_files
from core.engine.replicas import ReplicaBehind
from core.episodes.errors import Refusal
from core.episodes.batching import Batch, Sieve
from core.records import Episode
from core.clients.runner import run_agent
from core.clients.sandbox import code_version, load_agent
from core.sandbox.folder import locate, sandbox_roots
from core.serve.server import Server
from core.run.client_command import ClientSpec
from core.run.supervisor import Supervisor
from core.run.rollout_metrics import RolloutMeter
from core.run.telemetry import Telemetry
from core.contain.venvs import client_python
from core.episodes.credentials import GRANT_ENV
from core.episodes.wire import ClientGrant, SwapRecord
from core.train.distributed import build_trainer
from core.train.outcome import StepOutcome
from core.train.trainer import Trainer, seed_everything
from core.run.watchdog import Watchdog, run_folder

log = logging.getLogger(__name__)

BATCH_POLL_S = 0.05  # how often the trainer looks for ready groups
CLIENT_DRAIN_S = 30.0  # how long clients get to finish in-flight episodes at the end of a run


class ServerFactory(Protocol):
    """Builds the server a run trains through, with the run's callbacks (`core.serve.server.Server` is one)."""

    def __call__(self, cfg: RunConfig, *, on_checkpoint: Callable[[], str], on_shutdown: Callable[[], None],
                 on_swap: Callable[[SwapRecord], None], on_lost: Callable[[list[str]], None]) -> Server: ...


class CoreRun:
    def __init__(self, cfg: RunConfig, server: ServerFactory = Server, trainers: dict[str, Trainer] | None = None):
        """`server` builds the server this run trains through, handed the run's callbacks (`ServerFactory`);
        `trainers`: given by a placement that hosts them elsewhere (`core.ray.actors`), else built here.
        Raises ConfigError before any model loads when `containment.clients: required` and bwrap is missing."""
        require_bwrap(cfg.containment.clients, "containment.clients")
        seed_everything(cfg.trainer.seed)
        self.cfg = cfg
        self.step = 0
        self.stop = threading.Event()
        self._step_lock = threading.RLock()  # a checkpoint (also `/admin/checkpoint`) never interleaves with a step
        self.telemetry: Telemetry | None = None
        # `swarm swap` drained old clients: tag it on the run. A lost replica's episodes are aborted, never
        # trained half-done.
        self.server = server(cfg, on_checkpoint=self.checkpoint, on_shutdown=self.stop.set, on_swap=self._on_swap,
                             on_lost=self.abort_lost)
        self.trainers = trainers if trainers is not None else {
            name: build_trainer(p.model, cfg, name)  # one process, or data-parallel ranks (core.train.distributed)
            for name, p in self.server.policies.items()
            if p.trainable
        }
        self._checkpointed_at = time.monotonic()  # for `trainer.checkpoint_every_s`
        if self.trainers:
            self.server.registry.admit_within(cfg.trainer.max_staleness)
            if cfg.trainer.dynamic_sampling == "filter":  # tied groups never reach the trainers (core.episodes.batching)
                self.server.registry.sieve = Sieve(cfg.trainer.tie_tolerance, cfg.trainer.max_refills,
                                                 cfg.trainer.oversample)
            self.server.allow_anonymous = False  # during training every generation belongs to an episode: 401
        self.failure: BaseException | None = None  # what ended the run early (local clients crashed), if anything
        self._failed_in_a_row = 0  # train steps that failed since the last one that did not
        self._clients_stop: asyncio.Event | None = None
        self._clients_loop: asyncio.AbstractEventLoop | None = None
        self._client_threads: list[threading.Thread] = []
        # Isolated clients: restarted when they die; a client that keeps dying without work fails the run.
        self.supervisor = Supervisor(self.server.registry.finished_by, self._give_up, cfg.containment,
                                     hidden=token_files(run_folder(cfg.trainer.checkpoint_dir)))
        self._rollout = RolloutMeter(self.server)  # rates since the previous step, per-version rewards

    # -- lifecycle -------------------------------------------------------------------------------
    def resume(self) -> checkpoint.Checkpoint | None:
        """Restore the latest checkpoint, if any; returns it (its `mlflow` names the run to reopen)."""
        ckpt = checkpoint.load_latest(self.cfg.trainer.checkpoint_dir)
        if ckpt is None:
            log.info("no checkpoint under %s; starting fresh", self.cfg.trainer.checkpoint_dir)
            return None
        checkpoint.restore(ckpt, self.trainers)
        checkpoint.restore_samplers(ckpt, {n: p.engine for n, p in self.server.policies.items()})
        for name, version in ckpt.versions.items():
            if name in self.server.policies:
                self.server.policies[name].engine.resume(version)
                self.server.policies[name].step = ckpt.step
        self.server.registry.restore(ckpt.buffered)
        self.server.dealer.restore(ckpt.dealer)
        self.step = ckpt.step
        log.info("resumed from %s at step %d with %d buffered groups", ckpt.path, ckpt.step, len(ckpt.buffered))
        return ckpt

    def checkpoint(self) -> str:
        t = self.telemetry
        with self._step_lock:
            path = checkpoint.save(
                self.cfg.trainer.checkpoint_dir, self.step, self.trainers, self.server.registry.buffered(),
                self.server.versions(), self.cfg.model_dump(), keep=self.cfg.trainer.keep_checkpoints,
                mlflow=checkpoint.MlflowRun(run_id=t.run_id, tracking_uri=t.store_uri) if t is not None else None,
                samplers=checkpoint.samplers_of({n: p.engine for n, p in self.server.policies.items()}),
                dealer=self.server.dealer.state(),
            )
        self._checkpointed_at = time.monotonic()
        log.info("checkpoint written to %s", path)
        return str(path)

    def start_clients(self) -> None:
        url = self.server.url
        local = [c for c in self.cfg.clients if not c.isolate]
        roots = sandbox_roots(self.cfg.source_file)  # `sandbox:NAME` is looked up in the config's project first
        for i, c in enumerate(self.cfg.clients):
            if c.isolate:
                spec = locate(c.agent, roots)  # an absolute folder: the client runs in a working folder of its own
                workdir = run_folder(self.cfg.trainer.checkpoint_dir) / "clients" / f"{i}-{c.sandbox_name}"
                version = code_version(spec)  # read here, where the folder's git is visible; bound and passed on
                cmd = ClientSpec(client_python(spec), spec, url, concurrency=c.concurrency,
                                 group_size=c.group_size or self.cfg.trainer.group_size, kind=c.kind, workdir=workdir,
                                 split=c.split, tasks=c.tasks or None, episode_timeout=c.episode_timeout,
                                 seed=f"{self.cfg.trainer.seed}/{i}", code_version=version).to_argv()
                credential = self._credential(c, i, version)
                self.supervisor.start(c.agent, cmd, workdir, reads=[Path(spec)] if Path(spec).is_dir() else [],
                                      server=url, env={GRANT_ENV: credential})
        if local:
            agents = [(c, load_agent(c.agent, roots), i)  # import errors surface before training starts
                      for i, c in enumerate(self.cfg.clients) if not c.isolate]
            ready = threading.Event()
            t = threading.Thread(target=self._run_local_clients, args=(agents, url, ready), daemon=True, name="clients")
            t.start()
            ready.wait()
            self._client_threads.append(t)

    def _credential(self, c, i: int, version: str) -> str:
        """Client `i`'s credential, bound to what the config says it is (`core.episodes.credentials`)."""
        return self.server.credentials.issue(ClientGrant(
            sandbox=c.sandbox_name, version=version, kind=c.kind, split=c.split,
            group_size=c.group_size or self.cfg.trainer.group_size, concurrency=c.concurrency,
            seed=f"{self.cfg.trainer.seed}/{i}", models=list(self.server.policies)))

    def _run_local_clients(self, agents, url: str, ready: threading.Event) -> None:
        async def main() -> None:
            self._clients_loop = asyncio.get_running_loop()
            self._clients_stop = asyncio.Event()
            ready.set()
            await asyncio.gather(*(
                run_agent(agent, url, concurrency=c.concurrency, group_size=c.group_size or self.cfg.trainer.group_size,
                          kind=c.kind, split=c.split, max_tasks=c.tasks, stop=self._clients_stop,
                          episode_timeout_s=c.episode_timeout, seed=f"{self.cfg.trainer.seed}/{i}",
                          credential=self._credential(c, i, agent.version))  # each client its own task order
                for c, agent, i in agents
            ), return_exceptions=False)

        try:
            asyncio.run(main())
        except Exception as e:  # no client is left to feed the trainer: end the run as failed, not hung
            log.exception("local clients crashed")
            self.failure = e
            self.stop.set()
        finally:
            ready.set()

    def abort_lost(self, episode_ids: list[str]) -> None:
        """A replica was lost: its open episodes end aborted (their clients open new ones)."""
        for episode_id in episode_ids:
            try:
                self.server.registry.abort(episode_id, "the replica serving it was lost")
            except Refusal:
                pass  # it ended meanwhile (finished, expired): nothing to abort
        log.warning("aborted %d episode(s) of a lost replica", len(episode_ids))

    def _give_up(self, why: str) -> None:
        """An isolated client keeps dying before doing any work: end the run as failed, with the reason."""
        log.error("%s", why)
        self.failure = RuntimeError(why)
        self.stop.set()

    def stop_clients(self) -> None:
        loop = self._clients_loop
        if loop is not None and self._clients_stop is not None:
            try:
                loop.call_soon_threadsafe(self._clients_stop.set)
            except RuntimeError:  # the local clients' loop already closed (their tasks() raised): nothing to stop
                pass
        # Registered clients this run did not start (`swarm swap` started them) end with it too: the
        # server tells them to drain at their next heartbeat; they are not ours to signal.
        deadline = time.monotonic() + CLIENT_DRAIN_S
        self.server.clients.drain_all()
        for t in self._client_threads:
            t.join(timeout=CLIENT_DRAIN_S)
        self.supervisor.stop(CLIENT_DRAIN_S)
        while self.server.clients.count() and time.monotonic() < deadline:
            time.sleep(BATCH_POLL_S)

    def _on_swap(self, record: SwapRecord) -> None:
        """A hot swap happened (the server drained old clients for a registered successor): tag the
        MLflow run `swarmrl.sandbox_swap.<n>` with it and the trainer step. Telemetry never stops training."""
        record.step = self.step
        log.info("hot swap %d of %s at step %d: %s -> %s", record.n, record.sandbox, self.step,
                 ",".join(record.from_versions), record.to_version)
        t = self.telemetry
        if t is not None:
            try:
                t.client.set_tag(t.run_id, f"swarmrl.sandbox_swap.{record.n}", record.model_dump_json())
            except Exception as e:  # noqa: BLE001 - an unreachable tracking store must not fail the swap
                log.warning("could not tag hot swap %d on MLflow: %s", record.n, e)

    # -- the loop --------------------------------------------------------------------------------
    def train(self, on_step=None) -> None:
        """Train until `trainer.steps` steps are done or `stop` is set, under the hang watchdog."""
        stall_s = self.cfg.server.stall_s
        watchdog = Watchdog(self.server, stall_s, run_folder(self.cfg.trainer.checkpoint_dir),
                            lambda: self.step).start() if stall_s else None
        try:
            self._train(on_step)
        finally:
            if watchdog is not None:
                watchdog.stop()

    def _train(self, on_step) -> None:
        registry = self.server.registry
        for name, trainer in self.trainers.items():  # after `resume`: an FSDP2 trainer's replicas stream from its
            getattr(trainer, "stream_to", lambda _: None)(self.server.policies[name].engine)  # shards (no module)
        idle_since = time.perf_counter()  # the trainer waits for groups from here
        while self.step < self.cfg.trainer.steps and not self.stop.is_set():
            # Taken under the step lock: a checkpoint sees the batch either still buffered or trained,
            # never taken out of the registry and not yet in the weights.
            with self._step_lock:
                batch = registry.take_batch(self.server.versions(), self.cfg.trainer.max_staleness)
                if batch is not None:
                    taken = time.perf_counter()
                    batch.put_in_stable_order()
                    outcomes = self._train_batch(batch)
                    self.step += 1
            if batch is None:
                self.stop.wait(BATCH_POLL_S)
                continue
            metrics = self._step_metrics(batch, outcomes)
            metrics["time/wait_groups_s"] = taken - idle_since
            metrics["time/step_s"] = time.perf_counter() - idle_since
            metrics.update(self._rollout.metrics(batch))
            if self.telemetry is not None:
                self.telemetry.log(self.step, metrics)
                self.telemetry.log_trajectories(self.step, batch.episodes)
            every, every_s = self.cfg.trainer.checkpoint_every, self.cfg.trainer.checkpoint_every_s
            if (every and self.step % every == 0) or (every_s and time.monotonic() - self._checkpointed_at >= every_s):
                self.checkpoint()
            if on_step is not None:
                on_step(self.step, metrics)
            if self._too_many_failures(outcomes) or self._replica_failed():
                return
            idle_since = time.perf_counter()

    def _replica_failed(self) -> bool:
        """A replica that could not be brought back (`core.engine.replicas.RESTARTS`) fails the run."""
        lost = next((p.engine.failure for p in self.server.policies.values() if p.engine.failure is not None), None)
        if lost is not None:
            self.failure = lost
            log.error("%s", lost)
            self.stop.set()
        return lost is not None

    def _too_many_failures(self, outcomes: dict[str, StepOutcome]) -> bool:
        """Count a step in which some policy's step failed, or was skipped for a non-finite loss or gradient
        (it learnt nothing either); `trainer.max_failed_steps` such steps in a row fail the run."""
        failed = any(o.learnt_nothing for o in outcomes.values())
        self._failed_in_a_row = self._failed_in_a_row + 1 if failed else 0
        limit = self.cfg.trainer.max_failed_steps
        if self._failed_in_a_row < limit:
            return False
        self.failure = RuntimeError(f"{limit} train steps in a row failed or were skipped (non-finite loss or "
                                    f"gradient), the last at step {self.step} (trainer.max_failed_steps); their "
                                    "errors are logged above")
        log.error("%s", self.failure)
        self.stop.set()
        return True

    def _train_batch(self, batch: Batch) -> dict[str, StepOutcome]:
        """One step of every trainable policy that served the batch, the weight-sync mode per policy; each
        stepped policy's outcome (a policy none of the batch's episodes called takes no step)."""
        plan = {name: [g for g in ([e for e in group if e.calls_of(name)] for group in batch.groups) if g]
                for name in self.trainers}
        overlap = {name: self.cfg.trainer.max_staleness >= 1 and self.trainers[name].overlap_safe for name in plan}
        for name, groups in plan.items():
            if groups and not overlap[name]:
                # At once, before anything else: a call that arrives from now on waits for this step's
                # weights, so an episode admitted in the room this batch leaves is not stale on arrival.
                self.server.policies[name].engine.hold()
            elif groups:
                self.server.registry.step_started()
        return {name: self._step_policy(name, groups, overlap[name]) for name, groups in plan.items() if groups}

    def _step_metrics(self, batch: Batch, outcomes: dict[str, StepOutcome]) -> dict[str, float]:
        """The step's own metrics: each policy's (prefixed by its name when several train), and the train
        and sync time summed over them."""
        metrics: dict[str, float] = {"episodes/stale_dropped": float(batch.dropped_stale), "time/train_s": 0.0,
                                     "time/sync_s": 0.0}
        metrics.update(batch.metrics())  # dynamic sampling: train/groups_filtered and each sandbox's filtered share
        for name, outcome in outcomes.items():
            prefix = "" if len(self.trainers) == 1 else f"{name}/"
            metrics.update({prefix + k: v for k, v in outcome.logged().items()})
            for k, seconds in outcome.timings.items():
                metrics[k] += seconds
        return metrics

    def _step_policy(self, name: str, groups: list[list[Episode]], overlap: bool) -> StepOutcome:
        """prepare -> backward -> apply for one policy. The engine always resumes and the version goes up
        only when the weights changed; an exception is logged with the step and the run goes on."""
        trainer, policy = self.trainers[name], self.server.policies[name]
        started, synced, updated = time.perf_counter(), 0.0, False
        try:
            prepared = trainer.prepare(groups)
            if not prepared.needs_update:
                trainer.apply(prepared)  # counts the step; nothing can change, so nothing waits
            elif overlap:
                trainer.backward(prepared)  # generation goes on meanwhile
                swap_started = time.perf_counter()
                applied = []
                updated = policy.engine.swap_weights(lambda: _timed(applied, trainer.apply, prepared))
                synced = time.perf_counter() - swap_started - sum(applied)
            else:
                drain_started = time.perf_counter()
                policy.engine.pause_blocking()  # held since the batch was taken: wait for rows in flight
                policy.engine.sleep_during_step()  # colocated GPU replicas give the step their memory (none on CPU)
                synced = time.perf_counter() - drain_started
                trainer.backward(prepared)
                updated = trainer.apply(prepared)
            policy.step += 1
            outcome = trainer.outcome(prepared)
        except ReplicaBehind:
            raise  # inference would go on serving old weights: the run fails, loudly
        except Exception:
            log.exception("step %d of %s failed; its weights and version are unchanged", self.step + 1, name)
            trainer.discard()
            outcome = StepOutcome.failure()
        finally:
            if overlap:
                self.server.registry.step_synced()
            else:
                policy.engine.wake_after_step()  # before resume: a sync needs the replicas awake
                policy.engine.resume(policy.version + 1 if updated else None)
        outcome.timings = {"time/sync_s": synced, "time/train_s": time.perf_counter() - started - synced}
        return outcome


def _timed(spent: list[float], fn, *args):
    """Call `fn(*args)` and append the seconds it took to `spent` (time inside a weight swap)."""
    start = time.perf_counter()
    try:
        return fn(*args)
    finally:
        spent.append(time.perf_counter() - start)
