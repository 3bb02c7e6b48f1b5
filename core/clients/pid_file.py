"""A client's pid file: how tools on this machine find the detached clients of a sandbox.

Every `swarm client` leaves `$SWARMRL_STATE/<sandbox>-<port>-<pid>.pid` (pid and command line) while it
runs. A pid file may outlive its process (SIGKILL) and its pid be reused, so whoever signals by it checks
the command line first (`cmdline`). Nothing here signals by pid file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from core.sandbox.folder import safe_name
from core.local_state import pid_dir


def client_stem(name: str, url: str) -> str:
    """Pid files of one sandbox's clients against one server share this stem (name and port)."""
    return safe_name(f"{name}-{url.rstrip('/').rsplit(':', 1)[-1]}")


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
