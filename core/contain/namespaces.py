"""What a bubblewrap sandbox is made of besides the files it sees: its namespaces, its user, its /proc and /dev.

`system_args(bwrap, tmp_bytes)` is the part of the bwrap command line that `core.contain.contained.wrap` puts
around the sandbox's own binds:
- a user namespace (`--unshare-user`) in which the command is the unprivileged SANDBOX_ID, not root, with
  every capability dropped and no further user namespace of its own (`--disable-userns`, where this
  bwrap has it). Outside it the command's files are its starter's uid (root where the study runs as root),
  but it holds no capability there;
- the kernel settings read-only whatever the uid: `/proc/sys` (and `/proc/sysrq-trigger` where the kernel
  has one) is bound read-only over the sandbox's /proc. A uid mapped to root still passes the owner check
  on `kernel/core_pattern`, so the mount, not the uid, is what holds;
- pid, network and IPC namespaces (SysV shared memory and message queues die with the sandbox);
- a read-only /dev (its device nodes still work) and a private /tmp and /dev/shm of `tmp_bytes` each, so no
  tmpfs of the sandbox holds more than its starter allowed.

`user_namespace_refusal()` says why the kernel (or bwrap) refuses a user namespace here, None when it
allows one: `require_bwrap` turns that into a refusal for `required` containment, `auto` runs without one
(said once). It decides nothing about which files a sandbox sees (`contained.wrap`) or its limits.
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

# The uid and gid the contained command has inside its user namespace: any unprivileged id. bwrap maps it to
# its starter's, so the files it writes in its worktree are its starter's, as they were before.
SANDBOX_ID = 1000
# What of /proc acts on the whole machine and is not namespaced: read-only inside (module docstring).
KERNEL_SURFACES = (Path("/proc/sys"), Path("/proc/sysrq-trigger"))
PROBE_TIMEOUT_S = 30.0  # a bwrap that starts `true`: milliseconds, unless the machine is badly loaded


@functools.cache
def _help(bwrap: str) -> str:
    done = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    return done.stdout + done.stderr


def user_args(bwrap: str) -> list[str]:
    """The user-namespace part of the command line: unprivileged, no capabilities, no nested namespaces."""
    nested = ["--disable-userns"] if "--disable-userns" in _help(bwrap) else []
    return ["--unshare-user", "--uid", str(SANDBOX_ID), "--gid", str(SANDBOX_ID), *nested]


@functools.cache
def user_namespace_refusal(bwrap: str) -> str | None:
    """None when `bwrap` can start a command in a user namespace here, else why not (bwrap's own words)."""
    try:
        done = subprocess.run([bwrap, "--ro-bind", "/", "/", *user_args(bwrap), "--", "true"],
                              capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"bwrap could not be probed: {e}"
    if done.returncode == 0:
        return None
    return (done.stderr or done.stdout).strip() or f"bwrap exited {done.returncode}"


def system_args(bwrap: str, tmp_bytes: int) -> list[str]:
    """The sandbox's namespaces, /, /dev, /proc and /tmp (module docstring); the user namespace only when
    the kernel allows one (`user_namespace_refusal`)."""
    size = ["--size", str(tmp_bytes)]
    kernel = [f for p in KERNEL_SURFACES if p.exists() for f in ("--ro-bind", str(p), str(p))]
    user = user_args(bwrap) if user_namespace_refusal(bwrap) is None else []
    return ["--ro-bind", "/", "/", "--dev", "/dev", *size, "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
            "--proc", "/proc", *kernel, *size, "--tmpfs", "/tmp",
            "--unshare-pid", "--unshare-net", "--unshare-ipc", *user, "--cap-drop", "ALL"]
