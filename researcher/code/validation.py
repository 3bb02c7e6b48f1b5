"""Validation of a code proposal, in order: static steps, then the steps that run its code.

Static (they read the code, nothing of it runs):
1. apply: the edits (or patch) apply cleanly in a trial worktree, and only to allowed paths;
2. compile: every changed Python file compiles;
3. contract: an AST check that each edited sandbox's entry still defines `tasks` and
   `async def rollout(task, llm)` (researcher/code/contract.py);
Executing (they run the proposal's code):
4. import: each edited sandbox imports in a fresh subprocess and defines `tasks(split)` and
   `async rollout(task, llm)`;
5. tests: the sandbox's own tests (`<sandbox>/tests/`) pass under a timeout;
6. smoke: a few `debug` episodes of the edited sandbox run through the real client
   (`swarm client ... --kind debug`) against a live `swarm serve` of the study's model (or the
   brief's `code.smoke_model`); every episode must finish, which the server allows only with a
   finite reward. Debug episodes never train, and the server runs with `--no-train`.

`validate` runs the static steps, and the executing ones too unless told not to: when a person must
approve code (`approval.code_change: human`, unless the brief sets `code.execute_before_review`),
nothing of a proposal runs before approval, and `execute` runs its pending steps afterwards; a
failure there drops its commit. Each process of an executing step runs contained, through the
core's `swarm contain --required` (core/contain/contained.py): an environment allowlist without the study's
secrets, resource limits, its own process group killed at the timeout, and bubblewrap (only the
trial worktree writable, the study's state and MLflow store masked, no network but the smoke server's
episode routes); without bubblewrap the step fails, unless the brief sets `containment: auto`. The `swarm serve` of the smoke run is the core's
own code and runs as the study does.

Each step's result and log is recorded; the first failure stops the rest. Only when every step that
ran passed is the trial committed (researcher/code/workspace.py); otherwise the trial is thrown away and
nothing is committed. This module runs processes and reads their output; it does not review,
launch runs or write to MLflow.
"""

from __future__ import annotations

import ast
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from core.config import ContainLimits
from researcher.brief.schema import Brief
from researcher.code.contract import ContractError, contract_problems, entry_name
from researcher.code.workspace import EditError, Workspace, WorkspaceError
from researcher.records import EXECUTING_STEPS, STATIC_STEPS, CodeVersion, Proposal, StepResult

# Lines of a step's output kept in the record (and shown to the planner and the reviewer).
LOG_TAIL_LINES = 30
# The import check must not hang on a sandbox that blocks at import time.
IMPORT_TIMEOUT_S = 60.0
# How often the smoke run checks whether `swarm serve` is up.
_SERVE_POLL_S = 0.5
# What `swarm contain` itself may take beyond its command's timeout (its own start-up, killing the
# group); past it the validator kills `swarm contain`, and its command dies with it (PDEATHSIG).
CONTAIN_GRACE_S = 30.0
EXIT_TIMED_OUT = 124  # `swarm contain`'s exit code for a command past its --timeout (core/run/contain_command.py)

# Run in a fresh interpreter inside the sandbox folder: import the entry file and check its contract.
_IMPORT_CHECK = """
import importlib.util, inspect, sys, tomllib
from pathlib import Path
folder = Path(sys.argv[1])
meta = tomllib.loads((folder / "sandbox.toml").read_text()) if (folder / "sandbox.toml").is_file() else {}
entry = folder / meta.get("entry", "agent.py")
sys.path.insert(0, str(folder))
spec = importlib.util.spec_from_file_location("sandbox_under_validation", entry)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
problems = []
if not callable(getattr(module, "tasks", None)):
    problems.append("it defines no tasks(split)")
if not inspect.iscoroutinefunction(getattr(module, "rollout", None)):
    problems.append("it defines no `async def rollout(task, llm)`")
elif len(inspect.signature(module.rollout).parameters) != 2:
    problems.append("rollout must take (task, llm)")
if problems:
    sys.exit(f"{entry.name}: " + "; ".join(problems))
print(f"{entry.name}: imports; tasks and async rollout defined")
"""


# A long log keeps its first lines too: the error a step reports comes first (e.g. which search
# block failed), the output that explains it last.
_HEAD_LINES = 5


def tail(text: str, lines: int = LOG_TAIL_LINES) -> str:
    rows = text.strip().splitlines()
    if len(rows) <= lines:
        return "\n".join(rows)
    return "\n".join([*rows[:_HEAD_LINES], f"[... {len(rows) - lines} lines cut ...]", *rows[-(lines - _HEAD_LINES):]])


class StepFailed(Exception):
    def __init__(self, log: str) -> None:
        super().__init__(log)
        self.log = log


@dataclass
class Validator:
    workspace: Workspace
    brief: Brief
    workdir: Path  # the project folder: the brief's base config resolves here
    trials: Path  # where trial worktrees and smoke logs live (under the study's state)
    swarm: Path  # the `swarm` executable
    limits: ContainLimits = field(default_factory=ContainLimits)  # for every process that runs the proposal's code
    # Masked from every process that runs the proposal's code (`swarm contain --hide`): the study's state and
    # MLflow's local store (`study.store.private_paths`); every run's token and server files are masked anyway.
    hidden: list[Path] = field(default_factory=list)
    # `swarm contain --required`: refuse to run proposal code without bubblewrap. False only for a brief that
    # sets `containment: auto` on purpose (runs.launcher.AUTO_LOSS says what that gives up).
    required: bool = True
    warm: str | None = None  # the study's `swarm warm` socket, which the smoke `swarm serve` forks from
    _against: list[str] = field(default_factory=lambda: ["--cached"], init=False, repr=False)  # what `_changed` diffs

    def validate(self, p: Proposal, parent_commit: str, emit: Callable[..., None],
                 execute: bool = True) -> CodeVersion:
        """Run the static steps, and the executing ones too with `execute`; commit when all that ran
        passed (the executing steps left are `pending`, for `execute`). A trial left by a killed
        attempt is started over."""
        tree = self.trials / p.id
        self.workspace.remove(tree)
        self.workspace.checkout(parent_commit, tree)
        self._against = ["--cached"]
        steps: list[StepResult] = []
        diff = ""
        try:
            for name in STATIC_STEPS + (EXECUTING_STEPS if execute else ()):
                if not self._step(p, tree, name, steps, emit):
                    return CodeVersion(proposal_id=p.id, parent_commit=parent_commit, passed=False,
                                       failed_step=name, steps=steps, diff=diff)
                if name == "apply":
                    diff = self.workspace.staged_diff(tree)
            commit = self.workspace.commit_trial(tree, p.id, f"{p.id}: {p.hypothesis}")
            return CodeVersion(proposal_id=p.id, parent_commit=parent_commit, passed=True, commit=commit,
                               steps=steps, diff=diff, pending=[] if execute else list(EXECUTING_STEPS))
        finally:
            self.workspace.remove(tree)

    def execute(self, p: Proposal, version: CodeVersion, emit: Callable[..., None]) -> CodeVersion:
        """Run a statically validated version's pending (executing) steps on its commit. A failure makes
        it invalid: its commit is dropped, so nothing runs it or builds on it."""
        tree = self.trials / p.id
        self.workspace.remove(tree)
        self.workspace.checkout(version.commit, tree)
        self._against = [version.parent_commit, "HEAD"]
        steps = list(version.steps)
        try:
            for name in version.pending:
                if not self._step(p, tree, name, steps, emit):
                    self.workspace.drop_proposal(p.id)
                    return version.model_copy(update={"passed": False, "failed_step": name, "steps": steps,
                                                      "pending": [], "commit": ""})
            return version.model_copy(update={"steps": steps, "pending": []})
        finally:
            self.workspace.remove(tree)

    def _step(self, p: Proposal, tree: Path, name: str, steps: list[StepResult], emit: Callable[..., None]) -> bool:
        """Run one step and record it in `steps`. -> whether it passed."""
        emit("validation.step", proposal_id=p.id, step=name)
        started = time.monotonic()
        try:
            log = getattr(self, f"_{name}")(p, tree)
        except StepFailed as e:
            steps.append(StepResult(step=name, passed=False, log=tail(e.log), seconds=time.monotonic() - started))
            return False
        # Contained code could write the trial tree, its `.git` too: the study's git never follows it
        # (researcher.code.study_git), and a changed one fails the step that changed it, saying so.
        tampered = self.workspace.tampered(tree) if name in EXECUTING_STEPS else None
        if tampered is not None:
            steps.append(StepResult(step=name, passed=False, log=tail(f"{log}\n{tampered}"),
                                    seconds=time.monotonic() - started))
            return False
        steps.append(StepResult(step=name, passed=True, log=tail(log), seconds=time.monotonic() - started))
        return True

    # -- steps ------------------------------------------------------------------------------
    def _apply(self, p: Proposal, tree: Path) -> str:
        try:
            if p.patch:
                self.workspace.apply_patch(tree, p.patch)
            self.workspace.apply_edits(tree, p.edits)
            changes = self.workspace.check_changes(tree)
        except EditError as e:
            raise StepFailed(f"{e}\n--- current text of {e.file} ---\n{e.current}") from None
        except WorkspaceError as e:
            raise StepFailed(str(e)) from None
        return "\n".join(f"{status} {rel}" for status, rel in changes)

    def _changed(self, tree: Path) -> list[str]:
        return self.workspace.changed(tree, self._against)

    def _contract(self, p: Proposal, tree: Path) -> str:
        """Without running anything: each edited sandbox's entry still defines `tasks` and `async def
        rollout(task, llm)` at its top level (an import of either is accepted; the import step checks it)."""
        logs = []
        for folder in self.sandboxes(tree):
            try:
                entry = folder / entry_name(folder)
            except ContractError as e:
                raise StepFailed(str(e)) from None
            rel = entry.relative_to(tree)
            try:
                module = ast.parse(entry.read_text(), str(rel))
            except (OSError, SyntaxError, ValueError) as e:
                raise StepFailed(f"{rel}: cannot be read as Python: {type(e).__name__}: {e}") from None
            problems = contract_problems(module)
            if problems:
                raise StepFailed(f"{rel}: " + "; ".join(problems))
            logs.append(f"{rel}: defines tasks and async rollout(task, llm) (read, not run)")
        return "\n".join(logs) or "no sandbox in the workspace"

    def _compile(self, p: Proposal, tree: Path) -> str:
        done = []
        for rel in self._changed(tree):
            if rel.endswith(".py"):
                try:
                    compile((tree / rel).read_text(), rel, "exec")
                except (SyntaxError, ValueError) as e:
                    raise StepFailed(f"{rel} does not compile: {type(e).__name__}: {e}") from None
                done.append(rel)
        return "compiled: " + (", ".join(done) or "(no Python file changed)")

    def sandboxes(self, tree: Path) -> list[Path]:
        """The edited sandbox folders (every sandbox in the workspace when the edit is in none)."""
        folders = sorted({f.parent for pattern in ("sandbox.toml", "agent.py") for f in tree.rglob(pattern)
                          if ".git" not in f.relative_to(tree).parts})
        changed = [tree / rel for rel in self._changed(tree)] + [tree]
        touched = [f for f in folders if any(f in c.parents for c in changed)]
        return touched or folders

    def _import(self, p: Proposal, tree: Path) -> str:
        logs = []
        for folder in self.sandboxes(tree):
            logs.append(self._run([sys.executable, "-c", _IMPORT_CHECK, str(folder)], folder, IMPORT_TIMEOUT_S,
                                  f"importing {folder.relative_to(tree)}", tree))
        return "\n".join(logs) or "no sandbox in the workspace"

    def _tests(self, p: Proposal, tree: Path) -> str:
        logs = []
        for folder in self.sandboxes(tree):
            if (folder / "tests").is_dir():
                logs.append(self._run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o",
                                       "addopts=", str(folder / "tests")], tree, self.brief.code.test_timeout_s,  # type: ignore[union-attr]
                                      f"tests of {folder.relative_to(tree)}", tree))
            else:
                logs.append(f"{folder.relative_to(tree)}: no tests/ folder")
        return "\n".join(logs)

    def _run(self, argv: list[str], cwd: Path, timeout: float, what: str, tree: Path, server: str | None = None) -> str:
        """Run a step that executes the proposal's code, contained (`swarm contain`): only `tree` (the
        trial worktree) is writable, the environment holds none of the study's secrets, the study's state,
        MLflow store (`hidden`) and warm socket are masked, bubblewrap is required (unless the brief said `auto`), and the
        network is the swarm `server`'s episode routes only (none without one)."""
        limits = [f for name, value in self.limits.model_dump().items()
                  for f in (f"--{name.replace('_', '-')}", str(value))]
        # The warm socket's folder too: `swarm contain` masks $SWARMRL_WARM's, but the study does not set it for
        # the steps (only for the smoke `swarm serve`), so it is named here.
        masked = [*self.hidden, *([Path(self.warm).parent] if self.warm else [])]
        hide = [f for path in masked if path.exists() for f in ("--hide", str(path))]
        cmd = [str(self.swarm), "contain", "--cwd", str(cwd), "--writable", str(tree), "--timeout", f"{timeout:g}",
               *limits, *hide, *(["--required"] if self.required else []),
               *(["--server", server] if server else []), "--", *argv]
        try:
            done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  text=True, errors="replace", timeout=timeout + CONTAIN_GRACE_S)
        except subprocess.TimeoutExpired as e:
            out = e.stdout if isinstance(e.stdout, str) else (e.stdout or b"").decode(errors="replace")
            raise StepFailed(f"{what}: `swarm contain` did not end {CONTAIN_GRACE_S:.0f} s past its timeout "
                             f"(killed)\n{out.strip()}") from None
        code, output = done.returncode, done.stdout.strip()
        if code == EXIT_TIMED_OUT:
            raise StepFailed(f"{what}: timed out after {timeout:.0f} s (its processes were killed)\n{output}")
        if code != 0:
            how = f"killed by {signal.Signals(code - 128).name}" if code - 128 in _SIGNALS else f"exit code {code}"
            raise StepFailed(f"{what}: failed ({how})\n{output}")
        return f"{what}: ok\n{tail(output, 5)}"

    def _smoke(self, p: Proposal, tree: Path) -> str:
        spec = self.brief.code
        assert spec is not None
        config = self.brief.resolve_config(self.workdir)
        if spec.smoke_model:
            config.models = [m.model_copy(update={"source": spec.smoke_model}) for m in config.models]
        config_path = self.trials / f"{p.id}.smoke.yaml"
        config_path.write_text(yaml.safe_dump(config.model_dump(), sort_keys=False))
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        serve_log = self.trials / f"{p.id}.serve.log"
        pid_file = self.trials / f"{p.id}.serve.pid"
        _stop_leftover(pid_file, str(config_path))  # a server a killed attempt left running
        deadline = time.monotonic() + spec.smoke_timeout_s
        with open(serve_log, "wb") as fh:
            server = subprocess.Popen([str(self.swarm), "serve", str(config_path), "--no-train", "--port", str(port),
                                       "--host", "127.0.0.1"], cwd=self.trials, stdout=fh, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True,
                                      env={**os.environ, **({"SWARMRL_WARM": self.warm} if self.warm else {})})
        pid_file.write_text(str(server.pid))
        try:
            before = self._wait_up(url, server, serve_log, deadline)
            logs = []
            for folder in self.sandboxes(tree):
                logs.append(self._episodes(folder, url, spec.smoke_episodes, deadline, tree))
            after = _status(url)["episodes"]
            finished = after["finished"] - before["finished"]
            aborted = after["aborted"] - before["aborted"] + after["expired"] - before["expired"]
            wanted = spec.smoke_episodes * len(logs)
            summary = f"smoke: {finished} of {wanted} debug episode(s) finished, {aborted} aborted or expired"
            if aborted or finished < wanted:
                raise StepFailed("\n".join([*logs, summary, "(an episode that raises, or returns a reward that "
                                            "is not finite, is aborted by the client or refused by the server)"]))
            return "\n".join([*logs, summary])
        finally:
            _stop(server)
            pid_file.unlink(missing_ok=True)

    def _wait_up(self, url: str, server: subprocess.Popen[bytes], log: Path, deadline: float) -> dict[str, int]:
        while time.monotonic() < deadline:
            if server.poll() is not None:
                raise StepFailed(f"swarm serve exited (code {server.returncode}):\n{log.read_text(errors='replace')}")
            try:
                return _status(url)["episodes"]
            except (httpx.HTTPError, KeyError, ValueError):
                time.sleep(_SERVE_POLL_S)
        raise StepFailed(f"swarm serve did not come up in time:\n{log.read_text(errors='replace')}")

    def _episodes(self, folder: Path, url: str, n: int, deadline: float, tree: Path) -> str:
        argv = [str(self.swarm), "client", str(folder), "--server", url, "--kind", "debug", "--episodes", str(n),
                "--group-size", "1", "--concurrency", str(n)]
        what = f"smoke episodes of {folder.relative_to(tree)}"
        return self._run(argv, tree, max(1.0, deadline - time.monotonic()), what, tree, server=url)


_SIGNALS = {int(s) for s in signal.Signals}  # `swarm contain` exits 128+N for a command killed by signal N


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status(url: str) -> dict:
    return httpx.get(url + "/swarm/v1/status", timeout=5).json()


def _stop_leftover(pid_file: Path, marker: str) -> None:
    """SIGKILL the process group of a recorded server whose command line still names `marker`."""
    try:
        pid = int(pid_file.read_text())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (OSError, ValueError):
        return
    if marker in cmdline:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass
