"""The sandbox folder: where `sandbox:NAME` is found, what its `sandbox.toml` says, and the order a split's tasks are drawn in.

Names are confined: `sandbox:NAME` and a sandbox.toml `name` must be plain names (no separator, no
`..`), and `safe_name` is what file names built from a name use. `task_order` is the order a client or
the server's dealer draws a split's tasks in: shuffled by the run's seed (through a window, so an
endless `tasks()` still streams). `episode_protocol` reads what `sandbox.toml` declares of an episode
(`max_calls`, and `[eval_sampling]`: `temperature`, `top_p`, `max_tokens`, `stop`), which the server
enforces on a judged sandbox's calls (`core.serve.protocol`). Loading an agent's code is
`core.clients.sandbox`'s job, a judge's `core.sandbox.judge`'s; this module imports no sandbox code.
"""

from __future__ import annotations

import re
import random
import tomllib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError


TASK_WINDOW = 1024  # tasks held at once while shuffling: a whole sandbox split, or a window of an endless one


SANDBOXES_DIR = "sandboxes"  # a project's sandbox folders live under <project>/sandboxes/<name>/


JUDGE_KEY = "judge"  # the sandbox.toml key naming a judged sandbox's judge file (core.sandbox.judge)
MAX_CALLS_KEY, EVAL_SAMPLING_KEY = "max_calls", "eval_sampling"  # the episode protocol's keys in sandbox.toml
# An eval reply longer than this is no eval a sandbox means: a typo (an extra zero) is refused, not run for hours.
MAX_EVAL_TOKENS = 32_768
MAX_STOPS = 4  # as the OpenAI API allows: each stop string is checked at every decoded token


class EvalSampling(BaseModel):
    """How every call of an eval episode samples, whatever the agent's request says (sandbox.toml
    `[eval_sampling]`): one fixed setting, so every arm of a study is scored the same way."""

    model_config = ConfigDict(extra="forbid", strict=True)
    temperature: float = Field(1.0, ge=0, le=2)  # 1.0: the policy's own distribution
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int = Field(ge=1, le=MAX_EVAL_TOKENS)  # no default: how long a reply may be is the sandbox's
    stop: list[Annotated[str, StringConstraints(min_length=1)]] = Field(default_factory=list, max_length=MAX_STOPS)


class EpisodeProtocol(BaseModel):
    """What a sandbox's episode may do, declared in its sandbox.toml (read-only to studies, like its judge).

    `max_calls`: the model calls one episode may make (its choices counted: `n` = 2 is two); None: no bound.
    `eval_sampling`: the sampling of an eval episode's calls; None: the request's own."""

    model_config = ConfigDict(extra="forbid")
    max_calls: int | None = None
    eval_sampling: EvalSampling | None = None


class SandboxNotFound(ValueError):
    """`sandbox:NAME` names no folder in any place looked; the message lists them, on one line."""


def sandbox_roots(config_file: str | Path | None = None) -> list[Path]:
    """Where `sandbox:NAME` is looked up, in order: the `sandboxes/` folder of the config file's project
    (the nearest parent folder of the config that holds one), then the current folder's. So
    `swarm run path/to/project/configs/x.yaml` works from any folder."""
    roots: list[Path] = []
    if config_file is not None:
        for parent in Path(config_file).resolve().parents:
            if (parent / SANDBOXES_DIR).is_dir():
                roots.append(parent / SANDBOXES_DIR)
                break
    here = (Path.cwd() / SANDBOXES_DIR).resolve()
    if here not in roots:
        roots.append(here)
    return roots


def is_plain_name(name: str) -> bool:
    """A name that stays one folder or file name wherever it is joined: no separator, no `..`, not absolute."""
    return bool(name) and name not in (".", "..") and not any(c in name for c in ("/", "\\", "\0"))


def safe_name(name: str) -> str:
    """`name` made safe for a file name (pid, log and state files): anything but letters, digits, `.`, `_`
    and `-` becomes `_`, and it never starts with a dot."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".") or "_"


def locate(spec: str, roots: Sequence[Path] | None = None) -> str:
    """The folder a `sandbox:NAME` spec names (an absolute path), looked up in `roots` (default: the
    current folder's `sandboxes/`); a bare NAME too when such a folder exists. Any other spec (a folder
    path, a module) comes back unchanged. NAME must be a plain folder name (`is_plain_name`): code from
    anywhere else is loaded only when the config names its folder as a path."""
    name = spec.removeprefix("sandbox:")
    if not spec.startswith("sandbox:") and (Path(spec).is_dir() or "/" in spec):
        return spec
    if not is_plain_name(name):
        if not spec.startswith("sandbox:"):
            return spec  # no sandbox name: a module
        raise SandboxNotFound(f"sandbox name {name!r} is refused: `sandbox:NAME` names a folder directly under "
                              "sandboxes/ (no '/', '..' or absolute path); give a folder path as the agent to run "
                              "code from elsewhere")
    roots = list(roots) if roots is not None else sandbox_roots()
    for root in roots:
        if (root / name / "agent.py").is_file():
            return str((root / name).resolve())
    if not spec.startswith("sandbox:"):
        return spec  # a bare name that is no sandbox folder: a module
    looked = ", ".join(str(r / name) for r in roots)
    raise SandboxNotFound(f"sandbox {name!r} not found: no agent.py in {looked}")


def sandbox_meta(folder: Path) -> dict[str, Any]:
    path = folder / "sandbox.toml"
    if not path.is_file():
        return {"name": folder.name}
    try:
        meta = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: {e}") from None
    name = meta.get("name", folder.name)
    if not isinstance(name, str) or not is_plain_name(name):
        raise ValueError(f"{path}: name {name!r} is refused; a sandbox's name must be a plain name (no '/', '\\', "
                         "'..'): it keys groups and names the client's pid and state files")
    entry_path(folder, meta)  # a bad `entry` is refused when the file is read, before anything imports it
    episode_protocol(folder, meta)  # so is a bad episode protocol, on the client's side as on the server's
    return meta


def episode_protocol(folder: Path, meta: dict[str, Any]) -> EpisodeProtocol:
    """The episode protocol sandbox.toml declares (`max_calls`, `[eval_sampling]`); a ValueError naming
    sandbox.toml and the key for anything malformed."""
    toml = folder / "sandbox.toml"
    max_calls = meta.get(MAX_CALLS_KEY)
    if max_calls is not None and (isinstance(max_calls, bool) or not isinstance(max_calls, int) or max_calls < 1):
        raise ValueError(f"{toml}: {MAX_CALLS_KEY} = {max_calls!r} is invalid; it must be a whole number of model "
                         "calls per episode, at least 1 (leave it out for no bound)")
    sampling = meta.get(EVAL_SAMPLING_KEY)
    if sampling is None:
        return EpisodeProtocol(max_calls=max_calls)
    if not isinstance(sampling, dict):
        raise ValueError(f"{toml}: {EVAL_SAMPLING_KEY} must be a table ([{EVAL_SAMPLING_KEY}] with temperature, "
                         f"top_p, max_tokens, stop), got {sampling!r}")
    if isinstance(sampling.get("temperature"), int) and not isinstance(sampling.get("temperature"), bool):
        sampling = {**sampling, "temperature": float(sampling["temperature"])}  # `temperature = 1` is 1.0
    if isinstance(sampling.get("top_p"), int) and not isinstance(sampling.get("top_p"), bool):
        sampling = {**sampling, "top_p": float(sampling["top_p"])}
    try:
        return EpisodeProtocol(max_calls=max_calls, eval_sampling=EvalSampling(**sampling))
    except ValidationError as e:
        first = e.errors()[0]
        key = ".".join([EVAL_SAMPLING_KEY, *(str(p) for p in first.get("loc", ()))])
        raise ValueError(f"{toml}: {key}: {first.get('msg', 'invalid')} (got {first.get('input')!r})") from None


def sandbox_requirements(folder: Path, meta: dict[str, Any]) -> list[str]:
    """The sandbox's own dependencies (`requirements = ["pkg==1.0", ...]` in sandbox.toml), which an
    isolated client installs into a venv of its own (`core.contain.venvs`); [] when it declares none."""
    reqs = meta.get("requirements", [])
    if not isinstance(reqs, list) or not all(isinstance(r, str) and r.strip() for r in reqs):
        raise ValueError(f"{folder / 'sandbox.toml'}: requirements must be a list of requirement strings, "
                         f"got {reqs!r}")
    return [r.strip() for r in reqs]


def entry_path(folder: Path, meta: dict[str, Any]) -> Path:
    """The sandbox's entry file (`entry` in sandbox.toml, default agent.py), checked without reading it: a
    relative path of plain names that stays inside the folder once links are followed. The folder is what
    gets versioned, copied, reviewed and swapped, so code outside it would run unversioned and unreviewed
    (`../x.py`, `/etc/passwd`, a link out). Anything else is a ValueError naming sandbox.toml."""
    toml = folder / "sandbox.toml"
    entry = meta.get("entry", "agent.py")
    if not isinstance(entry, str) or not entry.strip() or "\0" in entry:
        raise ValueError(f"{toml}: entry {entry!r} is invalid; it must be a relative path to a .py file inside "
                         "the sandbox folder")
    rel = Path(entry)
    if rel.is_absolute() or ".." in rel.parts or "\\" in entry:
        raise ValueError(f"{toml}: entry {entry!r} leads outside the sandbox folder {folder}: it must be a relative "
                         "path inside the sandbox folder (no absolute path, no '..')")
    path = (folder / rel).resolve()
    if not path.is_relative_to(folder.resolve()):
        raise ValueError(f"{toml}: entry {entry!r} resolves to {path}, outside the sandbox folder {folder} (a "
                         "link out of it); it must name a file inside it")
    return path


def task_order(tasks: Iterable[Any], seed: int | str | None) -> Iterable[tuple[int, Any]]:
    """(position in `tasks()`, task) in the order a client draws them: as yielded when `seed` is None,
    else shuffled by `seed` within windows of `TASK_WINDOW` tasks (the same seed, the same order)."""
    if seed is None:
        yield from enumerate(tasks)
        return
    rng = random.Random(str(seed))  # a str seed is hashed the same way in every process
    window: list[tuple[int, Any]] = []
    for pair in enumerate(tasks):
        window.append(pair)
        if len(window) >= TASK_WINDOW:
            rng.shuffle(window)
            yield from window
            window = []
    rng.shuffle(window)
    yield from window
