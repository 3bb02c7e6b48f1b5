"""Who may use `swarm warm`, and what a forked run takes on from its launcher (`core.run.warm`).

The warm process forks `swarm run` and `swarm serve` for whoever connects to its socket, with that
peer's environment; a launcher sends it its whole environment (credentials included). So both ends
check the other before anything else, by what the kernel says about the peer (SO_PEERCRED), never by
what the peer states: the same uid, the same pid namespace and the same mount namespace
(`peer_refusal`). A process inside bubblewrap (its own pid and mount namespaces) is refused even if it
can reach the socket, and a launcher sends nothing to a server run by another user or from inside a
sandbox. The socket lives in a folder only its owner can enter (`private_folder`, 0700), by default
this user's runtime folder (`default_socket`), and an existing path that is not a socket is refused,
never deleted (`claim`).

`LauncherState` is the process state a cold start would have had and a fork does not inherit: CPU
affinity, resource limits, nice level and umask (the environment, folder and streams travel in the
request itself), and `cgroup_of` tells whether the launcher sits in another cgroup (a Slurm or systemd
allocation), in which case it starts cold instead.

Deliberately not: authentication between users (one user's warm process serves that user only) or a
defence against a process of the same user outside any sandbox, which can read that user's files anyway.
"""

from __future__ import annotations

import io
import logging
import os
import resource
import signal
import socket
import stat
import struct
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import setproctitle

from core.local_state import runtime_dir

# The rlimits a launcher passes on: those a Slurm or systemd allocation, or a person's `ulimit`, sets.
RLIMITS = {name: getattr(resource, name) for name in (
    "RLIMIT_AS", "RLIMIT_CORE", "RLIMIT_CPU", "RLIMIT_DATA", "RLIMIT_FSIZE", "RLIMIT_MEMLOCK", "RLIMIT_NOFILE",
    "RLIMIT_NPROC", "RLIMIT_RSS", "RLIMIT_STACK") if hasattr(resource, name)}
NAMESPACES = ("pid", "mnt")  # a sandbox (bubblewrap) has its own of both; a process beside us shares ours
SOCKET_NAME = "warm.sock"


class WarmRefused(RuntimeError):
    """A socket path or peer that `swarm warm` or its launcher will not use; the message says why."""


def default_socket() -> Path:
    """`<runtime folder>/warm.sock`: `$XDG_RUNTIME_DIR/swarmrl/warm.sock`, else a per-user folder (never /tmp)."""
    return runtime_dir() / SOCKET_NAME


def private_folder(folder: Path) -> None:
    """Make `folder` (0700, parents as needed) or check that it is one only this user can enter: owned by
    us, no access for group or others. A shared folder (/tmp) is refused, not changed."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = folder.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise WarmRefused(f"the socket's folder {folder} must be this user's only (mode 0700, owned by uid "
                          f"{os.getuid()}); it is mode {stat.S_IMODE(info.st_mode):o}, owned by uid {info.st_uid}: "
                          "give --socket a path in a private folder (the default is $XDG_RUNTIME_DIR/swarmrl/)")


def claim(path: Path) -> None:
    """Make `path` free for a new warm process in a private folder: a dead warm process's socket is removed;
    a live one's, or anything that is not a socket, is refused (never deleted)."""
    private_folder(path.parent)
    try:
        info = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise WarmRefused(f"{path} exists and is not a socket: refusing to replace it (give --socket a new path)")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        if probe.connect_ex(str(path)) == 0:
            raise WarmRefused(f"another warm process listens at {path}")
    path.unlink()


def peer(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket, as the kernel recorded it."""
    return struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))


def _namespace(pid: int | str, kind: str) -> tuple[int, int]:
    info = os.stat(f"/proc/{pid}/ns/{kind}")
    return info.st_dev, info.st_ino


def peer_refusal(conn: socket.socket, who: str) -> str | None:
    """Why the peer on `conn` (`who`: "warm process" or "launcher") may not be trusted, or None: it must run
    as our uid, in our pid and mount namespaces (module docstring)."""
    pid, uid, _ = peer(conn)
    if uid != os.getuid():
        return f"the {who} runs as uid {uid}, not this user's ({os.getuid()})"
    if pid <= 0:  # in a pid namespace we cannot see into
        return f"the {who} runs in another pid namespace"
    try:
        differ = [kind for kind in NAMESPACES if _namespace(pid, kind) != _namespace("self", kind)]
    except OSError as e:
        return f"the {who}'s namespaces cannot be read ({e.strerror})"
    if differ:
        return f"the {who} runs in another {' and '.join(differ)} namespace (a sandbox)"
    return None


def cgroup_of(pid: int | str) -> str:
    """The cgroup(s) process `pid` belongs to, as /proc lists them ("" when it cannot be read)."""
    try:
        return Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return ""


@dataclass
class LauncherState:
    """What a forked run takes on from its launcher besides its environment, folder and streams."""

    affinity: list[int] = field(default_factory=list)  # CPUs it may run on (`taskset`, a Slurm allocation)
    rlimits: dict[str, list[int]] = field(default_factory=dict)  # name -> [soft, hard]
    nice: int = 0
    umask: int = 0o022

    @classmethod
    def capture(cls) -> LauncherState:
        mask = os.umask(0)
        os.umask(mask)
        return cls(sorted(os.sched_getaffinity(0)), {n: list(resource.getrlimit(r)) for n, r in RLIMITS.items()},
                   os.getpriority(os.PRIO_PROCESS, 0), mask)

    @classmethod
    def of(cls, sent: object) -> LauncherState:
        """The state a request carries; ValueError when it is not one."""
        if not isinstance(sent, dict) or set(sent) != set(asdict(cls())):
            raise ValueError("a request's state has affinity, rlimits, nice and umask")
        state = cls(**sent)
        if not all(isinstance(c, int) for c in state.affinity) or not isinstance(state.nice, int) or \
                not isinstance(state.umask, int) or not isinstance(state.rlimits, dict) or \
                not all(k in RLIMITS and isinstance(v, list) and len(v) == 2 for k, v in state.rlimits.items()):
            raise ValueError("a request's state is malformed")
        return state

    def refusal(self) -> str | None:
        """Why this process could not take the state on (an unprivileged process cannot raise a hard limit or
        lower its nice level), or None."""
        if os.geteuid() == 0:
            return None
        for name, (_, hard) in self.rlimits.items():
            ours = resource.getrlimit(RLIMITS[name])[1]
            if ours != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or hard > ours):
                return f"a higher hard {name} than the warm process's"
        if self.nice < os.getpriority(os.PRIO_PROCESS, 0):
            return "a lower nice level than the warm process's"
        return None

    def apply(self) -> None:
        """Take this state on (in the forked child, before the command runs)."""
        if self.affinity:
            os.sched_setaffinity(0, self.affinity)
        for name, (soft, hard) in self.rlimits.items():
            resource.setrlimit(RLIMITS[name], (soft, hard))
        os.setpriority(os.PRIO_PROCESS, 0, self.nice)
        os.umask(self.umask)


def become(request: dict, fds: list[int], import_env: dict[str, str]) -> None:
    """Turn a child forked by the warm process into its launcher's command: its streams, folder, state
    (`LauncherState`), environment (with `import_env`, what the imports themselves set, beneath it),
    signals and name."""
    # As the command it runs in ps, top and pgrep (/proc cmdline and comm), not as `swarm warm`. First: it needs
    # the process's environment block as exec left it, which clearing os.environ below would move.
    setproctitle.setproctitle(" ".join(["swarm", *map(str, request["argv"][1:])]))
    os.setsid()
    logging.root.handlers.clear()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(request["cwd"])
    LauncherState.of(request["state"]).apply()
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in request["env"].items()})
    for key, value in import_env.items():
        os.environ.setdefault(key, value)
    tempfile.tempdir = None  # computed from the warm process's TMPDIR at first use: the launcher's from here on
    sys.argv = [str(a) for a in request["argv"]]
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8",
                                  line_buffering=os.isatty(1), write_through=unbuffered)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                                  line_buffering=True, write_through=unbuffered)
