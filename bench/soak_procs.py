"""The processes of a soak: the MLflow server it owns, and what it sees of the study's processes in /proc.

`MlflowServer` starts, stops and kills a real `mlflow server` (SQLite backend, artifacts proxied, on
a fixed loopback port so a restart comes back where clients look). `Watcher` polls /proc every
`POLL_S` for the study's `swarm run` processes (their command line carries the study's run folder)
and keeps each one's lifetime: start from /proc, end the last poll that saw it. Those lifetimes are
the soak's own measure of compute time, independent of the study's. Linux only. Nothing here
decides when to kill what (that is `bench/soak.py`'s chaos driver).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx

from bench.soak_books import Lifetime

POLL_S = 0.5
_TICKS = os.sysconf("SC_CLK_TCK")


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def started_at(pid: int) -> float | None:
    """Wall-clock start of a process, from its start in ticks since boot (precise to a tick)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, IndexError, ValueError):
        return None
    return time.time() - uptime + int(fields[19]) / _TICKS  # field 22 of stat; 20 after the name


def pids_matching(text: str) -> list[int]:
    """Live processes (not this one) whose command line contains `text`."""
    me = os.getpid()
    return [int(e.name) for e in Path("/proc").iterdir()
            if e.name.isdigit() and int(e.name) != me and text in cmdline(int(e.name))]


def kill9(pid: int, group: bool = False) -> bool:
    try:
        os.killpg(pid, signal.SIGKILL) if group else os.kill(pid, signal.SIGKILL)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    def __init__(self, mlflow: Path, folder: Path, env: dict[str, str]) -> None:
        self.folder, self.env, self.port = folder, env, free_port()
        self.argv = [str(mlflow), "server", "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}",
                     "--artifacts-destination", str(folder / "artifacts"), "--host", "127.0.0.1",
                     "--port", str(self.port), "--workers", "1"]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def up(self) -> bool:
        try:
            return httpx.get(self.uri + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def start(self, timeout_s: float = 180) -> float:
        """Start it and wait until it answers; returns the seconds that took."""
        t0 = time.monotonic()
        with open(self.folder / "mlflow-server.log", "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.env, start_new_session=True)
        while not self.up():
            if self.proc.poll() is not None or time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"mlflow server did not start (see {self.folder / 'mlflow-server.log'})")
            time.sleep(0.5)
        return time.monotonic() - t0

    def stop(self, hard: bool = False) -> None:
        """SIGTERM (or SIGKILL) its whole process group (the server and its workers) and wait."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL if hard else signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            kill9(self.proc.pid, group=True)
            self.proc.wait()
        self.proc = None


class Watcher:
    """Lifetimes of the `swarm run` processes whose `--run-id-file` lies under `runs_dir`."""

    def __init__(self, runs_dir: Path) -> None:
        self.marker = str(runs_dir) + "/"
        self.lifetimes: dict[int, Lifetime] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="soak-watcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.poll()

    def poll(self) -> list[int]:
        """Look once; the pids of the core runs alive now."""
        alive, now = [], time.time()
        for pid in pids_matching(self.marker):
            argv = cmdline(pid).split()
            if "--run-id-file" not in argv:
                continue  # a client process of a run: its run is watched, not it
            launch = Path(argv[argv.index("--run-id-file") + 1]).parent.name
            with self._lock:
                seen = self.lifetimes.get(pid)
                if seen is None or seen.launch != launch:
                    seen = Lifetime(pid=pid, launch=launch, start_s=started_at(pid) or now, last_seen_s=now)
                self.lifetimes[pid] = Lifetime(pid, launch, seen.start_s, now)
            alive.append(pid)
        return alive

    def killed(self, pid: int) -> None:
        """A run the soak just killed ended now, not at the next poll."""
        with self._lock:
            if pid in self.lifetimes:
                self.lifetimes[pid] = Lifetime(pid, self.lifetimes[pid].launch, self.lifetimes[pid].start_s, time.time())

    def all(self) -> list[Lifetime]:
        with self._lock:
            return list(self.lifetimes.values())

    def _loop(self) -> None:
        while not self._stop.wait(POLL_S):
            self.poll()
