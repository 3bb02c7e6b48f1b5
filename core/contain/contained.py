"""Containment: how the core runs a process that runs agent or LLM-written code.

`popen_contained(argv, cwd, writable=..., extra_env=..., limits=...)` starts one such process, and
`run_contained` runs one to its end or a timeout, with:
- an environment allowlist (`contained_env`): PATH, LANG and a few harmless settings, a temporary
  HOME and TMPDIR, plus what the caller passes (what the client needs: its server URL comes on its
  command line, its episode keys from the server). Secrets are never passed: any name
  `core.config_io.is_secret` calls a credential (`*_API_KEY`, `*_TOKEN`, `*_PASSWORD`, MLflow tracking
  credentials, `SWARMRL_ADMIN_TOKEN`, cloud credentials); a caller passing one is a bug (ValueError);
- resource limits set between fork and exec (`core.config.ContainLimits`): CPU seconds, address
  space, file size, processes (on top of those the user already runs), open files; when running as
  root, where the kernel does not apply the process limit, a pids cgroup of its own when one can be made
  (`core.contain.process_count`); all its processes' memory together in a memory cgroup where the machine
  allows one (`core.contain.memory_cgroup`; else the address-space limit per process, said once);
- its own session and process group, killed whole at the timeout or on `kill()`; it dies with the
  thread that started it (PR_SET_PDEATHSIG), so nothing outlives its starter, unless it is started
  `detached` (a client `swarm swap` starts outlives that command: it ends when the server drains it);
- bubblewrap when `bwrap` is on PATH: a read-only view of / (system, venv, project), a writable bind
  of the folders it may write (its worktree or working folder), a private /tmp and HOME bounded in size
  (tmpfs of `limits.file_size` bytes each), the admin token and server files of this machine's runs,
  `swarm warm`'s socket folder and what its caller names masked (`masked_paths`), its own user (an
  unprivileged uid, never root), pid (nothing survives the sandbox), IPC and network namespaces, all
  capabilities dropped, the kernel settings and /dev read-only (`core.contain.namespaces`). Its one way out is to
  its swarm server, when its caller names one: the relay inside (`core.contain.relay`) passes loopback
  connections to the forwarder outside (`core.contain.forwarder`), which sends on only the episode
  routes. Without bwrap it runs uncontained by the filesystem and the network (the limits above still
  apply), said once per process (`log.warning`); `require_bwrap` turns that, and a kernel that refuses
  bwrap a user namespace, into an error for `required` containment.

Who uses it: `swarm run`'s supervisor for its client processes (`containment.clients`), `swarm swap
--contain` for the client it starts, and `swarm contain`, the command through which the researcher's
validation runs proposal code.
It does not decide what to run or judge output, and it is no defence against kernel exploits:
see docs/security.md for what each boundary holds.
"""

from __future__ import annotations

import ctypes
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from core.contain.memory_cgroup import memory_cgroup
from core.contain.namespaces import system_args, user_namespace_refusal
from core.contain.process_count import pids_cgroup, remove_cgroup, user_processes
from core.contain.sockets import net_folder, net_root
from core.local_state import token_files
from core.config import ContainLimits, ContainMode
from core.config_io import ConfigError, is_secret

log = logging.getLogger(__name__)

# Passed through from the starter's environment when set: none of them is a secret.
PASSED_ENV = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TERM", "HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM",
              "OMP_NUM_THREADS", "VIRTUAL_ENV", "PYTHONHASHSEED")
# Passed to a contained client beside the allowlist: its starter's import path, so the client imports
# the same `core` as the run or swap that started it (not whatever an installed copy points at).
CLIENT_ENV = ("PYTHONPATH",)
HOST_PID_ENV = "SWARMRL_HOST_PID"  # set by `wrap` inside bubblewrap's pid namespace: see `host_pid`
_warned_uncontained = False
_warned_memory = False  # said once per process: no memory cgroup, so no bound on all processes together
_warned_root = False  # said once per process: no user namespace, so no uid of its own inside (auto only)
PR_SET_PDEATHSIG = 1  # linux/prctl.h
# Looked up once here: the child runs the preexec hook between fork and exec, where loading a library
# could deadlock on a lock another thread of the parent held at the fork.
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None
BWRAP_FIX = "apt-get install bubblewrap"
USERNS_FIX = ("allow user namespaces (sysctl user.max_user_namespaces > 0; kernel.unprivileged_userns_clone=1 or "
              "kernel.apparmor_restrict_unprivileged_userns=0 where the kernel has them; a container started with "
              "seccomp or a profile that permits unshare/clone of CLONE_NEWUSER)")
_CORE = Path(__file__).resolve().parents[1]  # the `core` package a contained `swarm` imports
# The two stdlib-only scripts of the network boundary, run by file path with `python -I` (docstrings there).
RELAY = Path(__file__).with_name("relay.py")  # inside the sandbox: loopback port -> the forwarder's socket
FORWARDER = Path(__file__).with_name("forwarder.py")  # outside: the socket -> the server's episode routes
FORWARD_SOCKET = "forward.sock"
WARM_ENV = "SWARMRL_WARM"  # `swarm warm`'s socket (core.run.warm): masked with its folder, as the runtime folder is
# Paths (os.pathsep-separated) every contained process started under this environment has masked: how a
# study hides its sqlite state and MLflow store from the clients of the runs it launches (`swarm run`,
# `swarm swap`, `swarm contain` all read it), without a flag on each command.
HIDE_ENV = "SWARMRL_CONTAIN_HIDE"


def bwrap() -> str | None:
    return shutil.which("bwrap")


def require_bwrap(mode: ContainMode, what: str) -> None:
    """`required` containment on a machine without bwrap, or where the kernel refuses bwrap a user namespace
    (the sandbox would be root: `core.contain.namespaces`): a one-line ConfigError naming the cause and fix."""
    if mode != "required":
        return
    exe = bwrap()
    if exe is None:
        raise ConfigError(f"{what} is required to run under bubblewrap, but `bwrap` is not on PATH: "
                          f"{BWRAP_FIX} (or set it to auto to run without the filesystem boundary)")
    refused = user_namespace_refusal(exe)
    if refused is not None:
        raise ConfigError(f"{what} is required to run in a user namespace (no root inside the sandbox), but this "
                          f"kernel refuses bwrap one: {refused}. {USERNS_FIX} (or set it to auto to run "
                          "without one, as root inside where the starter is root)")


def die_with_parent(sig: int):
    """A preexec hook: `sig` reaches the child when the thread that started it ends (Linux's
    PR_SET_PDEATHSIG, even if the parent was SIGKILLed); elsewhere nothing (orphans end on their own)."""
    def apply() -> None:
        if _prctl is not None:
            _prctl(PR_SET_PDEATHSIG, sig)
    return apply


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


def _preexec(limits: ContainLimits, nproc: int, groups: Sequence[Path], detached: bool):
    orphaned = die_with_parent(signal.SIGKILL)

    def apply() -> None:
        if not detached:
            orphaned()
        for group in groups:  # its pids cgroup and its memory cgroup, those that could be made
            with open(group / "cgroup.procs", "w") as fh:
                fh.write(str(os.getpid()))
        cpu = limits.cpu_s or resource.RLIM_INFINITY  # 0: no CPU-time limit (a client that lives as long as its run)
        for what, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, limits.address_space),
                            (resource.RLIMIT_FSIZE, limits.file_size), (resource.RLIMIT_NPROC, nproc),
                            (resource.RLIMIT_NOFILE, limits.open_files)):
            resource.setrlimit(what, (value, value))
    return apply


def wrap(argv: Sequence[str], cwd: Path, writable: Sequence[Path], readable: Sequence[Path] = (),
         detached: bool = False, hidden: Sequence[Path] = (), *, tmp_bytes: int = ContainLimits().file_size,
         private: Sequence[Path] = (), forward: Path | None = None, port: int = 0) -> list[str]:
    """`argv` under bubblewrap, or unchanged when bwrap is missing (said once). Under bwrap: a read-only /,
    `writable` writable, a private /tmp and `private` folders (its HOME) of at most `tmp_bytes` each, its
    own pid and network namespaces, no capabilities; it dies with its starter unless `detached`. What it
    must read from under /tmp (hidden by the private one) is in `readable`, bound read-only again (so is
    `cwd`). What is `hidden` (`masked_paths`) is masked next, a folder by an empty tmpfs, a file by
    /dev/null; then the `readable` and `writable` folders inside a masked one are bound again (its working
    folder inside a masked run folder). The network namespace has only loopback: with `forward` (the
    forwarder's socket) the command starts behind the relay on 127.0.0.1:`port`, its one way to its
    server; without it the command has no network at all."""
    global _warned_uncontained, _warned_root
    exe = bwrap()
    if exe is None:
        if not _warned_uncontained:
            log.warning("bwrap (bubblewrap) is not on PATH: proposal code runs uncontained by the filesystem "
                        "and the network (environment allowlist and resource limits still apply); install "
                        "bubblewrap to contain it")
            _warned_uncontained = True
        return list(argv)
    shown = [(Path(f).resolve(), "--ro-bind") for f in (*_own_code_under_tmp(), RELAY.parent, *readable, cwd)]
    shown += [(Path(f).resolve(), "--bind") for f in writable]
    masks = [Path(h).resolve() for h in hidden if Path(h).exists()]
    binds: list[str] = []
    for real, how in shown:
        binds += [how, str(real), str(real)]
    for real in masks:
        binds += ["--tmpfs", str(real)] if real.is_dir() else ["--ro-bind", "/dev/null", str(real)]
    for real, how in shown:  # inside a masked folder: bound again on top of its mask
        if any(real != m and real.is_relative_to(m) for m in masks if m.is_dir()):
            binds += [how, str(real), str(real)]
    for folder in private:
        real = str(Path(folder).resolve())
        binds += ["--size", str(tmp_bytes), "--tmpfs", real, "--dir", f"{real}/tmp"]
    command = list(argv)
    if forward is not None:
        binds += ["--ro-bind", str(forward.parent), str(forward.parent)]
        command = [sys.executable, "-I", str(RELAY), "--socket", str(forward), "--port", str(port), "--", *argv]
    tied = [] if detached else ["--die-with-parent"]
    if user_namespace_refusal(exe) is not None and not _warned_root:  # `auto` only: `required` refused already
        log.warning("the kernel refuses bwrap a user namespace (%s): contained code runs as its starter's uid "
                    "inside the sandbox, root where that is root; %s", user_namespace_refusal(exe), USERNS_FIX)
        _warned_root = True
    # In its own pid namespace the command sees itself as pid 2, a pid nobody outside can watch; the host pid
    # of bwrap (which lives exactly as long as the namespace) is given to it instead, as $SWARMRL_HOST_PID:
    # a shell that execs bwrap keeps its pid, so `$$` is known before bwrap starts.
    return ["/bin/sh", "-c", f'exec "$0" --setenv {HOST_PID_ENV} "$$" "$@"', exe,
            *system_args(exe, tmp_bytes), *binds, *tied, "--chdir", str(Path(cwd).resolve()), "--", *command]


def masked_paths(extra: Sequence[Path] = ()) -> list[Path]:
    """What every contained process has masked: this machine's admin token and server files
    (`server_files.token_files`), `swarm warm`'s socket folder ($SWARMRL_WARM's, besides the runtime folder),
    the paths $SWARMRL_CONTAIN_HIDE lists, and `extra` (a caller's own: a run folder's token, a study's
    sqlite state, the MLflow store)."""
    warm = os.environ.get(WARM_ENV)
    listed = [Path(p) for p in os.environ.get(HIDE_ENV, "").split(os.pathsep) if p]
    return list(dict.fromkeys([*token_files(), *([Path(warm).parent] if warm else []), net_root(), *listed,
                               *map(Path, extra)]))


def inner_url(url: str) -> str:
    """The URL by which contained code reaches the swarm server at `url`: the relay's port on its own loopback
    (the same port, so a 127.0.0.1 URL reads the same inside), or `url` itself without bubblewrap."""
    if bwrap() is None:
        return url
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return urlunsplit(("http", f"127.0.0.1:{port}", parts.path, parts.query, parts.fragment))


def _own_code_under_tmp() -> list[Path]:
    """This Python and the folders it imports from, where they live under /tmp (a venv or a checkout
    there): the private /tmp would hide them, and a contained client is our Python running our code. The
    `core` package folder is named on its own: an editable install finds it through its import hook, not
    through sys.path, so a checkout under /tmp is on no sys.path entry."""
    roots = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, *sys.path) if p}  # "": the cwd, not code
    roots.add(_CORE)
    return sorted(r for r in roots if r.is_relative_to("/tmp") and r != Path("/tmp") and r.exists())


def host_pid() -> int:
    """This process's pid as its starter sees it: bwrap's host pid under bubblewrap (`wrap`), else our own.
    A client registers it and ends its client id with it, so the supervisor and `swarm status` can watch it."""
    given = os.environ.get(HOST_PID_ENV, "")
    return int(given) if given.isdigit() else os.getpid()


@dataclass
class Contained:
    """A started contained process and what must be cleaned up after it."""

    proc: subprocess.Popen
    scratch: Path
    group: Path | None
    wrapped: bool = False  # started under bwrap: `proc` is bwrap, the command runs in its pid namespace
    forwarder: subprocess.Popen | None = None  # its one way to its server (`core.contain.forwarder`)
    net: Path | None = None  # the forwarder's socket folder
    memory: Path | None = None  # its memory cgroup (`core.contain.memory_cgroup`), where one could be made

    def signal(self, sig: int) -> None:
        """Send `sig` to every process of its group (SIGTERM asks a client to drain). Under bwrap all but
        bwrap itself: bwrap passes no signal on and dies of a SIGTERM, taking the command with it
        (--die-with-parent) before it could drain; its namespace's processes are in the same group (the
        relay among them, which lives on until the command ends)."""
        if not self.wrapped or sig == signal.SIGKILL:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            return
        for pid in _group_members(self.proc.pid):
            if pid != self.proc.pid:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:  # gone since the listing
                    pass

    def kill(self) -> None:
        """SIGKILL its whole process group (under bwrap, the pid namespace dies with it)."""
        self.signal(signal.SIGKILL)

    def close(self) -> None:
        """Kill what is left of its group (a process it left behind, once it exited) and clean up after it.
        The group's id stays reserved while any member lives, so this never reaches another process."""
        self.kill()
        self.proc.wait()
        if self.forwarder is not None:
            self.forwarder.kill()
            self.forwarder.wait()
        remove_cgroup(self.group)
        remove_cgroup(self.memory)
        shutil.rmtree(self.scratch, ignore_errors=True)
        if self.net is not None:
            shutil.rmtree(self.net, ignore_errors=True)


def popen_contained(argv: Sequence[str], cwd: Path, *, writable: Sequence[Path] = (), readable: Sequence[Path] = (),
                    extra_env: Mapping[str, str] | None = None, limits: ContainLimits = ContainLimits(),
                    detached: bool = False, scratch: Path | None = None, hidden: Sequence[Path] = (),
                    server: str | None = None, **popen: object) -> Contained:
    """Start `argv` contained (module docstring); the caller waits on `.proc` and calls `.close()`.
    `detached`: it outlives its starter, which never closes it, so its HOME goes in `scratch` (a folder
    beside its log, say) instead of a temporary, size-bounded one. `hidden`: masked under bubblewrap, on top
    of `masked_paths()`. `server`: the swarm server it may reach (under bubblewrap through the forwarder,
    its only network; an argument of `argv` equal to it becomes `inner_url(server)`); None: no network."""
    private = scratch is None and bwrap() is not None  # HOME and TMPDIR in a size-bounded tmpfs of its own
    scratch = scratch or Path(tempfile.mkdtemp(prefix="swarmrl-contained-"))
    (scratch / "tmp").mkdir(parents=True, exist_ok=True)
    env = contained_env(scratch, extra_env)
    nproc = user_processes() + limits.processes
    group = pids_cgroup(limits.processes) if os.getuid() == 0 else None
    memory = _memory_bound(limits.memory)
    net = net_folder() if server and bwrap() is not None else None  # 0700
    if net is not None:
        argv = [inner_url(server) if a == server else a for a in argv]
    port = urlsplit(inner_url(server)).port if net is not None else 0
    cmd = wrap(argv, cwd, [*writable, *([] if private else [scratch])], readable, detached, masked_paths(hidden),
               tmp_bytes=limits.file_size, private=[scratch] if private else [],
               forward=net / FORWARD_SOCKET if net is not None else None, port=port or 0)
    proc = forwarder = None
    try:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=_preexec(limits, nproc, [g for g in (group, memory) if g], detached), **popen)  # type: ignore[arg-type]
        if net is not None:
            log_to = popen.get("stdout") if popen.get("stderr") == subprocess.STDOUT else popen.get("stderr")
            forwarder = _start_forwarder(net / FORWARD_SOCKET, server, proc.pid, detached, log_to)
    except BaseException:
        if proc is not None:  # the forwarder did not start: the process would have no way to its server
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        remove_cgroup(group)
        remove_cgroup(memory)
        shutil.rmtree(scratch, ignore_errors=True)
        if net is not None:
            shutil.rmtree(net, ignore_errors=True)
        raise
    # `wrap` changes argv only for bwrap
    return Contained(proc, scratch, group, wrapped=cmd != list(argv), forwarder=forwarder, net=net, memory=memory)


def _memory_bound(limit: int) -> Path | None:
    """A memory cgroup of `limit` bytes for all the processes of one contained start, or None where the machine
    allows none: then only the per-process address-space limit holds, said once per process."""
    global _warned_memory
    group, why = memory_cgroup(limit)
    if group is None and not _warned_memory:
        log.warning("contained processes' memory is bounded per process only (RLIMIT_AS), not in total: %s", why)
        _warned_memory = True
    return group


def _start_forwarder(socket_path: Path, server: str, pid: int, detached: bool, stderr: object) -> subprocess.Popen:
    """The forwarder for the contained process `pid` (`core.contain.forwarder`): our own code, so uncontained;
    it ends with that process, and with its starter unless `detached`. Its refusals go where the process's
    stderr goes when that is a file (a swapped client's log), else to ours."""
    where = stderr if stderr not in (None, subprocess.PIPE, subprocess.STDOUT) else None
    return subprocess.Popen([sys.executable, "-I", str(FORWARDER), "--socket", str(socket_path), "--upstream", server,
                             "--watch-pid", str(pid)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=where, start_new_session=True,  # a Ctrl-C to the terminal is for the run
                            preexec_fn=None if detached else die_with_parent(signal.SIGKILL))


def _group_members(pgid: int) -> list[int]:
    """The pids of process group `pgid`, read from /proc (a stop-time look-up, never per episode)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == pgid:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def run_contained(argv: Sequence[str], cwd: Path, *, timeout_s: float | None, writable: Sequence[Path] = (),
                  extra_env: Mapping[str, str] | None = None, limits: ContainLimits = ContainLimits(),
                  capture: bool = True, hidden: Sequence[Path] = (), server: str | None = None) -> tuple[int | None, str]:
    """Run `argv` contained until it exits or `timeout_s` passes (then its group is killed; None: no timeout).
    -> (exit code, or None when it timed out; its stdout and stderr together, or "" when not `capture`d:
    then it writes to ours). Its group is killed too when this call ends by an exception (a signal)."""
    output = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace") if capture else {}
    started = popen_contained(argv, cwd, writable=writable, extra_env=extra_env, limits=limits, hidden=hidden,
                              server=server, **output)
    try:
        out, _ = started.proc.communicate(timeout=timeout_s)
        return started.proc.returncode, out or ""
    except subprocess.TimeoutExpired:
        started.kill()
        out, _ = started.proc.communicate()
        return None, out or ""
    finally:
        started.close()
