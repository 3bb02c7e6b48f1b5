"""Client pid files and `swarm swap`: find the running clients of a sandbox and replace them live.

Every `swarm client` process leaves a pid file under `$SWARMRL_STATE` (default
`~/.cache/swarmrl/clients`) holding its pid and its command line, and removes it on every exit. A
pid file can still outlive its process (SIGKILL, a reboot), and the pid may by then belong to another
program: before anyone signals it, the live process's command line must equal the recorded one,
otherwise the file is stale, is removed, and nothing is signalled.

Hot swap is "start the new code's client, then SIGTERM the old ones": each old client drains its
in-flight episodes (bounded by the lease) and exits. This module does not run episodes.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from core.sandbox import load_agent

log = logging.getLogger(__name__)

PID_DIR_ENV = "SWARMRL_STATE"  # where running clients leave pid files for `swarm swap`
# The new client must survive this long before the old ones are told to stop: an import error or a
# bad argument shows within it, and the old client then keeps serving.
SWAP_SETTLE_S = 1.0


def pid_dir() -> Path:
    return Path(os.environ.get(PID_DIR_ENV, Path.home() / ".cache" / "swarmrl" / "clients"))


def client_stem(name: str, url: str) -> str:
    """Pid files of one sandbox's clients against one server share this stem (name and port)."""
    return f"{name}-{url.rstrip('/').rsplit(':', 1)[-1]}"


def cmdline(pid: int) -> list[str] | None:
    """The command line of a live process, or None when there is none (or it cannot be read)."""
    if Path("/proc/self/cmdline").exists():
        try:
            raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return None
        return [a.decode(errors="replace") for a in raw.split(b"\0") if a] or None
    try:  # no /proc (macOS): ps prints the arguments joined by spaces
        out = subprocess.run(["ps", "-o", "args=", "-p", str(pid)], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.split() if out.returncode == 0 and out.stdout.strip() else None


@dataclass
class PidFile:
    path: Path

    @classmethod
    def create(cls, name: str, url: str) -> PidFile:
        """Record this process (pid and command line) as a client of sandbox `name` against `url`."""
        pid = os.getpid()
        path = pid_dir() / f"{client_stem(name, url)}-{pid}.pid"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"pid": pid, "cmdline": cmdline(pid) or sys.argv}))
        return cls(path)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)

    def live_pid(self) -> int | None:
        """The recorded pid when that process still runs the recorded command line; else None."""
        try:
            record = json.loads(self.path.read_text())
            pid, recorded = int(record["pid"]), list(record["cmdline"])
        except (OSError, ValueError, KeyError, TypeError):
            return None  # unreadable, or an old bare-pid file: it cannot be verified, so it is not trusted
        return pid if cmdline(pid) == recorded else None


def running_clients(name: str, url: str) -> list[int]:
    """Pids of the verified running clients of `name` against `url`; stale pid files are removed."""
    pids = []
    for path in sorted(pid_dir().glob(f"{client_stem(name, url)}-*.pid")):
        pid = PidFile(path).live_pid()
        if pid is None:
            log.info("removing stale pid file %s (no such client process runs now)", path)
            path.unlink(missing_ok=True)
        else:
            pids.append(pid)
    return pids


def swap(spec: str, url: str, *, concurrency: int) -> int:
    """Hot swap: start the new code's client, then SIGTERM the old ones so they drain and exit."""
    try:
        agent = load_agent(spec)  # fail before touching the running client if the new code does not load
    except ValueError as e:
        log.error("%s; the running client is left alone", e)
        return 2
    old = running_clients(agent.name, url)
    cmd = [sys.executable, "-m", "core.cli", "client", spec, "--server", url, "--concurrency", str(concurrency)]
    pid_dir().mkdir(parents=True, exist_ok=True)
    log_path = pid_dir() / f"{client_stem(agent.name, url)}-{int(time.time())}.log"
    with open(log_path, "ab") as log_file:  # the new client outlives this command: it must not hold our stdout
        new = subprocess.Popen(cmd, start_new_session=True, stdout=log_file, stderr=subprocess.STDOUT)
    time.sleep(SWAP_SETTLE_S)
    if new.poll() is not None:
        log.error("new client exited at once (code %s, log %s); the old one keeps running", new.returncode, log_path)
        return 1
    for pid in old:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    log.info("new client pid %d took over %s (log: %s); %d old client(s) draining", new.pid, agent.name, log_path, len(old))
    return 0
