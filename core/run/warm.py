"""A warm `swarm` process that forks `swarm run` and `swarm serve` with their imports already done.

A short `swarm run` spends most of its CPU importing torch, transformers, MLflow and the server (~6 s
of a 2-step tiny run's ~8 s here, docs/benchmarks.md). `swarm warm --socket PATH` imports all that
once and waits. A `swarm run` or `swarm serve` whose environment names that socket in `SWARMRL_WARM`
checks its arguments and config as always, then sends its command line, working folder, environment,
umask and standard streams over the socket, and the warm process forks a child that runs the command
from the top, as a cold start would. The process that was started (the *launcher*) stays the face of
the run for whoever started it: it relays SIGINT, SIGTERM and SIGHUP to the child, and exits with the
child's exit code or dies of the child's signal. When the launcher is killed, the warm process kills
the child (SIGKILL, as the launcher got), whose clients then go as they do when a cold run dies.

A launcher starts cold, with one warning line, whenever the warm process could not run the same code
as a cold start: no socket or no answer, another Python, another `sys.path`, a change to core's source
since the warm process imported it, or a difference in an environment variable that libraries read
at import (IMPORT_TIME_ENV).

Only its owner can use it (`core.run.warm_peer`): the socket lives in a 0700 folder (by default this
user's runtime folder, `$XDG_RUNTIME_DIR/swarmrl/warm.sock`), and both ends check the other by
SO_PEERCRED before anything is sent: the same uid and the same pid and mount namespaces, so nothing
inside a sandbox can have a run forked outside it, and a launcher never sends its environment to a
server of another user. It forks only `run` and `serve` (FORKABLE). The child takes on its launcher's
CPU affinity, resource limits, nice level, umask, folder and environment, and names itself as the
command it runs (its /proc cmdline and comm, so `pgrep -f 'swarm run'` finds it); a launcher in another
cgroup (a Slurm or systemd allocation) starts cold instead.

Deliberately not: a pool, a scheduler or a remote launcher. The warm process is single-threaded where
it forks, and `swarm client` processes still start cold (they are usually contained, and exec bubblewrap).
Its API for a caller that owns one (a study's own warm process): `WarmServer(path, command, env).serve()`
in a `swarm warm --socket PATH` process, `SWARMRL_WARM=PATH` in its launchers' environment, SIGTERM to stop it.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import select
import selectors
import signal
import socket
import struct
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import NoReturn

import core
from core.run.warm_peer import LauncherState, become, cgroup_of, claim, default_socket, peer, peer_refusal

__all__ = ["ENV", "FORKABLE", "WarmServer", "claim", "default_socket", "delegate", "source_stamp"]

ENV = "SWARMRL_WARM"
# Read by torch, transformers, huggingface_hub, tokenizers or Python itself when they import (or at
# interpreter start), so a child forked from the warm process sees the warm process's values: a
# request whose values differ starts cold instead.
IMPORT_TIME_ENV = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "TORCH", "PYTORCH_", "OMP_", "MKL_",
                   "OPENBLAS_", "CUDA_", "PYTHON")
# A request is one length-prefixed JSON document sent with its three descriptors; a bigger one is
# not a launcher's (an environment is a few KiB).
MAX_REQUEST = 1 << 20
# Seconds the warm process waits for a connected launcher's request before it drops it: the loop is
# single-threaded, so a silent peer must not hold the next launcher for long.
REQUEST_TIMEOUT_S = 5.0
_HEADER = struct.Struct("!I")
# The only commands it forks: the two whose imports it holds. Anything else (`swarm client`, `contain`,
# `swap`) would run outside whatever its requester was started in, for no gain.
FORKABLE = ("run", "serve")
_in_fork = False  # set in a forked child: its command must run here, not be delegated again


def _warn(text: str) -> None:
    print(f"swarm: {text}", file=sys.stderr, flush=True)


def source_stamp(root: Path) -> tuple[int, int]:
    """(number of .py files, newest mtime in ns) under `root`: any edit, addition or removal changes it."""
    times = [p.stat().st_mtime_ns for p in root.rglob("*.py")]
    return len(times), max(times, default=0)


def _identity(env: dict[str, str]) -> dict[str, object]:
    """What must be equal between a launcher and the warm process for a fork to run the same code."""
    return {"python": sys.executable, "core": core.__file__, "path": list(sys.path),
            "env": {k: v for k, v in sorted(env.items()) if k.startswith(IMPORT_TIME_ENV)}}


# --- the launcher -----------------------------------------------------------------------------------

def delegate() -> int | None:
    """Run this `swarm` command in a child of the warm process named by $SWARMRL_WARM and return its exit
    code; None to start cold (no warm process named, or it cannot run the same code: a warning says why)."""
    path = os.environ.get(ENV)
    if not path or _in_fork:
        return None
    request = {"argv": sys.argv, "cwd": os.getcwd(), "env": dict(os.environ), "state": asdict(LauncherState.capture()),
               "identity": _identity(dict(os.environ))}
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    replies = sock.makefile("rb")  # its reads wait for the connection below; closing it closes the socket
    try:
        sock.connect(path)
        distrust = peer_refusal(sock, "warm process")
        if distrust:  # before a byte of the environment leaves: it holds credentials
            replies.close()
            sock.close()
            _warn(f"refusing the warm process at {path}: {distrust}; sent it nothing, starting cold")
            return None
        body = json.dumps(request).encode()
        message = _HEADER.pack(len(body)) + body
        try:
            sent = socket.send_fds(sock, [message], [0, 1, 2])
            if sent < len(message):  # not sendall(b""): a refusal may already have closed the other end
                sock.sendall(message[sent:])
        except (BrokenPipeError, ConnectionResetError):
            pass  # it refused this peer before reading the request: its reply, still queued, says why
        sys.stdout.flush()
        sys.stderr.flush()
        reply = _reply(replies)
    except (OSError, ValueError) as e:
        replies.close()
        sock.close()
        _warn(f"the warm process at {path} did not answer ({e}); starting cold")
        return None
    if "pid" not in reply:
        replies.close()
        sock.close()
        _warn(f"the warm process at {path} cannot run this command ({reply.get('refused', reply)}); starting cold")
        return None
    pid = int(reply["pid"])
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # os.kill takes no lock: safe in a handler
        signal.signal(sig, lambda signum, _frame: _kill(pid, signum))
    try:
        end = _reply(replies)
    except (OSError, ValueError):
        end = {}
    finally:
        replies.close()
        sock.close()
    if "signal" in end:  # die of the child's signal, as its parent would see a cold run die
        _die_of(int(end["signal"]))
    if "exit" in end:
        return int(end["exit"])
    _wait_gone(pid)
    _warn(f"the warm process at {path} went away; the exit status of process {pid} is unknown")
    return 1


def _die_of(sig: int) -> NoReturn:
    """End this process by `sig` (its default action), or exit 128 + sig should that not end it."""
    if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
        signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
    os._exit(128 + sig)


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _wait_gone(pid: int) -> None:
    """Until process `pid` (not our child: its parent is the warm process) has ended."""
    try:
        handle = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    select.select([handle], [], [])
    os.close(handle)


def _reply(replies: io.BufferedReader) -> dict:
    """The warm process's next message (one JSON line); {} when it closed the connection."""
    line = replies.readline(MAX_REQUEST)
    return json.loads(line) if line.strip() else {}


# --- the warm process -------------------------------------------------------------------------------

class WarmServer:
    """Accepts launchers on a Unix socket and forks `command(argv)` for each (module docstring)."""

    def __init__(self, path: Path, command: Callable[[list[str]], int], env_before_imports: dict[str, str]) -> None:
        if threading.active_count() != 1:  # a fork copies only the forking thread: locks others held stay held
            raise RuntimeError(f"swarm warm must fork from a single thread; {threading.active_count()} are running")
        self.path, self.command = path, command
        self.identity = _identity(env_before_imports)  # a launcher's is taken before these imports too
        # What the imports themselves put into the environment (torch's inductor cache folder): a cold
        # start's imports would set them again, so each child gets them on top of its launcher's.
        self.import_env = {k: v for k, v in os.environ.items() if k not in env_before_imports}
        self.stamp = source_stamp(Path(core.__file__).parent)
        # pid -> its launcher's connection (EOF: the launcher is gone), None once that launcher was killed
        self.children: dict[int, socket.socket | None] = {}
        self.stopping = False

    def serve(self) -> None:
        claim(self.path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self.path))
        os.chmod(self.path, 0o600)
        listener.listen(16)
        wake_r, self._wake_w = socket.socketpair()
        wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        signal.set_wakeup_fd(self._wake_w.fileno())
        signal.signal(signal.SIGCHLD, lambda *_: None)  # its byte on the wakeup fd is what matters
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._stop)
        sel = selectors.DefaultSelector()
        sel.register(listener, selectors.EVENT_READ, "accept")
        sel.register(wake_r, selectors.EVENT_READ, "wake")
        _warn(f"warm: forking `swarm run` and `swarm serve` from {self.path} (pid {os.getpid()})")
        try:
            while not self.stopping:
                for key, _ in sel.select(timeout=1.0):
                    if key.data == "accept":
                        self._accept(listener, sel)
                    elif key.data == "wake":
                        _drain(wake_r)
                    else:
                        self._launcher_readable(key.data, sel)
                self._reap(sel)
        finally:
            signal.set_wakeup_fd(-1)
            listener.close()
            self.path.unlink(missing_ok=True)

    def _stop(self, *_: object) -> None:
        self.stopping = True  # children run on: each launcher then waits for its child's end by itself

    def _accept(self, listener: socket.socket, sel: selectors.BaseSelector) -> None:
        conn, _ = listener.accept()
        distrust = peer_refusal(conn, "launcher")
        if distrust:  # before reading its request: nothing of it is used
            _warn(f"warm: refused a peer (pid {peer(conn)[0]}): {distrust}")
            _send(conn, {"refused": distrust})
            conn.close()
            return
        fds: list[int] = []
        try:
            request, fds = self._request(conn)
            refused = self._refusal(conn, request)
            if refused:
                _send(conn, {"refused": refused})
                conn.close()
                return
            pid = self._fork(conn, request, fds, sel)
        except (OSError, ValueError, KeyError, TypeError) as e:  # a bad peer costs its own connection only
            _warn(f"warm: dropped a request: {e}")
            _send(conn, {"refused": f"bad request: {e}"})
            conn.close()
            return
        finally:
            for fd in fds:
                os.close(fd)
        self.children[pid] = conn
        sel.register(conn, selectors.EVENT_READ, pid)
        _send(conn, {"pid": pid})
        _warn(f"warm: forked pid {pid} for `swarm {' '.join(map(str, request['argv'][1:3]))}` (launcher pid {peer(conn)[0]})")

    def _request(self, conn: socket.socket) -> tuple[dict, list[int]]:
        conn.settimeout(REQUEST_TIMEOUT_S)
        data, fds, _, _ = socket.recv_fds(conn, 65536, 3)
        try:
            if len(fds) != 3:
                raise ValueError(f"expected 3 descriptors (stdin, stdout, stderr), got {len(fds)}")
            size = _HEADER.unpack_from(data)[0] if len(data) >= _HEADER.size else -1
            if not 0 <= size <= MAX_REQUEST:
                raise ValueError(f"no request header, or a request over {MAX_REQUEST} bytes")
            body = data[_HEADER.size:]
            while len(body) < size:
                chunk = conn.recv(size - len(body))
                if not chunk:
                    raise ValueError("the request ended early")
                body += chunk
            request = json.loads(body)
            if not isinstance(request, dict) or not isinstance(request.get("argv"), list):
                raise ValueError("a request is a JSON object with argv, cwd, env, state and identity")
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        conn.settimeout(None)
        return request, fds

    def _refusal(self, conn: socket.socket, request: dict) -> str | None:
        """Why this (trusted) launcher's request cannot run here as its cold start would, or None."""
        argv = request["argv"]
        if len(argv) < 2 or argv[1] not in FORKABLE:
            return f"it forks only `swarm {'` and `swarm '.join(FORKABLE)}`, not {' '.join(map(str, argv[1:2])) or 'nothing'}"
        why = LauncherState.of(request["state"]).refusal()
        if why:
            return why
        if cgroup_of(peer(conn)[0]) != cgroup_of("self"):
            return "a different cgroup (the launcher runs in an allocation of its own)"
        theirs, ours = request["identity"], self.identity
        if theirs != ours:
            differ = [k for k in ours if k != "env" and theirs.get(k) != ours[k]]
            env_theirs, env_ours = theirs.get("env") or {}, ours["env"]
            differ += [f"${k}" for k in sorted(set(env_theirs) | set(env_ours)) if env_theirs.get(k) != env_ours.get(k)]
            return "a different " + ", ".join(differ or ["request"])  # names, never values: they may be secrets
        if source_stamp(Path(core.__file__).parent) != self.stamp:
            return "core's source changed since the warm process imported it (restart `swarm warm`)"
        return None

    def _fork(self, conn: socket.socket, request: dict, fds: list[int], sel: selectors.BaseSelector) -> int:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid:
            return pid
        code = 1
        try:  # the child: from here on it never returns into the warm process's loop
            signal.set_wakeup_fd(-1)
            for key in list(sel.get_map().values()):
                key.fileobj.close()
            conn.close()
            self._wake_w.close()
            global _in_fork
            _in_fork = True  # its command runs here, never delegated again
            become(request, fds, self.import_env)
            code = self.command([str(a) for a in request["argv"][1:]])
        except KeyboardInterrupt:  # Ctrl-C outside the run's own handling: Python dies of SIGINT then
            traceback.print_exc()
            code = -signal.SIGINT
        except BaseException:
            traceback.print_exc()
        finally:
            _exit(code)

    def _launcher_readable(self, pid: int, sel: selectors.BaseSelector) -> None:
        conn = self.children[pid]
        try:
            gone = not conn.recv(1)
        except OSError:
            gone = True
        if gone:  # the launcher was killed (it relays every other signal): so is its run
            sel.unregister(conn)
            conn.close()
            self.children[pid] = None
            _kill(pid, signal.SIGKILL)

    def _reap(self, sel: selectors.BaseSelector) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is not None:  # its launcher waits for the status
                sel.unregister(conn)
                code = os.waitstatus_to_exitcode(status)
                _send(conn, {"signal": -code} if code < 0 else {"exit": code})
                conn.close()


def _exit(code: int) -> NoReturn:
    """End the child as Python's own exit would: non-daemon threads joined, atexit run, streams flushed;
    a negative code is death by that signal."""
    try:
        for thread in threading.enumerate():
            if thread is not threading.main_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        if code < 0:
            _die_of(-code)
        os._exit(code)


def _send(conn: socket.socket, message: dict) -> None:
    try:
        conn.sendall(json.dumps(message).encode() + b"\n")
    except OSError:
        pass  # the launcher is gone: nobody is left to tell


def _drain(sock: socket.socket) -> None:
    try:
        while sock.recv(4096):
            pass
    except BlockingIOError:
        pass
