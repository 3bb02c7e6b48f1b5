"""A throwaway local Ray cluster for tests: `ray start --head --block` in its own session.

It gets a short private temp dir (Ray's socket paths must stay under ~107 characters), free ports and
the test's CPU count, and is stopped by killing its process group, so no other Ray on the machine
is touched (`ray stop` would stop every Ray of this user).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

START_TIMEOUT_S = 120.0  # a busy 2-core machine starts the head in ~20 s
STOP_WAIT_S = 3.0  # after SIGTERM, then SIGKILL for whatever of the cluster is left (the tests keep no state in it)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def local_ray_cluster(num_cpus: int = 2, dashboard: bool = False):
    """Yields (gcs address, dashboard URL or None); the cluster is gone afterwards."""
    tmp = tempfile.mkdtemp(prefix="rt-", dir="/tmp")
    port, dash_port = _free_port(), _free_port()
    ray_bin = str(Path(sys.executable).with_name("ray"))
    # No memory monitor: on a shared test machine other processes' memory would make Ray kill this
    # cluster's workers (its OOM policy counts the whole node); the tests' actors are small.
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": tmp, "RAY_memory_monitor_refresh_ms": "0"}
    cmd = [ray_bin, "start", "--head", "--block", f"--num-cpus={num_cpus}", f"--port={port}", f"--temp-dir={tmp}",
           "--disable-usage-stats", f"--include-dashboard={'true' if dashboard else 'false'}",
           f"--dashboard-port={dash_port}", "--dashboard-host=127.0.0.1"]
    log = open(Path(tmp) / "head.log", "wb")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address, dash = f"127.0.0.1:{port}", f"http://127.0.0.1:{dash_port}" if dashboard else None
    try:
        _wait_up(proc, port, dash, Path(tmp) / "head.log")
        yield address, dash
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):  # the head's session: gcs, raylet, workers, dashboard
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=STOP_WAIT_S)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _wait_up(proc: subprocess.Popen, port: int, dash: str | None, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ray start exited {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
        if b"Ray runtime started" in log.read_bytes() and _listening(port):
            if dash is None or _dashboard_up(dash):
                return
        time.sleep(0.5)
    raise RuntimeError(f"ray did not start in {START_TIMEOUT_S:.0f} s:\n{log.read_text(errors='replace')[-3000:]}")


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _dashboard_up(url: str) -> bool:
    try:
        return httpx.get(url + "/api/version", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
