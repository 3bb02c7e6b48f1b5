"""The study's own `swarm warm` process: its core runs and smoke servers fork from it, and it lives and ends with the study.

A study starts dozens of short `swarm run`s; each would import torch, transformers and MLflow again.
`swarm warm` (core/run/warm.py) imports them once and forks the runs. A study that drives itself starts
one of its own, with its socket in `.study/warm/` (a folder only this user can enter, mode 0700, which
`swarm warm` checks), and names it in `SWARMRL_WARM` for the processes it starts (`run_env`, the smoke
server of validation). It stops it (SIGTERM: the runs it forked go on, each with its launcher) when the
study process ends, for whatever reason. The socket is its owner's only: the warm process and every
launcher check each other with SO_PEERCRED, so contained proposal code, which runs in other namespaces,
cannot have anything forked, and containment masks the folder as well (`$SWARMRL_WARM`'s folder).

A study started with `SWARMRL_WARM` already set (a person's own warm process, or a test process's) uses
that one and starts none. The study waits for its warm process to listen (its imports take as long as one
cold start's) before it goes on, at most READY_TIMEOUT_S; a warm process that is not up by then, or died,
leaves the launchers to start cold, each with one warning line in its log. Deliberately not: a pool, or a
warm process shared between studies.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from researcher.runs.launcher import WARM_ENV

log = logging.getLogger(__name__)

SOCKET = "warm.sock"
STOP_GRACE_S = 10.0  # SIGTERM makes it close its socket and return; past this it is killed
# Its imports (torch, transformers, MLflow) take seconds on a quiet machine, minutes on a loaded 2-core one;
# a run launched meanwhile would import them all itself, so the study waits this long at most.
READY_TIMEOUT_S = 300.0
_READY_POLL_S = 0.2
# An AF_UNIX path longer than this cannot be bound (sun_path is 108 bytes with its NUL): the study then
# runs without a warm process of its own, cold, rather than have `swarm warm` fail at bind.
MAX_SOCKET_PATH = 107
PR_SET_PDEATHSIG = 1  # linux/prctl.h
# Looked up before any fork: the child between fork and exec may only call what is loaded already.
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


@contextmanager
def study_warm(state: Path, swarm: Path) -> Iterator[str | None]:
    """While the block runs, a `swarm warm` of the study's own at `state/warm/warm.sock` (its log beside it).
    -> the socket path to put in `SWARMRL_WARM` (the environment's own when one is set; None when the
    path is too long for a socket)."""
    if os.environ.get(WARM_ENV):
        yield os.environ[WARM_ENV]
        return
    folder = state / "warm"
    path = folder / SOCKET
    if len(str(path.resolve())) > MAX_SOCKET_PATH:
        log.warning("the study's warm socket path %s is longer than a Unix socket's %d bytes: its runs start cold",
                    path, MAX_SOCKET_PATH)
        yield None
        return
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)  # mkdir's mode is cut by the umask, and an older folder may be wider
    with open(folder / "warm.log", "ab") as out:
        proc = subprocess.Popen([str(swarm), "warm", "--socket", str(path)], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,  # a Ctrl-C is for the study
                                env={k: v for k, v in os.environ.items() if k != WARM_ENV},
                                preexec_fn=_die_with_study)
    try:
        _wait_ready(proc, path)
        yield str(path)
    finally:
        stop(proc)


def _wait_ready(proc: subprocess.Popen[bytes], path: Path) -> None:
    """Until the warm process listens at `path`, ends, or READY_TIMEOUT_S passes (then the runs start cold)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not path.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(_READY_POLL_S)
    if not path.exists():
        log.warning("the study's warm process is not up (%s): its runs start cold; see %s",
                    f"exit code {proc.returncode}" if proc.poll() is not None else "still importing",
                    path.with_name("warm.log"))


def _die_with_study() -> None:
    """In the child before exec: SIGTERM when the study process dies, even by SIGKILL (no warm process is left
    behind holding its imports' memory); its forked runs go on, as at a normal stop."""
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the warm process (it stops accepting; its forked runs go on) and wait; SIGKILL past the grace."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
