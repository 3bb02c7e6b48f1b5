"""This user's swarmrl state on this machine: the state folder, the runtime folder for sockets, and the token files of every server it knows.

Foundation: the server (its files), the clients (pid files), containment (what to mask) and `swarm warm`
(its socket) all find their places here. It writes one private file at a time and starts nothing;
what a server file holds is `core.run.server_files`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from urllib.parse import urlparse


PID_DIR_ENV = "SWARMRL_STATE"  # where clients leave pid files, swap its clients' logs, servers their files


SERVER_FILE = "server.json"  # in a `swarm run` folder: {url, admin_token_file, pid, host, started, run_folder}


def pid_dir() -> Path:
    return Path(os.environ.get(PID_DIR_ENV, Path.home() / ".cache" / "swarmrl" / "clients"))


def write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read (0600 from its creation, not chmod after)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


def runtime_dir() -> Path:
    """This user's folder for sockets (`swarm warm`'s): `$XDG_RUNTIME_DIR/swarmrl` (a per-user tmpfs only
    its owner enters), else `<pid_dir>/../run`; created 0700 by whoever makes a socket there
    (`core.run.warm_peer.private_folder`), never a fixed world-writable path such as /tmp."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    return Path(base) / "swarmrl" if base else pid_dir().parent / "run"


def token_files(run_folder: Path | None = None) -> list[Path]:
    """What a contained process must not see (`core.contain.contained` masks it under bubblewrap), all of it
    readable by this user: the index of this machine's servers (every live server's token and server file,
    `swarm serve`'s too), the admin token and server.json of every run that index names (a sibling run's,
    with which code could pause or shut it down), those of `run_folder` (the caller's own run), and the
    runtime folder holding `swarm warm`'s socket. A run started after the contained process is not in
    this list; it cannot reach that run's server anyway (its network namespace, `core.contain.forwarder`)."""
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


def local_admin_token(url: str) -> str | None:
    """The admin token of the server at `url` when this machine's index lists it (`swarm run`, `swarm serve`
    write it there), for a person's own `swarm client`; None otherwise. A contained process never finds
    it: the index is among `token_files`."""
    port = urlparse(url).port
    entry = pid_dir() / "servers" / f"{port}.json"
    try:
        info = json.loads(entry.read_text())
        if info["url"].rstrip("/") != url.rstrip("/"):
            return None
        return Path(info["admin_token_file"]).read_text().strip() or None
    except (OSError, ValueError, KeyError, TypeError):
        return None
