"""How many processes a contained process may have: the user's count for RLIMIT_NPROC, and pids cgroups.

RLIMIT_NPROC counts every process and thread of the user, so `core.contain.contained` sets it to
`user_processes()` plus the process's own allowance. As root the kernel ignores that limit, so a
contained process then joins a fresh pids cgroup (`pids_cgroup`, cgroup v1 or v2, when this process
may make one), removed when it ends (`remove_cgroup`); those a detached process left are swept on
the next one. It is deliberately not containment: it starts, signals and limits no process.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

_CGROUP_PIDS = Path("/sys/fs/cgroup/pids")  # cgroup v1's pids hierarchy (v2: the unified tree, below)
_CGROUP_V2 = Path("/sys/fs/cgroup")
CGROUP_SWEEP_AGE_S = 60.0  # an empty cgroup older than this was left by a detached process that ended


def user_processes() -> int:
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


def pids_cgroup(limit: int) -> Path | None:
    """A fresh pids cgroup holding at most `limit` tasks, when this process may make one (as root in most
    containers); None otherwise. The child joins it before exec."""
    for root in (_CGROUP_PIDS, _CGROUP_V2):
        if not (root / "cgroup.procs").exists() or not os.access(root, os.W_OK):
            continue
        sweep_cgroups(root)
        try:
            group = Path(tempfile.mkdtemp(prefix="swarmrl-contained-", dir=root))
        except OSError:
            continue
        try:
            (group / "pids.max").write_text(str(limit))
            return group
        except OSError:  # no pids controller here (v2 without it enabled)
            remove_cgroup(group)
    return None


def sweep_cgroups(root: Path) -> None:
    """Remove the empty pids cgroups that detached processes left when they ended (nobody waits on them to
    remove theirs). The kernel refuses to remove one with tasks in it; one made in the last minute is left
    alone, as its process may not have joined it yet."""
    for group in root.glob("swarmrl-contained-*"):
        try:
            if time.time() - group.stat().st_mtime > CGROUP_SWEEP_AGE_S:
                group.rmdir()
        except OSError:
            continue


def remove_cgroup(group: Path | None, wait_s: float = 5.0) -> None:
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
