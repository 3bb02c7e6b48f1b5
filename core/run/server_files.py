"""Server files: how tools on this machine find a running server and its admin token.

Server files: `swarm run` writes `<run folder>/server.json` (the run folder is the parent of
`trainer.checkpoint_dir`) holding the URL and the path of a 0600 file with the admin token, and both
`swarm run` and `swarm serve` leave the same under `$SWARMRL_STATE/servers/<port>.json`, so a swap
on this machine finds the token by URL; all are removed when the server stops.

Where the state folder is and which token files containment masks is `core.local_state`; a client's
pid file is `core.clients.pid_file`. It holds no policy about swapping (`core.run.hotswap`) and runs
no process.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from urllib.parse import urlparse
from core.local_state import SERVER_FILE, pid_dir, write_private


ADMIN_TOKEN_ENV = "SWARMRL_ADMIN_TOKEN"  # the admin token for `swarm swap` when the server runs elsewhere


class ServerFileError(ValueError):
    """No usable server file or admin token; the message is the one line a person reads."""


def write_server_files(url: str, token: str, run_folder: Path | None) -> list[Path]:
    """Tell tools where the server is: `<run_folder>/server.json` (when given) and the local index
    entry, each with a 0600 token file beside it. -> the files written, for `remove_server_files`."""
    port = urlparse(url).port
    targets = [(Path(run_folder) / SERVER_FILE, Path(run_folder) / "admin_token")] if run_folder else []
    targets.append((pid_dir() / "servers" / f"{port}.json", pid_dir() / "servers" / f"{port}.token"))
    written = []
    for info, token_file in targets:
        write_private(token_file, token)
        write_private(info, json.dumps({"url": url, "admin_token_file": str(token_file.resolve()),
                                         "pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                                         # so `token_files` finds (and containment masks) a run's own token
                                         "run_folder": str(Path(run_folder).resolve()) if run_folder else None}))
        written += [info, token_file]
    return written


def write_token_file(token: str) -> Path:
    """A 0600 file holding the admin token of a server whose port is not known yet (`swarm serve --port 0`),
    named by this process's pid. -> its path, for `remove_server_files`."""
    path = pid_dir() / "servers" / f"pid-{os.getpid()}.token"
    write_private(path, token)
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


