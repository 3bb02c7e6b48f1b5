"""Sandboxes and agents: load client code (a sandbox folder or a module) and name its code version.

An agent is anything with `tasks(split)` yielding task dicts and `async rollout(task, llm)` returning
a reward (or an `Outcome`), where `llm` is an `openai.AsyncOpenAI` already bound to the episode; its
`llm.model` is the model to call (the server's single served model) unless the agent names one. A
sandbox is such an agent in a folder `sandboxes/<name>/` with `agent.py` and `sandbox.toml`; every
episode records the folder's code version. Running agents is `core.runner`'s job, replacing a running
client is `core.swap`'s; this module only loads.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.util
import subprocess
import sys
import tomllib
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


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


def load_agent(spec: str, root: Path = Path("sandboxes")) -> Agent:
    """`sandbox:NAME`, a folder holding agent.py, or an importable module with tasks() and rollout()."""
    name = spec.removeprefix("sandbox:")
    folder = Path(name) if Path(name).is_dir() else root / name
    if spec.startswith("sandbox:") or (folder / "agent.py").is_file():
        if not (folder / "agent.py").is_file():
            raise ValueError(f"sandbox {name!r}: no agent.py in {folder}")
        meta = _sandbox_meta(folder)
        module = _import_file(_entry(folder, meta), f"sandbox_{meta.get('name', folder.name)}")
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


def _entry(folder: Path, meta: dict[str, Any]) -> Path:
    """The sandbox's entry file, which must lie inside its folder: the folder is what gets versioned,
    copied and swapped, so code outside it would run unversioned (`../x.py`, an absolute path, a link)."""
    entry = str(meta.get("entry", "agent.py"))
    path = (folder / entry).resolve()
    if not path.is_relative_to(folder.resolve()):
        raise ValueError(f"{folder / 'sandbox.toml'}: entry {entry!r} resolves to {path}, outside the sandbox "
                         f"folder {folder}; it must name a file inside it")
    return path


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
