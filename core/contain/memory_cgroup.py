"""The total memory of one contained process and all it starts: a memory cgroup, where this machine lets us make one.

RLIMIT_AS bounds each process on its own, so N children hold N times it; a memory cgroup bounds them together
(their pages, the tmpfs pages they write, their shared memory), and the kernel's OOM killer ends one of them
past it. `memory_cgroup(limit)` makes a fresh group under this process's own memory cgroup (so the sandbox
stays inside whatever bounds its starter), cgroup v2 (`memory.max`, `memory.swap.max` 0) or v1
(`memory.limit_in_bytes`, and `memory.memsw.limit_in_bytes` where swap is accounted), and says why not when
it cannot: no controller mounted, not ours to write (an unprivileged user without a delegated cgroup), or
the controller not enabled for children. `core.contain.contained` then keeps the per-process limit alone
and says so once. The child joins the group between fork and exec; `process_count.remove_cgroup` removes it.
It starts and signals nothing.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from core.contain.process_count import remove_cgroup, sweep_cgroups

CGROUP_ROOT = Path("/sys/fs/cgroup")
_V1 = CGROUP_ROOT / "memory"  # cgroup v1's memory hierarchy
_V2_HYBRID = CGROUP_ROOT / "unified"  # cgroup v2 beside v1 controllers (a hybrid layout)
PREFIX = "swarmrl-contained-"  # the name process_count's sweep looks for


def _own_paths(proc_cgroup: str) -> tuple[str | None, str | None]:
    """(this process's v1 memory cgroup path, its v2 path) from /proc/self/cgroup's text."""
    v1 = v2 = None
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v1, v2


def _candidates() -> list[tuple[Path, dict[str, str]]]:
    """(parent folder, {file: value} to write) for each hierarchy to try, this process's own group first."""
    try:
        v1, v2 = _own_paths(Path("/proc/self/cgroup").read_text())
    except OSError:
        return []
    found = []
    if v1 is not None and (_V1 / "memory.limit_in_bytes").exists():
        own = _V1 / v1.lstrip("/")
        found.append((own if own.is_dir() else _V1, {"memory.limit_in_bytes": "{n}", "memory.memsw.limit_in_bytes": "{n}"}))
    for root in (CGROUP_ROOT, _V2_HYBRID):
        if v2 is not None and (root / "cgroup.controllers").exists():
            own = root / v2.lstrip("/")
            found.append((own if own.is_dir() else root, {"memory.max": "{n}", "memory.swap.max": "0"}))
    return found


def memory_cgroup(limit: int) -> tuple[Path | None, str]:
    """A fresh memory cgroup holding at most `limit` bytes, and "" (what the child joins before exec); or
    (None, why none could be made here)."""
    why = "no memory cgroup controller is mounted"
    for parent, settings in _candidates():
        if not os.access(parent, os.W_OK):
            why = f"{parent} is not writable by this user (no delegated cgroup)"
            continue
        sweep_cgroups(parent)
        try:
            group = Path(tempfile.mkdtemp(prefix=PREFIX, dir=parent))
        except OSError as e:
            why = f"cannot make a cgroup in {parent}: {e.strerror}"
            continue
        first = next(iter(settings))
        if not (group / first).exists():  # v2 with the memory controller not enabled for children
            remove_cgroup(group)
            why = f"the memory controller is not enabled in {parent}/cgroup.subtree_control"
            continue
        try:
            for name, value in settings.items():
                if (group / name).exists():  # swap accounting may be off
                    (group / name).write_text(value.format(n=limit))
            return group, ""
        except OSError as e:
            remove_cgroup(group)
            why = f"cannot set {first} in {group}: {e.strerror}"
    return None, why
