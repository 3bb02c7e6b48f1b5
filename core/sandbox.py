"""Client runners: load an agent (a sandbox folder or a module) and keep N episodes in flight.

An agent is anything with `tasks(split)` yielding task dicts and `async rollout(task, llm)` returning
a reward (or an `Outcome`), where `llm` is an `openai.AsyncOpenAI` already bound to the episode. A
sandbox is such an agent in a folder `sandboxes/<name>/` with `agent.py` and `sandbox.toml`.

The runner opens `group_size` episodes per task, runs them concurrently under a semaphore, retries an
episode that crashed so its group can complete, and drains in-flight episodes on SIGTERM before it
exits; hot swap is "start the new process, SIGTERM the old one". It runs in-process (`swarm run`) or
as its own OS process (`swarm client`). It does not know about training.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from core.client import SwarmClient, SwarmError

log = logging.getLogger(__name__)

EPISODE_ATTEMPTS = 3  # a crashed episode is retried so its group can still fill
PID_DIR_ENV = "SWARMRL_STATE"  # where running clients leave pid files for `swarm swap`


@dataclass
class Outcome:
    reward: float | dict[str, float]
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Agent:
    name: str  # the sandbox name: groups are keyed by (name, task_id)
    tasks: Callable[[str], Iterable[dict[str, Any]]]
    rollout: Callable[[dict[str, Any], Any], Awaitable[float | Outcome]]
    version: str  # code version recorded on every episode
    folder: Path | None = None


@dataclass
class RunnerStats:
    finished: int = 0
    failed: int = 0
    rewards: list[float] = field(default_factory=list)


def load_agent(spec: str, root: Path = Path("sandboxes")) -> Agent:
    """`sandbox:NAME`, a folder holding agent.py, or an importable module with tasks() and rollout()."""
    name = spec.removeprefix("sandbox:")
    folder = Path(name) if Path(name).is_dir() else root / name
    if spec.startswith("sandbox:") or (folder / "agent.py").is_file():
        if not (folder / "agent.py").is_file():
            raise ValueError(f"sandbox {name!r}: no agent.py in {folder}")
        meta = _sandbox_meta(folder)
        module = _import_file(folder / meta.get("entry", "agent.py"), f"sandbox_{meta.get('name', folder.name)}")
        return _agent_from(module, meta.get("name", folder.name), _folder_version(folder), folder)
    try:
        module = importlib.import_module(spec)
    except ImportError as e:
        raise ValueError(f"agent {spec!r} is neither a sandbox folder nor an importable module: {e}") from None
    src = Path(module.__file__ or spec)
    version = hashlib.sha1(src.read_bytes()).hexdigest()[:12] if src.is_file() else "unknown"
    return _agent_from(module, spec.rsplit(".", 1)[-1], version, None)


def _sandbox_meta(folder: Path) -> dict[str, Any]:
    path = folder / "sandbox.toml"
    if not path.is_file():
        return {"name": folder.name}
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: {e}") from None


def _import_file(path: Path, module_name: str):
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))  # sandbox-local helper modules import as siblings
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise ValueError(f"{path} failed to import: {type(e).__name__}: {e}") from e
    finally:
        sys.path.remove(str(path.parent))
    return module


def _agent_from(module, name: str, version: str, folder: Path | None) -> Agent:
    for attr in ("tasks", "rollout"):
        if not callable(getattr(module, attr, None)):
            raise ValueError(f"agent {name!r} must define {attr}()")
    if not asyncio.iscoroutinefunction(module.rollout):
        raise ValueError(f"agent {name!r}: rollout must be `async def rollout(task, llm)`")
    return Agent(name, module.tasks, module.rollout, version, folder)


def _folder_version(folder: Path) -> str:
    """The git commit of the folder when clean, else a hash of its files: every episode names its code."""
    try:
        out = subprocess.run(["git", "-C", str(folder), "log", "-1", "--format=%H", "--", "."],
                             capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", str(folder), "status", "--porcelain", "--", "."],
                               capture_output=True, text=True, timeout=5)
        if out.returncode == 0 and out.stdout.strip() and not dirty.stdout.strip():
            return out.stdout.strip()[:12]
    except (OSError, subprocess.TimeoutExpired):
        pass
    digest = hashlib.sha1()
    for f in sorted(folder.rglob("*.py")) + sorted(folder.glob("*.toml")):
        digest.update(f.read_bytes())
    return "sha1-" + digest.hexdigest()[:12]


async def run_agent(
    agent: Agent,
    url: str,
    *,
    concurrency: int,
    group_size: int,
    kind: str = "train",
    split: str = "train",
    max_episodes: int = 0,
    max_tasks: int | None = None,
    stop: asyncio.Event | None = None,
    stats: RunnerStats | None = None,
) -> RunnerStats:
    """Keep `concurrency` episodes in flight until `stop` is set or the episode/task budget is spent."""
    stop = stop or asyncio.Event()
    stats = stats or RunnerStats()
    client = SwarmClient(url, client_id=f"{agent.name}-{os.getpid()}", client_version=agent.version)
    slots = asyncio.Semaphore(concurrency)
    running: set[asyncio.Task] = set()
    started = 0

    async def one(task: dict[str, Any], task_id: str) -> None:
        try:
            for attempt in range(EPISODE_ATTEMPTS):
                try:
                    async with client.aepisode(task_id, agent.name, group_size, kind, cancel=stop) as ep:
                        out = await agent.rollout(task, ep.openai)
                        out = out if isinstance(out, Outcome) else Outcome(float(out))
                        await ep.finish(out.reward, out.metrics or None)
                    stats.finished += 1
                    if isinstance(out.reward, (int, float)):
                        stats.rewards.append(float(out.reward))
                    return
                except SwarmError as e:
                    if e.status == 503:
                        return  # stopping, or the server is gone for good: retrying the episode cannot help
                    log.warning("episode of task %s failed (attempt %d): %s", task_id, attempt + 1, e)
                except Exception as e:  # agent code crashed: the episode was aborted; try the task again
                    log.warning("agent %s crashed on task %s (attempt %d): %s: %s", agent.name, task_id, attempt + 1, type(e).__name__, e)
                stats.failed += 1
        finally:
            slots.release()

    try:
        tasks_done = 0
        while not stop.is_set() and (max_tasks is None or tasks_done < max_tasks):
            empty = True
            for index, task in enumerate(agent.tasks(split)):
                empty = False
                task_id = str(task.get("id", index)) if isinstance(task, dict) else str(index)
                for _ in range(group_size):
                    await _acquire(slots, stop)
                    if stop.is_set() or (max_episodes and started >= max_episodes):
                        stop.set()
                        break
                    t = asyncio.create_task(one(task, task_id))
                    running.add(t)
                    t.add_done_callback(running.discard)
                    started += 1
                tasks_done += 1
                if stop.is_set() or (max_tasks is not None and tasks_done >= max_tasks):
                    break
            if empty:
                raise ValueError(f"agent {agent.name!r} yielded no tasks for split {split!r}")
        if running:
            await asyncio.gather(*running, return_exceptions=True)  # drain: in-flight episodes finish
    finally:
        for t in running:
            t.cancel()
        client.close()
    return stats


async def _acquire(slots: asyncio.Semaphore, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            await asyncio.wait_for(slots.acquire(), timeout=0.2)
            return
        except TimeoutError:
            continue
    slots.release()  # balance the release done by whoever would have run


def run_client(spec: str, url: str, *, concurrency: int, episodes: int = 0, group_size: int | None = None,
               kind: str = "train") -> int:
    """`swarm client`: run an agent against a server until done or SIGTERM (then drain and exit 0)."""
    try:
        agent = load_agent(spec)
    except ValueError as e:
        log.error("%s", e)
        return 2
    if group_size is None:
        group_size = httpx.get(url.rstrip("/") + "/swarm/v1/status", timeout=30).json()["trainer"]["group_size"]
    pid_file = _pid_dir() / f"{_client_stem(agent.name, url)}-{os.getpid()}.pid"
    pid_file.parent.mkdir(parents=True, exist_ok=True)
    pid_file.write_text(str(os.getpid()))

    async def main() -> RunnerStats:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        return await run_agent(agent, url, concurrency=concurrency, group_size=group_size, kind=kind,
                               max_episodes=episodes, stop=stop)

    try:
        stats = asyncio.run(main())
    except KeyboardInterrupt:
        return 130
    finally:
        pid_file.unlink(missing_ok=True)
    log.info("client %s done: %d finished, %d failed", agent.name, stats.finished, stats.failed)
    return 0


def _pid_dir() -> Path:
    return Path(os.environ.get(PID_DIR_ENV, Path.home() / ".cache" / "swarmrl" / "clients"))


def _client_stem(name: str, url: str) -> str:
    return f"{name}-{url.rstrip('/').rsplit(':', 1)[-1]}"


def swap(spec: str, url: str, *, concurrency: int) -> int:
    """Hot swap: start the new code's client, then SIGTERM the old ones so they drain and exit."""
    agent = load_agent(spec)  # fail before touching the running client if the new code does not load
    old = [int(p.read_text()) for p in _pid_dir().glob(f"{_client_stem(agent.name, url)}-*.pid") if p.read_text().isdigit()]
    cmd = [sys.executable, "-m", "core.cli", "client", spec, "--server", url, "--concurrency", str(concurrency)]
    _pid_dir().mkdir(parents=True, exist_ok=True)
    log_path = _pid_dir() / f"{_client_stem(agent.name, url)}-{int(time.time())}.log"
    with open(log_path, "ab") as log_file:  # the new client outlives this command: it must not hold our stdout
        new = subprocess.Popen(cmd, start_new_session=True, stdout=log_file, stderr=subprocess.STDOUT)
    time.sleep(1.0)
    if new.poll() is not None:
        log.error("new client exited at once (code %s); the old one keeps running", new.returncode)
        return 1
    for pid in sorted(set(old)):
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    log.info("new client pid %d took over %s (log: %s); %d old client(s) draining", new.pid, agent.name, log_path, len(set(old)))
    return 0
