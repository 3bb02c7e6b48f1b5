"""Server files and pid files: how tools on this machine find a running server and its local clients.

Server files: `swarm run` writes `<run folder>/server.json` (the run folder is the parent of
`trainer.checkpoint_dir`) holding the URL and the path of a 0600 file with the admin token, and both
`swarm run` and `swarm serve` leave the same under `$SWARMRL_STATE/servers/<port>.json`, so a swap
on this machine finds the token by URL; all are removed when the server stops.

Pid files: every `swarm client` leaves `$SWARMRL_STATE/<sandbox>-<port>-<pid>.pid` (pid and command
line) while it runs, so tools and tests on this machine can find detached clients; a pid file may
outlive its process (SIGKILL) and its pid be reused, so whoever signals by it checks the command
line first. Nothing here signals by pid file.
It holds no policy about swapping (`core.clients.hotswap`) and runs no process.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from core.clients.sandbox import safe_name

PID_DIR_ENV = "SWARMRL_STATE"  # where clients leave pid files, swap its clients' logs, servers their files
ADMIN_TOKEN_ENV = "SWARMRL_ADMIN_TOKEN"  # the admin token for `swarm swap` when the server runs elsewhere
SERVER_FILE = "server.json"  # in a `swarm run` folder: {url, admin_token_file, pid, host, started, run_folder}


class ServerFileError(ValueError):
    """No usable server file or admin token; the message is the one line a person reads."""


def pid_dir() -> Path:
    return Path(os.environ.get(PID_DIR_ENV, Path.home() / ".cache" / "swarmrl" / "clients"))


# -- server files -----------------------------------------------------------------------------------


def _write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read (0600 from its creation, not chmod after)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


def write_server_files(url: str, token: str, run_folder: Path | None) -> list[Path]:
    """Tell tools where the server is: `<run_folder>/server.json` (when given) and the local index
    entry, each with a 0600 token file beside it. -> the files written, for `remove_server_files`."""
    port = urlparse(url).port
    targets = [(Path(run_folder) / SERVER_FILE, Path(run_folder) / "admin_token")] if run_folder else []
    targets.append((pid_dir() / "servers" / f"{port}.json", pid_dir() / "servers" / f"{port}.token"))
    written = []
    for info, token_file in targets:
        _write_private(token_file, token)
        _write_private(info, json.dumps({"url": url, "admin_token_file": str(token_file.resolve()),
                                         "pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                                         # so `token_files` finds (and containment masks) a run's own token
                                         "run_folder": str(Path(run_folder).resolve()) if run_folder else None}))
        written += [info, token_file]
    return written


def runtime_dir() -> Path:
    """This user's folder for sockets (`swarm warm`'s): `$XDG_RUNTIME_DIR/swarmrl` (a per-user tmpfs only
    its owner enters), else `<pid_dir>/../run`; created 0700 by whoever makes a socket there
    (`core.run.warm_peer.private_folder`), never a fixed world-writable path such as /tmp."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    return Path(base) / "swarmrl" if base else pid_dir().parent / "run"


def token_files(run_folder: Path | None = None) -> list[Path]:
    """What a contained process must not see (`core.clients.contain` masks it under bubblewrap), all of it
    readable by this user: the index of this machine's servers (every live server's token and server file,
    `swarm serve`'s too), the admin token and server.json of every run that index names (a sibling run's,
    with which code could pause or shut it down), those of `run_folder` (the caller's own run), and the
    runtime folder holding `swarm warm`'s socket. A run started after the contained process is not in
    this list; it cannot reach that run's server anyway (its network namespace, `core.clients.forwarder`)."""
    index = pid_dir() / "servers"
    found = [index, runtime_dir()]
    for entry in sorted(index.glob("*.json")) if index.is_dir() else []:
        try:
            info = json.loads(entry.read_text())
            found.append(Path(info["admin_token_file"]))
            if info.get("run_folder"):
                found += [Path(info["run_folder"]) / "admin_token", Path(info["run_folder"]) / SERVER_FILE]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # half written, or removed since the listing: nothing of it to mask
    if run_folder is not None:
        found += [Path(run_folder) / "admin_token", Path(run_folder) / SERVER_FILE]
    return list(dict.fromkeys(found))


def write_token_file(token: str) -> Path:
    """A 0600 file holding the admin token of a server whose port is not known yet (`swarm serve --port 0`),
    named by this process's pid. -> its path, for `remove_server_files`."""
    path = pid_dir() / "servers" / f"pid-{os.getpid()}.token"
    _write_private(path, token)
    return path


def remove_server_files(paths: list[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


def read_server_file(path: Path) -> tuple[str, str]:
    """(url, admin token) from a server file, or from a run folder holding one."""
    path = path / SERVER_FILE if path.is_dir() else path
    try:
        info = json.loads(path.read_text())
        return info["url"], Path(info["admin_token_file"]).read_text().strip()
    except (OSError, ValueError, KeyError) as e:
        raise ServerFileError(f"{path}: not a readable server file ({type(e).__name__}: {e}); is the run still "
                        "going?") from None


def resolve_server(server: str, admin_token: str | None) -> tuple[str, str]:
    """The URL and admin token a swap uses: a server file or run folder gives both; for a URL the token is
    --admin-token, else $SWARMRL_ADMIN_TOKEN, else the local index entry of a server on this machine."""
    if not server.startswith(("http://", "https://")):
        url, token = read_server_file(Path(server))
        return url, admin_token or token
    token = admin_token or os.environ.get(ADMIN_TOKEN_ENV, "")
    entry = pid_dir() / "servers" / f"{urlparse(server).port}.json"
    if not token and entry.is_file():
        url, found = read_server_file(entry)
        if url.rstrip("/") == server.rstrip("/"):
            token = found
    if not token:
        raise ServerFileError(f"swap needs the admin token of {server}: give --admin-token, set ${ADMIN_TOKEN_ENV}, or pass "
                        f"the run's server file (--server <run folder>/{SERVER_FILE})")
    return server.rstrip("/"), token


# -- pid files --------------------------------------------------------------------------------------


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
