"""Judges: a sandbox's scoring code, loaded by the server from the folder its run config names (DESIGN §3.7).

A judged sandbox names its judge in `sandbox.toml` (`judge = "judge.py"`, a file directly in the
folder). The judge module defines:

- `tasks(split)`: the tasks episodes are dealt, for at least the splits `train` and `eval`;
- `score(task, episode) -> float`: an episode's score, from a `JudgeEpisode`: every call the server
  recorded of it, in order (`JudgedCall`: its request messages, reply, text, tool calls, token counts),
  and the answer `rollout` returned. The shipped judges check that the call they score was asked the
  dealt task (its recorded prompt carries the task), so a reply to another question scores `FAILURE`;
- `FAILURE`: the score of an episode that raised, timed out or expired, or whose judging failed.

The server (`swarm run`, `swarm serve`) loads each judge in its own process, never in an agent's: under
a private module name, and with the judge's sibling modules taken out of `sys.modules` once it has
loaded, so an in-process agent that imports the same file names gets copies of its own, and whatever
it rebinds in them never reaches the judge. What a judge is fed comes from the server's record, not
from a number the agent sends. The judge's tasks are dealt by `core.sandbox.dealer`. A loaded judge carries
its sandbox's episode protocol (`Judge.protocol`: `max_calls`, eval sampling, from the same sandbox.toml),
which the server enforces on the sandbox's calls (`core.serve.protocol`).

Deliberately not here: dealing tasks (`core.sandbox.dealer`), the routes that call the judge
(`core.serve.swarm_routes`), and which files a study may not edit (the researcher works that out
statically from the same `sandbox.toml`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import numbers
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.sandbox.folder import JUDGE_KEY, EpisodeProtocol, episode_protocol, is_plain_name, locate, sandbox_meta, sandbox_roots
from core.config import RunConfig
from core.records import Call, Episode

REQUIRED_SPLITS = ("train", "eval")  # every judge owns at least these, so scores are taken on its tasks


class JudgeError(ValueError):
    """A judge that cannot be loaded or used; the message names the sandbox and file."""


@dataclass(frozen=True)
class JudgedCall:
    """One model call of an episode as the server recorded it."""

    model: str
    messages: list[dict[str, Any]]  # its request's messages ([] for a /v1/completions call)
    reply: dict[str, Any] | None  # the assistant message returned (None for a /v1/completions call)
    text: str  # the reply's text (a /v1/completions call's completion decoded)
    tool_calls: list[dict[str, Any]]  # the tool calls of its reply
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str

    def last_user(self) -> str:
        """The text of the last user message of its request ("" when none): where a task is asked."""
        for message in reversed(self.messages):
            if message.get("role") == "user":
                content = message.get("content")
                if isinstance(content, list):  # content parts: their text, in order
                    return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
                return content if isinstance(content, str) else ""
        return ""


@dataclass(frozen=True)
class JudgeEpisode:
    """What a judge scores: the server's record of one episode, every call in order, plus the answer
    `rollout` returned."""

    task_id: str
    kind: str  # train, eval or debug
    calls: list[JudgedCall]  # every call the episode made, in order
    completion: str  # the text of the last call's reply ("" when the episode made no call)
    completions: list[str]  # the text of every call's reply, in order
    tool_calls: list[dict[str, Any]]  # every tool call the model's replies made, in order
    messages: list[dict[str, Any]]  # the last call's request messages followed by its reply
    answer: Any = None  # what rollout returned as its answer (JSON), None when it returned none
    extra: dict[str, Any] = field(default_factory=dict)  # reserved: nothing the server records today


@dataclass
class Judge:
    """One loaded judge. `score` and `tasks` run the judge's own functions; their errors are the caller's."""

    sandbox: str
    folder: Path
    file: Path
    failure: float
    digest: str  # sha1 of the judge file: two clients of one sandbox must name the same judge
    protocol: EpisodeProtocol  # what sandbox.toml declares of an episode: the server enforces it
    _tasks: Callable[[str], Iterable[dict[str, Any]]]
    _score: Callable[[dict[str, Any], JudgeEpisode], Any]

    def tasks(self, split: str) -> Iterable[dict[str, Any]]:
        return self._tasks(split)

    def score(self, task: dict[str, Any], episode: JudgeEpisode) -> tuple[float, str | None]:
        """(score, None), or (FAILURE, why) when the judge raised or returned no finite number: a judge's
        failure can only lower an episode's score, so an agent gains nothing by provoking one."""
        try:
            value = self._score(task, episode)
        except Exception as e:  # noqa: BLE001 - any error of the judge's code scores the failure value
            return self.failure, f"{self.file.name}: score raised {type(e).__name__}: {e}"
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            return self.failure, f"{self.file.name}: score returned {value!r}, not a finite number"
        return float(value), None


def judge_file(folder: Path, meta: dict[str, Any]) -> Path | None:
    """The judge file `sandbox.toml` names (None when it names none): a plain `.py` file name directly in
    the folder, so the researcher can tell statically which files it and its imports are."""
    name = meta.get(JUDGE_KEY)
    if name is None:
        return None
    toml = folder / "sandbox.toml"
    if not isinstance(name, str) or not is_plain_name(name) or not name.endswith(".py"):
        raise JudgeError(f"{toml}: judge {name!r} is invalid; it must name a .py file directly in the sandbox "
                         "folder (e.g. judge = \"judge.py\")")
    path = folder / name
    if not path.resolve().is_relative_to(folder.resolve()) or path.is_symlink():
        raise JudgeError(f"{toml}: judge {name!r} is a link; it must be a file of the sandbox folder itself")
    if not path.is_file():
        raise JudgeError(f"{toml}: judge {name!r} does not exist in {folder}")
    return path


def load_judge(folder: Path) -> Judge | None:
    """The judge of the sandbox in `folder`, or None when its sandbox.toml declares none."""
    meta = sandbox_meta(folder)
    path = judge_file(folder, meta)
    if path is None:
        return None
    sandbox = str(meta.get("name", folder.name))
    module = _import_isolated(path, folder, f"swarmrl_judge_{sandbox}")
    for attr in ("tasks", "score"):
        if not callable(getattr(module, attr, None)):
            raise JudgeError(f"{path}: a judge must define {attr}() (DESIGN §3.7: tasks(split), score(task, episode))")
    failure = getattr(module, "FAILURE", None)
    if isinstance(failure, bool) or not isinstance(failure, numbers.Real) or not math.isfinite(failure):
        raise JudgeError(f"{path}: a judge must define FAILURE, the finite score of an episode that raises or "
                         f"times out; got {failure!r}")
    try:
        protocol = episode_protocol(folder, meta)
    except ValueError as e:
        raise JudgeError(str(e)) from None
    judge = Judge(sandbox, folder.resolve(), path.resolve(), float(failure),
                  hashlib.sha1(path.read_bytes()).hexdigest(), protocol, module.tasks, module.score)
    for split in REQUIRED_SPLITS:
        first = next(iter(_checked_tasks(judge, split)), None)
        if first is None:
            raise JudgeError(f"{path}: tasks({split!r}) yields no task; a judge owns the splits "
                             f"{', '.join(REQUIRED_SPLITS)}")
    return judge


def _checked_tasks(judge: Judge, split: str) -> Iterable[dict[str, Any]]:
    try:
        for task in judge.tasks(split):
            task_json(judge, task)
            yield task
    except JudgeError:
        raise
    except Exception as e:  # noqa: BLE001 - a judge's tasks() that raises is named, with its file
        raise JudgeError(f"{judge.file}: tasks({split!r}) raised {type(e).__name__}: {e}") from e


def task_json(judge: Judge, task: Any) -> dict[str, Any]:
    """A task as it travels to the client: a dict that survives JSON, else a JudgeError naming the judge."""
    if not isinstance(task, dict):
        raise JudgeError(f"{judge.file}: tasks() yielded {type(task).__name__} {task!r}; a task must be a dict")
    try:
        return json.loads(json.dumps(task))
    except (TypeError, ValueError) as e:
        raise JudgeError(f"{judge.file}: a task is not JSON ({e}): {task!r}") from None


def _import_isolated(path: Path, folder: Path, module_name: str):
    """Import the judge file with its folder first on sys.path and none of the folder's modules in
    `sys.modules` (an in-process agent may have imported them: the judge gets fresh copies), then take
    every module that came from the folder out again and put the agent's back: the judge keeps its
    references, and nobody can look them up by name to rebind them."""
    home = folder.resolve()
    # Names the folder can provide: a module of that name already imported from anywhere else (another
    # sandbox's `reward`, or one an in-process agent planted) would be taken instead of the folder's file.
    own = {f.stem for f in home.glob("*.py")} | {d.name for d in home.iterdir() if (d / "__init__.py").is_file()}

    def from_folder() -> dict[str, Any]:
        return {name: m for name, m in list(sys.modules.items())
                if name.split(".")[0] in own
                or (getattr(m, "__file__", None) and Path(m.__file__).resolve().is_relative_to(home))}

    hidden = from_folder()
    for name in hidden:
        del sys.modules[name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise JudgeError(f"{path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(folder))
    # Bytecode off: the judge and its imports compile from their source. A `__pycache__/*.pyc` beside them
    # (an unchecked-hash pyc is believed whatever the source says) is never read, since the cache is looked
    # up under an empty folder of our own, and none is written.
    saved = sys.dont_write_bytecode, sys.pycache_prefix
    nowhere = tempfile.mkdtemp(prefix="swarmrl-judge-nocache-")
    sys.dont_write_bytecode, sys.pycache_prefix = True, nowhere
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise JudgeError(f"{path} failed to import: {type(e).__name__}: {e}") from e
    finally:
        sys.dont_write_bytecode, sys.pycache_prefix = saved
        shutil.rmtree(nowhere, ignore_errors=True)
        sys.path.remove(str(folder))
        for name in from_folder():
            del sys.modules[name]
        sys.modules.update(hidden)
    return module


def judge_episode(ep: Episode, answer: Any, text_of: Callable[[Call], str]) -> JudgeEpisode:
    """The judge's view of a recorded episode. `text_of(call)`: a call's completion text (its reply's
    content, or its completion ids decoded for /v1/completions calls, which record no reply)."""
    calls, texts, tools = [], [], []
    for call in ep.calls:
        text = text_of(call)
        texts.append(text)
        own = [dict(t) for t in (call.reply or {}).get("tool_calls") or []]
        tools.extend(own)
        calls.append(JudgedCall(model=call.model, messages=[dict(m) for m in call.messages],
                                reply=dict(call.reply) if call.reply else None, text=text, tool_calls=own,
                                prompt_tokens=len(call.prompt_ids), completion_tokens=len(call.completion_ids),
                                finish_reason=call.finish_reason))
    last = ep.calls[-1] if ep.calls else None
    messages = [dict(m) for m in last.messages] if last else []
    if last is not None:
        messages.append(dict(last.reply) if last.reply else {"role": "assistant", "content": texts[-1]})
    return JudgeEpisode(task_id=ep.task_id, kind=ep.kind, calls=calls, completion=texts[-1] if texts else "",
                        completions=texts, tool_calls=tools, messages=messages, answer=answer)


def load_judges(cfg: RunConfig) -> dict[str, Judge]:
    """The judges of the sandboxes a run config's clients name, by sandbox name, loaded from those folders
    (never from anything a client sends), or, with `server.judges_dir` set, from the sealed copy of each
    folder's name there: then whatever the client's folder holds (its judge, its sandbox.toml) is not
    read. Two clients of one sandbox must name the same judge file."""
    judges: dict[str, Judge] = {}
    roots = sandbox_roots(cfg.source_file)
    sealed = Path(cfg.server.judges_dir) if cfg.server.judges_dir else None
    for client in cfg.clients:
        try:
            folder = Path(locate(client.agent, roots))
        except ValueError:
            continue  # not a sandbox folder: the client's own start reports it
        if sealed is not None:
            folder = sealed / folder.name
            if not (folder / "sandbox.toml").is_file():
                continue  # nothing sealed under that name: an unjudged sandbox (the study sealed every judged one)
        elif not (folder / "sandbox.toml").is_file():
            continue
        judge = load_judge(folder)
        if judge is None:
            continue
        known = judges.setdefault(judge.sandbox, judge)
        if known.digest != judge.digest:
            raise JudgeError(f"sandbox {judge.sandbox!r} has two different judges in this config ({known.file} and "
                             f"{judge.file}); one sandbox name is scored by one judge")
    return judges
