"""A core run, start to finish: server, trainers, local clients, telemetry, checkpoints.

This is the one file that holds the whole RL loop:

    start the server (policies behind the gateway) and the configured clients
    repeat `trainer.steps` times:
        wait for `batch_groups` ready groups (episodes that clients finished)
        for each trainable policy: pause + drain its engine, one trainer step, version + 1, resume
        log metrics and a few trajectories to MLflow; checkpoint every N steps
    checkpoint, stop clients, stop the server

Colocated weight sync is just the pause: engine and trainer share the same module, so the new
weights are live the moment the engine resumes. Ctrl-C (or `/admin/shutdown`) stops after the
current step with a checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from core import checkpoint
from core.config import RunConfig, flatten
from core.sandbox import load_agent, run_agent
from core.server import Server
from core.telemetry import Telemetry
from core.train.trainer import Trainer, seed_everything

log = logging.getLogger(__name__)

BATCH_POLL_S = 0.05  # how often the trainer looks for ready groups
CLIENT_DRAIN_S = 30.0  # how long clients get to finish in-flight episodes at the end of a run


class CoreRun:
    def __init__(self, cfg: RunConfig, server: Server | None = None):
        seed_everything(cfg.trainer.seed)
        self.cfg = cfg
        self.server = server or Server(cfg)
        self.trainers = {
            name: Trainer(p.model, cfg.trainer, name, lora=_lora(cfg, name))
            for name, p in self.server.policies.items()
            if p.trainable
        }
        self.step = 0
        self.stop = threading.Event()
        self.telemetry: Telemetry | None = None
        self.server.on_checkpoint = self.checkpoint
        self.server.on_shutdown = self.stop.set
        self._clients_stop: asyncio.Event | None = None
        self._clients_loop: asyncio.AbstractEventLoop | None = None
        self._client_threads: list[threading.Thread] = []
        self._client_procs: list[subprocess.Popen] = []
        self._last = (time.time(), 0)  # (time, completion tokens served) at the previous step

    # -- lifecycle -------------------------------------------------------------------------------
    def resume(self) -> None:
        ckpt = checkpoint.load_latest(self.cfg.trainer.checkpoint_dir)
        if ckpt is None:
            log.info("no checkpoint under %s; starting fresh", self.cfg.trainer.checkpoint_dir)
            return
        checkpoint.restore(ckpt, self.trainers)
        for name, version in ckpt.versions.items():
            if name in self.server.policies:
                self.server.policies[name].engine.resume(version)
                self.server.policies[name].step = ckpt.step
        self.server.registry.restore(ckpt.buffered)
        self.step = ckpt.step
        log.info("resumed from %s at step %d with %d buffered groups", ckpt.path, ckpt.step, len(ckpt.buffered))

    def checkpoint(self) -> str:
        path = checkpoint.save(
            self.cfg.trainer.checkpoint_dir, self.step, self.trainers, self.server.registry.buffered(),
            self.server.versions(), self.cfg.model_dump(), keep=self.cfg.trainer.keep_checkpoints,
        )
        log.info("checkpoint written to %s", path)
        return str(path)

    def start_clients(self) -> None:
        url = self.server.url
        local = [c for c in self.cfg.clients if not c.isolate]
        for c in self.cfg.clients:
            if c.isolate:
                cmd = [sys.executable, "-m", "core.cli", "client", c.agent, "--server", url,
                       "--concurrency", str(c.concurrency), "--group-size", str(c.group_size or self.cfg.trainer.group_size),
                       "--kind", c.kind]
                self._client_procs.append(subprocess.Popen(cmd))
        if local:
            agents = [(c, load_agent(c.agent)) for c in local]  # import errors surface before training starts
            ready = threading.Event()
            t = threading.Thread(target=self._run_local_clients, args=(agents, url, ready), daemon=True, name="clients")
            t.start()
            ready.wait()
            self._client_threads.append(t)

    def _run_local_clients(self, agents, url: str, ready: threading.Event) -> None:
        async def main() -> None:
            self._clients_loop = asyncio.get_running_loop()
            self._clients_stop = asyncio.Event()
            ready.set()
            await asyncio.gather(*(
                run_agent(agent, url, concurrency=c.concurrency, group_size=c.group_size or self.cfg.trainer.group_size,
                          kind=c.kind, split=c.split, max_tasks=c.tasks, stop=self._clients_stop)
                for c, agent in agents
            ), return_exceptions=False)

        try:
            asyncio.run(main())
        except Exception:
            log.exception("local clients crashed")
        finally:
            ready.set()

    def stop_clients(self) -> None:
        if self._clients_loop is not None and self._clients_stop is not None:
            self._clients_loop.call_soon_threadsafe(self._clients_stop.set)
        for p in self._client_procs:
            p.send_signal(signal.SIGTERM)
        for t in self._client_threads:
            t.join(timeout=CLIENT_DRAIN_S)
        for p in self._client_procs:
            try:
                p.wait(timeout=CLIENT_DRAIN_S)
            except subprocess.TimeoutExpired:
                p.kill()

    # -- the loop --------------------------------------------------------------------------------
    def train(self, on_step=None) -> None:
        """Train until `trainer.steps` steps are done or `stop` is set."""
        registry = self.server.registry
        while self.step < self.cfg.trainer.steps and not self.stop.is_set():
            batch = registry.take_batch(self.server.versions(), self.cfg.trainer.max_staleness)
            if batch is None:
                self.stop.wait(BATCH_POLL_S)
                continue
            metrics: dict[str, float] = {"episodes/stale_dropped": float(batch.dropped_stale)}
            for name, trainer in self.trainers.items():
                policy = self.server.policies[name]
                groups = [g for g in ([e for e in group if e.calls_of(name)] for group in batch.groups) if g]
                if not groups:
                    continue
                policy.engine.pause_blocking()  # drain in-flight generations; new ones queue (latency, not errors)
                try:
                    step_metrics = trainer.step(groups)
                except ValueError as e:  # a malformed episode: skip this batch for this model, keep the run
                    log.error("step %d of %s skipped: %s", self.step + 1, name, e)
                    policy.engine.resume()
                    metrics[f"{name}/train/failed"] = 1.0
                    continue
                policy.engine.resume(policy.version + 1)
                policy.step += 1
                prefix = "" if len(self.trainers) == 1 else f"{name}/"
                metrics.update({prefix + k: v for k, v in step_metrics.items()})
            self.step += 1
            metrics.update(self._rollout_metrics(len(batch.episodes)))
            if self.telemetry is not None:
                self.telemetry.log(self.step, metrics)
                self.telemetry.log_trajectories(self.step, batch.episodes)
            if self.cfg.trainer.checkpoint_every and self.step % self.cfg.trainer.checkpoint_every == 0:
                self.checkpoint()
            if on_step is not None:
                on_step(self.step, metrics)

    def _rollout_metrics(self, trained: int) -> dict[str, float]:
        now, tokens = time.time(), self.server.throughput.completion_tokens
        then, then_tokens = self._last
        self._last = (now, tokens)
        dt = max(now - then, 1e-9)
        counters = self.server.registry.counters
        out = {
            "rollout/episodes_per_s": trained / dt,
            "rollout/tokens_per_s": (tokens - then_tokens) / dt,
            "episodes/aborted": float(counters["aborted"]),
            "episodes/expired": float(counters["expired"]),
        }
        by_sandbox: dict[str, list[float]] = {}
        for ep in self.server.registry.take_eval():
            if ep.reward:
                by_sandbox.setdefault(ep.sandbox, []).append(sum(ep.reward.values()) / len(ep.reward))
        for sandbox, rewards in by_sandbox.items():
            out[f"eval/{sandbox}/mean"] = sum(rewards) / len(rewards)
        return out


def _lora(cfg: RunConfig, name: str) -> bool:
    return next(m for m in cfg.models if m.name == name).lora is not None


def run(cfg: RunConfig, resume: bool = False, run_id_file: Path | None = None, progress: bool = True) -> int:
    """`swarm run`: returns the process exit code (0 done, 130 interrupted, 1 failed)."""
    core = CoreRun(cfg)
    tags = {"swarmrl.kind": "core-run", **cfg.telemetry.tags}
    core.telemetry = Telemetry(cfg.telemetry, flatten(cfg), tags)
    if run_id_file is not None:
        Path(run_id_file).parent.mkdir(parents=True, exist_ok=True)
        Path(run_id_file).write_text(core.telemetry.run_id)
    if resume:
        core.resume()
    previous = signal.signal(signal.SIGINT, lambda *_: core.stop.set())
    signal.signal(signal.SIGTERM, lambda *_: core.stop.set())
    status, code = "FAILED", 1
    try:
        core.server.start()
        log.info("serving at %s; training %d steps", core.server.url, cfg.trainer.steps)
        core.start_clients()
        if progress:
            with _progress_bar(cfg.trainer.steps, core.step) as (bar, task):
                core.train(on_step=lambda step, m: bar.update(task, completed=step, **_progress_fields(m)))
        else:
            core.train(on_step=lambda step, m: log.info("step %d reward %.3f", step, m.get("reward/mean", float("nan"))))
        interrupted = core.stop.is_set() and core.step < cfg.trainer.steps
        status, code = ("KILLED", 130) if interrupted else ("FINISHED", 0)
        core.checkpoint()
    except Exception:
        log.exception("core run failed")
    finally:
        signal.signal(signal.SIGINT, previous)
        core.stop_clients()
        core.server.stop()
        core.telemetry.close(status)
    return code


def serve(cfg: RunConfig, train: bool) -> None:
    """`swarm serve`: the server in the foreground; with `train`, a trainer thread consumes finished groups."""
    server = Server(cfg)
    if train:
        core = CoreRun(cfg, server)
        core.telemetry = Telemetry(cfg.telemetry, flatten(cfg), {"swarmrl.kind": "serve", **cfg.telemetry.tags})
        thread = threading.Thread(target=core.train, daemon=True, name="trainer")
        thread.start()
        try:
            server.serve_forever()
        finally:
            core.stop.set()
            thread.join(timeout=60)
            core.telemetry.close("FINISHED")
    else:
        server.serve_forever()


@contextmanager
def _progress_bar(total: int, done: int):
    columns = (TextColumn("step {task.completed}/{task.total}"), BarColumn(), TextColumn("reward {task.fields[reward]}"),
               TextColumn("{task.fields[eps]} ep/s"), TextColumn("ETA"), TimeRemainingColumn())
    with Progress(*columns) as bar:
        yield bar, bar.add_task("train", total=total, completed=done, reward="-", eps="-")


def _progress_fields(m: dict[str, float]) -> dict[str, str]:
    return {"reward": f"{m.get('reward/mean', float('nan')):.3f}", "eps": f"{m.get('rollout/episodes_per_s', 0):.1f}"}

