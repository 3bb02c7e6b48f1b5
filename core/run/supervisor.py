"""A run's isolated clients, kept alive: started as processes, restarted when they die, given up on when they keep dying.

In a swarm clients crash and the run goes on. `swarm run` starts each `clients[].isolate: true`
client as its own process (`swarm client`); when one dies (a non-zero exit, or a signal such as
SIGKILL or the OOM killer) it is started again after `core.clients.retries.backoff_delay`. A death counts
against the client when the process finished no episode in its life (the registry's per-client
record) and was not SIGKILLed: a client that did work, or that someone killed from outside (an
operator, the OOM killer, the chaos bench), is simply restarted, while one that crashes before its
first episode (an import error, a segfault, a sandbox that always raises, a `swarm client` that gave
up) ends the run with a clear error after MAX_DEATHS such deaths in a row, naming the client, how it
died and its last lines of output. A client that exits 0 is done (its episode budget is spent) and
is not restarted.

With `containment.clients` auto or required each client starts through `core.contain.contained`:
an environment allowlist (the run's credentials never reach agent code), resource limits, its own
process group (SIGTERM to drain and the final SIGKILL reach the whole group), bubblewrap with only
its working folder writable. That is one wrapper process per client start, nothing per episode.

Episodes a dead client left open are not this module's concern: they expire by lease on the server
and are never trained. It deliberately does not run agents (`core.clients.runner`) or in-process clients.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from core.contain.contained import CLIENT_ENV, Contained, die_with_parent, popen_contained
from core.clients.retries import backoff_delay
from core.config import ContainmentConfig

log = logging.getLogger(__name__)

# Deaths in a row without a finished episode before the run gives up on a client: enough to ride out
# a few unlucky kills during start-up, few enough that a broken sandbox fails the run within a minute.
MAX_DEATHS = 5
POLL_S = 0.2  # how often the supervisor looks at its processes
TAIL_LINES = 5  # a dead client's last output lines, quoted in the give-up error


@dataclass
class ClientProcess:
    name: str  # the agent spec, as the config names it
    cmd: list[str]
    workdir: Path | None = None  # its working folder: the one folder a contained client may write
    reads: list[Path] = field(default_factory=list)  # folders a contained client reads (its sandbox's), bound read-only
    server: str | None = None  # the swarm server a contained client may reach (its only network under bwrap)
    env: dict[str, str] = field(default_factory=dict)  # set for it alone: its client credential (`SWARMRL_CLIENT_GRANT`)
    proc: subprocess.Popen | None = None
    contained: Contained | None = None  # set when it runs contained: its group, scratch HOME, cgroup
    started: float = 0.0
    deaths: int = 0  # in a row without a finished episode (SIGKILLs from outside not counted)
    restart_at: float | None = None  # when a dead client starts again
    done: bool = False  # exited 0: its work is done
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))


class Supervisor:
    def __init__(self, finished_by: Callable[[], dict[str, int]], on_give_up: Callable[[str], None],
                 containment: ContainmentConfig | None = None, hidden: Sequence[Path] = ()):
        self.finished_by = finished_by  # the registry's finished episodes per client id (ids end in `-<pid>`)
        self.on_give_up = on_give_up
        self.containment = containment or ContainmentConfig()
        self.hidden = list(hidden)  # masked from contained clients (the admin token files)
        self.clients: list[ClientProcess] = []
        self.restarts = 0
        self._lock = threading.Lock()
        self._stopping = threading.Event()  # no more restarts
        # The watcher thread ends only after the stop's drain: clients it restarted die with it (PDEATHSIG).
        self._ended = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, name: str, cmd: list[str], workdir: Path | None = None, reads: list[Path] = (),
              server: str | None = None, env: dict[str, str] | None = None) -> None:
        """Start and look after a client; `workdir` (created) is where it runs and, contained, all it may
        write; `reads`: what it must read (its sandbox folder), visible even under /tmp (`contain.wrap`);
        `server`: the URL on its command line, which a contained one reaches through its forwarder only;
        `env`: variables for it alone (its client credential, the same for each restart)."""
        client = ClientProcess(name, cmd, workdir, list(reads), server, env=dict(env or {}))
        with self._lock:
            self._spawn(client)
            self.clients.append(client)
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="client-supervisor", daemon=True)
            self._thread.start()

    def pids(self) -> list[int]:
        """Pids of the client processes running now."""
        with self._lock:
            return [c.proc.pid for c in self.clients if c.proc is not None and c.proc.poll() is None]

    def stop(self, drain_s: float) -> None:
        """SIGTERM every client (each drains its episodes), wait up to `drain_s`, then kill what is left."""
        with self._lock:  # a restart under way finishes first; none starts after this
            self._stopping.set()
            clients = [c for c in self.clients if c.proc is not None]
        for c in clients:
            if c.proc.poll() is None:
                _signal(c, signal.SIGTERM)
        deadline = time.monotonic() + drain_s
        for c in clients:
            try:
                c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal(c, signal.SIGKILL)
                c.proc.wait()
            if c.contained is not None:
                c.contained.close()
        self._ended.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _spawn(self, client: ClientProcess) -> None:
        if client.contained is not None:  # a restart: what the dead one left (group, scratch HOME) goes first
            client.contained.close()
            client.contained = None
        if client.workdir is not None:
            client.workdir.mkdir(parents=True, exist_ok=True)
        if self.containment.clients == "off":
            client.proc = subprocess.Popen(client.cmd, stderr=subprocess.PIPE, text=True, errors="replace",
                                           env={**os.environ, **client.env}, preexec_fn=die_with_parent(signal.SIGTERM))
        else:
            cwd = client.workdir or Path.cwd()
            client.contained = popen_contained(
                client.cmd, cwd, writable=[cwd], readable=client.reads, limits=self.containment.limits, hidden=self.hidden,
                server=client.server,
                extra_env={**{k: os.environ[k] for k in CLIENT_ENV if k in os.environ}, **client.env},
                stderr=subprocess.PIPE, text=True, errors="replace")
            client.proc = client.contained.proc
        client.started, client.restart_at = time.monotonic(), None
        threading.Thread(target=_relay, args=(client.proc, client.tail), daemon=True,
                         name=f"client-{client.proc.pid}-stderr").start()

    def _watch(self) -> None:
        while not self._ended.wait(POLL_S):
            with self._lock:
                for client in self.clients:
                    if not self._stopping.is_set():
                        self._look_after(client)

    def _look_after(self, client: ClientProcess) -> None:
        now = time.monotonic()
        if client.done:
            return
        if client.restart_at is not None:
            if now >= client.restart_at:
                self._spawn(client)
                self.restarts += 1
                log.info("client %s restarted as pid %d", client.name, client.proc.pid)
            return
        code = client.proc.poll()
        if code is None:
            return
        if code == 0:
            client.done = True
            log.info("client %s (pid %d) finished its work", client.name, client.proc.pid)
            return
        pid = client.proc.pid
        worked = sum(n for cid, n in self.finished_by().items() if cid.endswith(f"-{pid}"))
        if worked:
            client.deaths = 0
        elif code != -signal.SIGKILL:  # killed from outside is not the client's own failure (module docstring)
            client.deaths += 1
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        lived = now - client.started
        if client.deaths >= MAX_DEATHS:
            client.done = True
            last = " | ".join(line.strip() for line in client.tail) or "(no output)"
            self.on_give_up(f"client {client.name} died {client.deaths} times in a row without finishing an episode "
                            f"(last: {how} after {lived:.0f}s); its last output: {last}")
            return
        delay = backoff_delay(client.deaths)  # a client killed while healthy comes back at once
        client.restart_at = now + delay
        log.warning("client %s (pid %d) died (%s) after %.0fs having finished %d episode(s); restarting in %.1fs",
                    client.name, pid, how, lived, worked, delay)


def _signal(client: ClientProcess, sig: int) -> None:
    """`sig` to a client: to its whole process group when contained (under bwrap the command is not bwrap's
    own process, and bwrap passes no signal on), else to its process."""
    if client.contained is not None:
        client.contained.signal(sig)
    else:
        client.proc.send_signal(sig)


def _relay(proc: subprocess.Popen, tail: deque[str]) -> None:
    """Pass a client's stderr through to ours, keeping its last lines for the give-up error."""
    for line in proc.stderr:
        tail.append(line)
        sys.stderr.write(line)
    proc.stderr.close()
