"""The server's table of registered client processes: who serves which sandbox at which code version.

A `swarm client` registers when it starts (client id, sandbox, version, pid, host, kind, group
size) and sends the same registration again as its heartbeat; the answer carries the drain order.
`swarm swap` reads the table through `/swarm/v1/status` (the old client's kind and group size,
and the moment its successor has registered) and drains the old clients through
`/swarm/v1/admin/drain`, so a swap needs nothing local about the old client: it may run on another
machine. A drain order sticks to the client id until the client leaves or falls silent for
`CLIENT_TTL_S`. Each drain that names a successor is one `SwapRecord`; the run loop tags it on
its MLflow run (`on_swap`). An A/B order (`DrainClients.ab`, `swarm swap --ab`) is recorded the same
way (`SwapRecord.ab`) but drains nobody: the old clients keep serving beside their successor, and
the loser drains later by an ordinary order naming the winner.

While an A/B is open (from its order until the loser's drain, or until either side is gone) the table
names each client's part in it (`ab_role`): the old version's clients lead, the successor follows, and
the episode opener (`core.episodes.opener`) pairs their tasks through the registry's `TaskPairing`: each
train task a leader opens is owed to the follower, which opens only those. When an A/B ends the table
calls `on_ab_end(sandbox)` (the server passes the pairing's `close`), so nothing stays owed.

This module keeps the books only: it never signals a process and does not run episodes.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from core.episodes.auth import same_secret
from core.episodes.errors import Refusal
from core.episodes.wire import ClientOrders, DrainClients, RegisterClient, SwapRecord

# How often a client sends its registration again. A drain order reaches it within this, so a
# swap's old client stops opening episodes about this long after its successor took over.
CLIENT_HEARTBEAT_S = 1.0
# A client silent this long is dropped from the table (SIGKILLed, or its machine gone): a few
# missed heartbeats, so a client paused by a slow machine is not dropped while it still serves.
CLIENT_TTL_S = 15.0


@dataclass
class Registration:
    info: RegisterClient
    key: str
    registered_at: float
    last_seen: float
    draining: bool = False
    owner: str = ""  # the public id of the credential that registered it ("" without one: `core.episodes.credentials`)

    def view(self, now: float) -> dict:
        return {**self.info.model_dump(), "state": "draining" if self.draining else "serving",
                "registered_at": self.registered_at, "last_seen_s": round(now - self.last_seen, 3)}


@dataclass
class ClientTable:
    clock: Callable[[], float] = time.time
    on_swap: Callable[[SwapRecord], None] | None = None  # the run loop tags the swap on its MLflow run
    swaps: list[SwapRecord] = field(default_factory=list)
    on_ab_end: Callable[[str], None] | None = None  # an A/B of this sandbox ended: its owed tasks are void
    _ab: dict[str, SwapRecord] = field(default_factory=dict)  # sandbox -> its open A/B's start
    _clients: dict[str, Registration] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def register(self, req: RegisterClient, key: str, owner: str = "") -> ClientOrders:
        """A registration or its heartbeat. A known id needs its key (401); an unknown one is new (the
        server restarted, or the client fell silent past the TTL) and gets a fresh key. `owner`: the public
        id of the credential it registers with (its opens' client id is then its own)."""
        with self._lock:
            now = self.clock()
            self._forget_silent(now)
            reg = self._clients.get(req.client_id)
            if reg is None:
                reg = Registration(req, "swc-" + secrets.token_urlsafe(18), now, now, owner=owner)
                self._clients[req.client_id] = reg
            elif not same_secret(key, reg.key):
                raise Refusal(401, f"client {req.client_id} is registered: its heartbeat needs the key it got",
                                  "invalid_client_key")
            reg.info, reg.last_seen = req, now  # the version may change only by restarting; we report what it says
            return ClientOrders(client_id=req.client_id, key=reg.key, drain=reg.draining,
                                heartbeat_s=CLIENT_HEARTBEAT_S)

    def leave(self, client_id: str, key: str) -> None:
        with self._lock:
            reg = self._clients.get(client_id)
            if reg is None:
                return
            if not same_secret(key, reg.key):
                raise Refusal(401, f"client {client_id} can only be removed with its key", "invalid_client_key")
            del self._clients[client_id]

    def drain(self, order: DrainClients) -> SwapRecord | None:
        """Mark the named clients of `order.sandbox` draining; a swap record when a successor is named.

        Every named id must be a registered client of that sandbox (404 otherwise, nothing marked), and
        the successor a registered, serving one: a swap never drains the only client for nothing. With
        `order.ab` nobody is marked: the record starts an A/B, the named clients serving beside the successor."""
        with self._lock:
            now = self.clock()
            self._forget_silent(now)
            targets = []
            for cid in order.client_ids:
                reg = self._clients.get(cid)
                if reg is None or reg.info.sandbox != order.sandbox:
                    raise Refusal(404, f"no registered client {cid!r} of sandbox {order.sandbox!r}",
                                      "client_not_found")
                targets.append(reg)
            if not targets:
                return None
            successor = self._clients.get(order.successor)
            if successor is None or successor.draining or successor.info.sandbox != order.sandbox:
                raise Refusal(409, f"successor {order.successor!r} is not a serving registered client of "
                                       f"sandbox {order.sandbox!r}; nothing was drained", "no_successor")
            if successor in targets:
                raise Refusal(409, "a client cannot succeed itself", "no_successor")
            if any(reg.draining for reg in targets) and order.ab:
                raise Refusal(409, "an A/B needs its old clients serving; some are draining", "draining")
            for reg in targets:
                reg.draining = reg.draining or not order.ab
            if not order.ab:  # the loser drains: the A/B is over, the winner draws its own tasks again
                self._end_ab(order.sandbox)
            record = SwapRecord(n=len(self.swaps) + 1, sandbox=order.sandbox,
                                from_versions=sorted({r.info.version for r in targets}),
                                to_version=successor.info.version, successor=order.successor,
                                to_spec=successor.info.spec, ab=order.ab,
                                drained=[] if order.ab else [r.info.client_id for r in targets], at=now)
            self.swaps.append(record)
            if order.ab:
                self._ab[order.sandbox] = record
        if self.on_swap is not None:
            self.on_swap(record)  # outside the lock: it may write to MLflow
        return record

    def ab_role(self, sandbox: str, client_id: str) -> Literal["leader", "follower"] | None:
        """`client_id`'s part in `sandbox`'s open A/B: the old version's serving clients lead, the successor
        follows; None outside an A/B. An A/B one of whose sides is gone (left, silent or draining) ends here."""
        with self._lock:
            record = self._ab.get(sandbox)
            if record is None:
                return None
            self._forget_silent(self.clock())
            follower = self._clients.get(record.successor)
            leaders = {cid for cid, r in self._clients.items() if r.info.sandbox == sandbox and not r.draining
                       and r.info.version in record.from_versions and cid != record.successor}
            if follower is None or follower.draining or not leaders:
                self._end_ab(sandbox)
                return None
            return "follower" if client_id == record.successor else "leader" if client_id in leaders else None

    def ab_open(self) -> dict[str, int]:
        """Sandbox -> the swap number of its open A/B."""
        with self._lock:
            return {s: r.n for s, r in self._ab.items()}

    def _end_ab(self, sandbox: str) -> None:
        if self._ab.pop(sandbox, None) is not None:
            if self.on_ab_end is not None:
                self.on_ab_end(sandbox)

    def drain_all(self) -> int:
        """Tell every registered client to drain (the run is ending); -> how many."""
        with self._lock:
            for reg in self._clients.values():
                reg.draining = True
            return len(self._clients)

    def count(self) -> int:
        with self._lock:
            self._forget_silent(self.clock())
            return len(self._clients)

    def owner_of(self, client_id: str) -> str | None:
        """The credential id that registered `client_id` (None: not registered, or registered without one)."""
        with self._lock:
            reg = self._clients.get(client_id)
            return reg.owner or None if reg is not None else None

    def listing(self, owner: str | None = None) -> list[dict]:
        """Every registration, or only those `owner` (a credential id) made: a client sees its own only."""
        with self._lock:
            now = self.clock()
            self._forget_silent(now)
            return [r.view(now) for r in sorted(self._clients.values(), key=lambda r: r.registered_at)
                    if owner is None or r.owner == owner]

    def _forget_silent(self, now: float) -> None:
        for cid in [c for c, r in self._clients.items() if now - r.last_seen > CLIENT_TTL_S]:
            del self._clients[cid]
