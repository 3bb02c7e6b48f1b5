"""Sandboxes and agents: load client code (a sandbox folder or a module) and name its code version.

An agent is anything with `tasks(split)` yielding task dicts and `async rollout(task, llm)` returning
a reward (or an `Outcome`), where `llm` is an `openai.AsyncOpenAI` already bound to the episode; its
`llm.model` is the model to call (the server's single served model) unless the agent names one. A
sandbox is such an agent in a folder `sandboxes/<name>/` with `agent.py` and `sandbox.toml`; every
episode records the folder's code version. Loading wraps the agent's `tasks` and `rollout` so that
bad agent code (an exception, a reward that is not a finite number) surfaces as a `SandboxError`
naming the file, line and function, while errors of the server or the SDK pass through unchanged.
Finding a sandbox folder and reading its `sandbox.toml` is `core.sandbox.folder`'s job.
Running agents is `core.clients.runner`'s job, replacing a running client is `core.run.hotswap`'s; this module
only loads.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import math
import numbers
import importlib
import importlib.util
import subprocess
import sys
import traceback
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from core.sandbox.folder import JUDGE_KEY, entry_path, locate, sandbox_meta


@dataclass
class Outcome:
    reward: float | dict[str, float]  # the agent's own number: for a judged sandbox only logged (agent_reward)
    metrics: dict[str, float] = field(default_factory=dict)
    answer: Any = None  # JSON the agent hands a judged sandbox's judge beside the server's record of the episode


@dataclass
class Agent:
    name: str  # the sandbox name: groups are keyed by (name, task_id)
    tasks: Callable[[str], Iterable[dict[str, Any]]]
    rollout: Callable[[dict[str, Any], Any], Awaitable[float | Outcome]]
    version: str  # code version recorded on every episode
    folder: Path | None = None
    judged: bool = False  # its sandbox.toml names a judge: the server deals its tasks and scores its episodes


class SandboxError(RuntimeError):
    """Agent code misbehaved: the message names the file, line and function, and what went wrong."""


# Exceptions from these packages come from the server or the transport (an HTTP error, a stop
# request), not from the agent's own code: they pass through unwrapped, so the runner still sees
# their types (retry hints, `ClientStopping`).
PASS_THROUGH = ("openai", "httpx", "httpcore", "core")


def load_agent(spec: str, roots: Sequence[Path] | Path | None = None) -> Agent:
    """`sandbox:NAME` (looked up in `roots`, see `locate`), a folder holding agent.py, or an importable
    module with tasks() and rollout()."""
    if isinstance(roots, Path):
        roots = [roots]
    folder = Path(locate(spec, roots))
    if spec.startswith("sandbox:") or (folder / "agent.py").is_file():
        if not (folder / "agent.py").is_file():
            raise ValueError(f"sandbox {str(folder)!r}: no agent.py in {folder}")
        meta = sandbox_meta(folder)
        module = _import_file(entry_path(folder, meta), f"sandbox_{meta.get('name', folder.name)}")
        agent = _agent_from(module, meta.get("name", folder.name), _folder_version(folder), folder)
        agent.judged = JUDGE_KEY in meta
        return agent
    try:
        module = importlib.import_module(spec)
    except ImportError as e:
        raise ValueError(f"agent {spec!r} is neither a sandbox folder nor an importable module: {e}") from None
    src = Path(module.__file__ or spec)
    version = hashlib.sha1(src.read_bytes()).hexdigest()[:12] if src.is_file() else "unknown"
    return _agent_from(module, spec.rsplit(".", 1)[-1], version, None)


def code_version(spec: str) -> str:
    """The code version `load_agent(spec).version` reports, without importing the agent: a run binds its
    isolated clients' credentials to it before they start (`core.episodes.credentials`). `spec`: a
    located folder, or an importable module (its source file's hash)."""
    folder = Path(spec)
    if folder.is_dir():
        return _folder_version(folder)
    found = importlib.util.find_spec(spec)
    src = Path(found.origin) if found is not None and found.origin else None
    return hashlib.sha1(src.read_bytes()).hexdigest()[:12] if src is not None and src.is_file() else "unknown"


def _import_file(path: Path, module_name: str):
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:  # not a Python source file (`entry = "data.txt"`)
        raise ValueError(f"{path} is not a Python file that can be imported as a sandbox's entry")
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
    source = str(getattr(module, "__file__", None) or name)
    for attr in ("tasks", "rollout"):
        if not callable(getattr(module, attr, None)):
            raise ValueError(f"{source}: agent {name!r} must define {attr}()")
    if not asyncio.iscoroutinefunction(module.rollout):
        raise ValueError(f"{source}: agent {name!r}: rollout must be `async def rollout(task, llm)`")
    home = folder.resolve() if folder is not None else Path(source).resolve().parent
    return Agent(name, _checked_tasks(module.tasks, source, home), _checked_rollout(module.rollout, source, home),
                 version, folder)


def _where(error: BaseException, source: str, home: Path, function: str) -> str:
    """`file:line in function()` of the deepest frame of the agent's own code, else the entry's function."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if Path(f.filename).resolve().is_relative_to(home)]
    return f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}()" if frames else f"{source} in {function}()"


def _ours(error: BaseException) -> bool:
    return type(error).__module__.split(".")[0] in PASS_THROUGH


def _checked_tasks(tasks, source: str, home: Path):
    @functools.wraps(tasks)
    def checked(split: str):
        try:
            yield from tasks(split)
        except Exception as e:
            if _ours(e):
                raise
            raise SandboxError(f"{_where(e, source, home, 'tasks')}: {type(e).__name__}: {e}") from e

    return checked


def _checked_rollout(rollout, source: str, home: Path):
    @functools.wraps(rollout)
    async def checked(task: dict[str, Any], llm: Any) -> Outcome:
        try:
            out = await rollout(task, llm)
        except Exception as e:
            if _ours(e):
                raise
            raise SandboxError(f"{_where(e, source, home, 'rollout')}: {type(e).__name__}: {e}") from e
        return checked_outcome(out, f"{source} in rollout()")

    return checked


def checked_outcome(out: Any, where: str) -> Outcome:
    """A rollout's return value as an `Outcome` whose rewards are finite numbers, else a `SandboxError`
    saying what came back: a bad reward aborts its episode instead of reaching the trainer."""
    outcome = out if isinstance(out, Outcome) else Outcome(out)
    rewards = outcome.reward.values() if isinstance(outcome.reward, dict) else [outcome.reward]
    for r in rewards:
        if isinstance(r, bool) or not isinstance(r, numbers.Real):
            raise SandboxError(f"{where} returned {out!r} ({type(r).__name__}); a reward must be a finite number, "
                               "a {model: number} dict, or an Outcome")
        if not math.isfinite(r):
            raise SandboxError(f"{where} returned a reward of {r}; a reward must be a finite number")
    if isinstance(outcome.reward, dict):
        outcome.reward = {str(k): float(v) for k, v in outcome.reward.items()}
    else:
        outcome.reward = float(outcome.reward)
    return outcome


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


