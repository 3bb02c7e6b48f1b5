"""`swarm swap`: replace the running clients of a sandbox with new code, through the server.

Hot swap (DESIGN §3.7), all through the server's client table (`core.episodes.client_table`), so the old client
may run on another machine and nothing local about it is needed:

    read /status: the sandbox's serving clients, their kind, group size and concurrency
    check the admin token (a drain of no clients), so a wrong token starts nothing
    start the new code's client (same kind and group size) and wait until it has registered and
        finished its first episode; if it exits or cannot within the timeout, it is stopped, the
        old clients keep serving, and swap fails
    ask the server to drain the old clients (/admin/drain, admin token, naming the successor); the
        server records the swap (the run tags it on MLflow) and each old client, at its next
        heartbeat, opens nothing new, finishes its in-flight episodes and exits
    wait (bounded) until the old clients have left the table

`swap(..., ab=True)` (`swarm swap --ab`) is an A/B inside the live run: the new client starts with the
old clients' kind, group size, seed, split, task budget and episode timeout (every swap does: `inherited`)
and, by default, their summed concurrency; the server records the swap (`SwapRecord.ab`), drains nobody,
and pairs the versions (`core.episodes.pairing`): the new client runs each task the old ones open.
`drain_version` (`swarm swap SANDBOX --drain-version V`) ends it: the clients of version V drain, a
serving client of another version named as their successor (nothing of V left: nothing to do, exit 0).

`swap` signals only the client it started itself, and only when the swap fails after starting it.

`contain` (`swarm swap --contain auto|required`) starts the new client as `swarm run` starts its contained
ones (`core.contain.contained`, docs/security.md): no credential in its environment, resource limits, under
bubblewrap only `$SWARMRL_STATE/<client id>/` (its working folder and HOME) writable. It is detached:
the server's drain ends it, not this command's exit. A study swaps proposal code in this way.

The server and pid files through which tools find a server and local clients are
`core.run.server_files`. This module does not run episodes.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from core.contain.contained import CLIENT_ENV, Contained, popen_contained, require_bwrap
from core.clients.retries import SwarmError
from core.clients.sdk import SwarmClient
from core.clients.sandbox import load_agent
from core.episodes.credentials import GRANT_ENV
from core.episodes.wire import ClientGrant
from core.sandbox.folder import locate, safe_name
from core.local_state import pid_dir, token_files
from core.run.client_command import ClientSpec
from core.run.server_files import resolve_server
from core.contain.venvs import client_python
from core.config import ContainMode, ContainmentConfig

log = logging.getLogger(__name__)

# Before the old clients are told to drain, the new one must have finished this many episodes (new
# code that registers but fails every rollout never replaces working code) and then still be alive
# this long later.
PROOF_EPISODES = 1
# A new client that has failed this many episodes and finished none is given up on at once: broken
# code shows in its first few episodes, and waiting out the timeout would only delay the verdict.
GIVE_UP_FAILURES = 3
SWAP_SETTLE_S = 1.0
# How long the new client may take to start, register and finish its first episode (imports, the
# sandbox, a generation): generous, because a busy machine is slow, and nothing is lost by waiting.
REGISTER_TIMEOUT_S = 180.0
# How long swap waits for the drained clients to leave: their drain is bounded by one lease (60 s by
# default) plus a heartbeat; past this swap still succeeds, and says who is still draining.
DRAIN_WAIT_S = 90.0
POLL_S = 0.25
EXIT_FAILED, EXIT_REFUSED = 1, 2  # the new client failed; nothing was started (bad input, token, no client)


class SwapError(RuntimeError):
    """A swap that cannot go ahead; the message is the one line a person reads."""


# -- the swap ---------------------------------------------------------------------------------------


class _Admin:
    """The swarm routes a swap calls; admin ones carry the token."""

    def __init__(self, url: str, token: str):
        self.http, self.token = SwarmClient(url, deadline_s=30.0, unreachable_s=10.0), token

    def clients(self, sandbox: str) -> list[dict]:
        """The sandbox's registered clients (other clients' ids and versions: the admin token's to read)."""
        status = self.http.call("GET", "/status", key=self.token)
        return [c for c in status.get("clients", []) if c["sandbox"] == sandbox]

    def credential(self, grant: ClientGrant) -> str:
        """A client credential bound to `grant`, for the client this swap starts (`core.episodes.credentials`)."""
        return self.http.call("POST", "/admin/credentials", grant.model_dump(), key=self.token)["credential"]

    def drain(self, sandbox: str, ids: list[str], successor: str = "", ab: bool = False) -> dict | None:
        try:
            order = {"sandbox": sandbox, "client_ids": ids, "successor": successor, "ab": ab}
            return self.http.call("POST", "/admin/drain", order, key=self.token)
        except SwarmError as e:
            if e.status == 401:
                raise SwapError(f"the server at {self.http.url} refused the admin token (401); nothing was "
                                "drained") from None
            raise


@dataclass
class _NewClient:
    client_id: str
    proc: subprocess.Popen
    log_path: Path
    contained: Contained | None = None  # started contained: its group is signalled, not bwrap alone

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """SIGTERM the client this swap started (the only process swap ever signals)."""
        if self.proc.poll() is None:
            if self.contained is not None:
                self.contained.signal(signal.SIGTERM)
            else:
                self.proc.terminate()


# Loads a sandbox in its own interpreter (its venv, when it declares requirements) and prints its name and version.
_PROBE = ("import json, sys; from core.clients.sandbox import load_agent; a = load_agent(sys.argv[1]); "
          "print(json.dumps([a.name, a.version]))")
PROBE_TIMEOUT_S = 300.0  # a first use builds the sandbox's venv


def _probe(spec: str, python: str) -> tuple[str, str]:
    """(name, version) of the new code, loaded where its client will run; ValueError when it does not load."""
    if python == sys.executable:
        agent = load_agent(spec)
        return agent.name, agent.version
    try:
        out = subprocess.run([python, "-c", _PROBE, spec], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ValueError(f"{spec} could not be loaded with {python}: {e}") from None
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ValueError(f"{spec} does not load in its environment ({python}): {last}")
    name, version = json.loads(out.stdout.strip().splitlines()[-1])
    return name, version


def _start(spec: str, python: str, url: str, name: str, version: str, old: dict, concurrency: int | None,
           credential: str, contain: ContainMode = "off", run_folder: Path | None = None) -> _NewClient:
    client_id = f"{name}-{socket.gethostname()}-swap-{secrets.token_hex(3)}"
    client = ClientSpec(python, spec, url, client_id=client_id, concurrency=concurrency or old["concurrency"],
                        group_size=old["group_size"], kind=old["kind"], code_version=version, **inherited(old))
    log_path = pid_dir() / f"{safe_name(client_id)}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log_file:  # the new client outlives this command: it must not hold our stdout
        if contain == "off":
            proc = subprocess.Popen(client.to_argv(), start_new_session=True, stdout=log_file,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={**os.environ, GRANT_ENV: credential})
            return _NewClient(client_id, proc, log_path)
        workdir = log_path.with_suffix("")  # beside its log: what it may write, and its HOME
        workdir.mkdir(exist_ok=True)
        folder = [Path(spec).resolve()] if Path(spec).is_dir() else []  # read from there (under /tmp too)
        if folder:  # it starts in its working folder, where a relative path would not lead
            client = replace(client, sandbox=str(folder[0]))
        started = popen_contained(client.to_argv(), workdir, writable=[workdir], readable=folder, detached=True,
                                  scratch=workdir / ".home", limits=ContainmentConfig().limits,
                                  hidden=token_files(run_folder), server=url,
                                  extra_env={**{k: os.environ[k] for k in CLIENT_ENV if k in os.environ},
                                             GRANT_ENV: credential},
                                  stdout=log_file, stderr=subprocess.STDOUT)
    return _NewClient(client_id, started.proc, log_path, started)


def inherited(old: dict) -> dict:
    """The `ClientSpec` fields that give the new client the old one's task settings (its registration, as
    `/status` lists it): split, seed, task budget and episode timeout, so the two differ only in code."""
    return {"split": old.get("split") or "train", "seed": old.get("seed"), "tasks": old.get("tasks"),
            "episode_timeout": old.get("episode_timeout")}


def _run_folder(server: str) -> Path | None:
    """The run folder `server` names (a folder, or its server.json), whose admin token file a contained
    client must not read; None for a URL."""
    path = Path(server)
    return path if path.is_dir() else path.parent if path.is_file() else None


def _until(predicate, timeout_s: float, new: _NewClient | None = None) -> bool:
    """Poll `predicate` until true (-> True) or timeout (-> False); fails fast when `new` has exited."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if new is not None and new.proc.poll() is not None:
            raise SwapError(f"the new client exited with code {new.proc.returncode} before taking over")
        if predicate():
            return True
        time.sleep(POLL_S)
    return predicate()


def _proven(clients: list[dict], client_id: str) -> bool:
    """Whether the new client has finished its first episode; SwapError when it only fails."""
    mine = next((c for c in clients if c["client_id"] == client_id), None)
    if mine is None:
        return False
    if mine.get("finished", 0) >= PROOF_EPISODES:
        return True
    if mine["failed"] >= GIVE_UP_FAILURES:
        raise SwapError(f"the new client failed {mine['failed']} episodes and finished none")
    return False


def swap(spec: str, server: str, *, concurrency: int | None = None, admin_token: str | None = None,
         settle_s: float = SWAP_SETTLE_S, register_timeout_s: float = REGISTER_TIMEOUT_S,
         drain_wait_s: float = DRAIN_WAIT_S, ab: bool = False, contain: ContainMode = "off") -> int:
    """Hot swap (with `ab`, an A/B start that drains nobody; `contain`: the new client runs contained); -> the
    exit code (0 swapped, 1 the new client failed, 2 refused before starting anything)."""
    try:
        require_bwrap(contain, "swarm swap --contain")
        url, token = resolve_server(server, admin_token)
        spec = locate(spec)  # sandbox:NAME -> its folder, so the new client runs the same code wherever it starts
        python = client_python(spec)  # the sandbox's own venv when it declares requirements (built once)
        name, version = _probe(spec, python)  # fail before touching the running client if the new code does not load
    except (SwapError, ValueError, RuntimeError, OSError) as e:  # a ConfigError (no bwrap) is a ValueError
        log.error("swap refused: %s; the running client is left alone", e)
        return EXIT_REFUSED
    admin = _Admin(url, token)
    new: _NewClient | None = None
    try:
        # The token first: other clients are listed to the admin token only, so a wrong one would read as "no client".
        admin.drain(name, [])  # a drain of no clients: a wrong token must not leave two clients running
        old = [c for c in admin.clients(name) if c["state"] == "serving"]
        if not old:
            raise SwapError(f"no client of sandbox {name!r} is registered at {url}: start one (`swarm client`, "
                            "or a run config client) before swapping it")
        if len({(c["kind"], c["group_size"]) for c in old}) > 1:
            log.warning("the clients of %s differ in kind or group size; the new one takes %s's", name,
                        old[0]["client_id"])
        if ab and concurrency is None:  # as many episodes in flight as all the old clients: a 50/50 split
            concurrency = sum(c["concurrency"] for c in old)
        # The new client's credential binds what the old one's registration says, with the new code's version.
        first = old[0]
        credential = admin.credential(ClientGrant(
            sandbox=name, version=version, kind=first["kind"], split=first.get("split", "train"),
            group_size=first["group_size"], concurrency=concurrency or first["concurrency"], seed=first.get("seed")))
        new = _start(spec, python, url, name, version, first, concurrency, credential, contain, _run_folder(server))
        log.info("started the new client %s (pid %d, version %s); waiting for it to register", new.client_id,
                 new.proc.pid, version)
        if not _until(lambda: _proven(admin.clients(name), new.client_id), register_timeout_s, new):
            raise SwapError(f"the new client did not register and finish an episode within {register_timeout_s:.0f}s")
        _until(lambda: False, settle_s, new)  # it must survive the settle time too
        ids = [c["client_id"] for c in old]
        record = admin.drain(name, [c["client_id"] for c in admin.clients(name) if c["client_id"] in ids],
                             new.client_id, ab=ab)
    except (SwapError, SwarmError) as e:
        if new is not None:
            new.stop()
            e = SwapError(f"{e}; it was stopped and the old client keeps serving. Its log ({new.log_path}) "
                          f"ends:\n{new.tail()}")
        log.error("swap failed: %s", e)
        return EXIT_REFUSED if new is None else EXIT_FAILED
    drained = record["drained"] if record else []
    if ab:
        print(f"A/B in {name}: {', '.join(record['from_versions']) if record else '-'} keep serving beside {version}; "
              f"new client {new.client_id} (pid {new.proc.pid}, log {new.log_path}); swap {record['n'] if record else '-'}",
              flush=True)
        return 0
    print(f"swapped {name}: {', '.join(record['from_versions']) if record else '-'} -> {version}; new "
          f"client {new.client_id} (pid {new.proc.pid}, log {new.log_path}); draining {len(drained)} old client(s)",
          flush=True)
    left = _until(lambda: not {c["client_id"] for c in admin.clients(name)} & set(drained), drain_wait_s)
    if not left:
        log.warning("old client(s) still draining after %.0fs: %s", drain_wait_s, drained)
    return 0


def drain_version(sandbox: str, server: str, version: str, *, admin_token: str | None = None,
                  drain_wait_s: float = DRAIN_WAIT_S) -> int:
    """End an A/B: drain `sandbox`'s clients of `version`, a serving client of another version their
    successor; -> the exit code (0 drained or nothing left of it, 2 refused)."""
    try:
        url, token = resolve_server(server, admin_token)
        name = load_agent(locate(sandbox)).name if Path(sandbox).is_dir() else sandbox
        admin = _Admin(url, token)
        admin.drain(name, [])  # checks the token: other clients are listed to the admin token only
        clients = admin.clients(name)
        losers = [c["client_id"] for c in clients if c["version"] == version]
        if not losers:
            print(f"nothing to drain: no client of {name} runs version {version}", flush=True)
            return 0
        winners = [c for c in clients if c["version"] != version and c["state"] == "serving"]
        if not winners:
            raise SwapError(f"no serving client of {name} runs another version than {version}: draining it would "
                            "leave the sandbox without clients")
        record = admin.drain(name, losers, winners[0]["client_id"])
    except (SwapError, SwarmError, ValueError, OSError) as e:
        log.error("drain refused: %s", e)
        return EXIT_REFUSED
    print(f"drained {name} version {version} ({len(losers)} client(s)); {winners[0]['version']} serves on; swap "
          f"{record['n'] if record else '-'}", flush=True)
    if not _until(lambda: not {c["client_id"] for c in admin.clients(name)} & set(losers), drain_wait_s):
        log.warning("client(s) still draining after %.0fs: %s", drain_wait_s, losers)
    return 0
