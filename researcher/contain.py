"""Containment for executed proposal code: how the researcher runs a process that may run LLM-written code.

`run_contained(argv, cwd, writable=..., extra_env=..., timeout_s=...)` runs one command, and
`popen_contained` starts one, with:
- an environment allowlist (`contained_env`): PATH, LANG and a few harmless settings, a temporary
  HOME and TMPDIR, plus what the caller passes (the episode endpoint the client needs). Secrets are
  never passed: any `*_API_KEY`, `*_TOKEN`, `*_SECRET*`, `*_PASSWORD`, MLflow tracking credentials,
  `SWARMRL_ADMIN_TOKEN`, AWS_/GOOGLE_/AZURE_ credentials; a caller passing one is a bug (ValueError);
- resource limits set between fork and exec (`Limits`): CPU seconds, address space, file size,
  processes (on top of those the user already runs), open files; when running as root, where the
  kernel does not apply the process limit, a pids cgroup of its own when one can be made;
- its own session and process group, killed whole at the timeout;
- bubblewrap when `bwrap` is on PATH: a read-only view of / (system, venv, project), a writable bind
  of the folders it may write (its worktree) and a private /tmp, its own pid namespace (nothing
  survives the sandbox), all capabilities dropped. Without bwrap it runs uncontained by the
  filesystem (the limits above still apply), and that is said once per process (`log.warning`).

It does not decide what to run or judge output (researcher/validation.py does), and it is no
defence against kernel exploits: see docs/security.md for what each boundary holds.
"""

from __future__ import annotations

import logging
import os
import re
import resource
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

GiB = 1024 ** 3
# Passed through from the researcher's environment when set: none of them is a secret.
PASSED_ENV = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TERM", "HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM",
              "OMP_NUM_THREADS", "VIRTUAL_ENV", "PYTHONHASHSEED")
_SECRET = re.compile(r"(_API_KEY|_TOKEN|_SECRET|_PASSWORD|_CREDENTIALS?)$|_SECRET_|^(AWS|GOOGLE|AZURE|GCP)_|"
                     r"^MLFLOW_TRACKING_(USERNAME|PASSWORD|TOKEN|CLIENT_CERT_PATH|SERVER_CERT_PATH|INSECURE_TLS)$|"
                     r"^SWARMRL_ADMIN_TOKEN$", re.IGNORECASE)
_CGROUP_PIDS = Path("/sys/fs/cgroup/pids")  # cgroup v1's pids hierarchy (v2: the unified tree, below)
_CGROUP_V2 = Path("/sys/fs/cgroup")
_warned_uncontained = False


def is_secret(name: str) -> bool:
    """Whether an environment variable's name says it holds a credential (never passed to proposal code)."""
    return bool(_SECRET.search(name))


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 900  # CPU seconds of each process (a busy loop ends by SIGXCPU/SIGKILL)
    address_space: int = 8 * GiB  # virtual memory of each process (a memory hog gets MemoryError)
    file_size: int = 1 * GiB  # the largest file it may write
    processes: int = 256  # processes and threads beyond what the user runs already (a fork bomb stops)
    open_files: int = 1024


def bwrap() -> str | None:
    return shutil.which("bwrap")


def contained_env(home: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The allowlisted environment: PASSED_ENV from ours, HOME and TMPDIR under `home`, then `extra`."""
    env = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
    env.setdefault("PATH", os.defpath)
    env.update(HOME=str(home), TMPDIR=str(home / "tmp"), PYTHONDONTWRITEBYTECODE="1", PYTHONNOUSERSITE="1")
    for key, value in (extra or {}).items():
        if is_secret(key):
            raise ValueError(f"{key} looks like a credential; contained code is never given one")
        env[key] = value
    return env


def _user_processes() -> int:
    """Processes (threads count too, for RLIMIT_NPROC) this user runs now, read from /proc."""
    uid, n = os.getuid(), 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    n += len(os.listdir(entry / "task"))
            except OSError:
                continue
    return n


def _pids_cgroup(limit: int) -> Path | None:
    """A fresh pids cgroup holding at most `limit` tasks, when this process may make one (as root in most
    containers); None otherwise. The child joins it before exec."""
    for root in (_CGROUP_PIDS, _CGROUP_V2):
        if not (root / "cgroup.procs").exists() or not os.access(root, os.W_OK):
            continue
        try:
            group = Path(tempfile.mkdtemp(prefix="swarmrl-contained-", dir=root))
        except OSError:
            continue
        try:
            (group / "pids.max").write_text(str(limit))
            return group
        except OSError:  # no pids controller here (v2 without it enabled)
            _remove_cgroup(group)
    return None


def _remove_cgroup(group: Path | None, wait_s: float = 5.0) -> None:
    """Remove a pids cgroup once its tasks are gone (killed ones take a moment to leave it)."""
    deadline = time.monotonic() + wait_s
    while group is not None:
        try:
            group.rmdir()
            return
        except OSError:
            if time.monotonic() > deadline:
                log.warning("could not remove the cgroup %s (tasks still in it)", group)
                return
            time.sleep(0.05)


def _preexec(limits: Limits, nproc: int, group: Path | None):
    def apply() -> None:
        if group is not None:
            with open(group / "cgroup.procs", "w") as fh:
                fh.write(str(os.getpid()))
        for what, value in ((resource.RLIMIT_CPU, limits.cpu_s), (resource.RLIMIT_AS, limits.address_space),
                            (resource.RLIMIT_FSIZE, limits.file_size), (resource.RLIMIT_NPROC, nproc),
                            (resource.RLIMIT_NOFILE, limits.open_files)):
            resource.setrlimit(what, (value, value))
    return apply


def wrap(argv: Sequence[str], cwd: Path, writable: Sequence[Path]) -> list[str]:
    """`argv` under bubblewrap (read-only /, `writable` and a private /tmp writable, own pid namespace,
    no capabilities), or unchanged when bwrap is missing (said once)."""
    global _warned_uncontained
    exe = bwrap()
    if exe is None:
        if not _warned_uncontained:
            log.warning("bwrap (bubblewrap) is not on PATH: proposal code runs uncontained by the filesystem "
                        "(environment allowlist and resource limits still apply); install bubblewrap to contain it")
            _warned_uncontained = True
        return list(argv)
    binds: list[str] = []
    for folder in writable:
        real = str(Path(folder).resolve())
        binds += ["--bind", real, real]
    return [exe, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp", *binds,
            "--unshare-pid", "--die-with-parent", "--cap-drop", "ALL", "--chdir", str(Path(cwd).resolve()),
            "--", *argv]


@dataclass
class Contained:
    """A started contained process and what must be cleaned up after it."""

    proc: subprocess.Popen
    scratch: Path
    group: Path | None

    def kill(self) -> None:
        """SIGKILL its whole process group (under bwrap, the pid namespace dies with it)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def close(self) -> None:
        if self.proc.poll() is None:
            self.kill()
            self.proc.wait()
        _remove_cgroup(self.group)
        shutil.rmtree(self.scratch, ignore_errors=True)


def popen_contained(argv: Sequence[str], cwd: Path, *, writable: Sequence[Path] = (),
                    extra_env: Mapping[str, str] | None = None, limits: Limits = Limits(),
                    **popen: object) -> Contained:
    """Start `argv` contained (module docstring); the caller waits on `.proc` and calls `.close()`."""
    scratch = Path(tempfile.mkdtemp(prefix="swarmrl-contained-"))
    (scratch / "tmp").mkdir()
    env = contained_env(scratch, extra_env)
    nproc = _user_processes() + limits.processes
    group = _pids_cgroup(limits.processes) if os.getuid() == 0 else None
    cmd = wrap(argv, cwd, [*writable, scratch])
    try:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=_preexec(limits, nproc, group), **popen)  # type: ignore[arg-type]
    except BaseException:
        _remove_cgroup(group)
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return Contained(proc, scratch, group)


def run_contained(argv: Sequence[str], cwd: Path, *, timeout_s: float, writable: Sequence[Path] = (),
                  extra_env: Mapping[str, str] | None = None,
                  limits: Limits = Limits()) -> tuple[int | None, str]:
    """Run `argv` contained until it exits or `timeout_s` passes (then its group is killed).
    -> (exit code, or None when it timed out; its stdout and stderr together)."""
    started = popen_contained(argv, cwd, writable=writable, extra_env=extra_env, limits=limits,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    try:
        out, _ = started.proc.communicate(timeout=timeout_s)
        return started.proc.returncode, out
    except subprocess.TimeoutExpired:
        started.kill()
        out, _ = started.proc.communicate()
        return None, out
    finally:
        started.close()
