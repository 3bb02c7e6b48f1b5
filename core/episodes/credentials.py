"""Client credentials: a client is who the server says it is, not what its open request claims.

A run (`core.run.loop` for its isolated and in-process clients) and `swarm swap` issue each client
process a credential when they launch it: a random secret (`swg-...`), registered with the server
beforehand (in process, or through `POST /swarm/v1/admin/credentials` with the admin token) and handed to
the client in `SWARMRL_CLIENT_GRANT`, which it sends as the `X-Swarm-Grant` header on the swarm routes.
The server binds to it a `ClientGrant`: what the run config or the swap says (sandbox, code version,
kind, split, group size, concurrency, task-order seed, models).

Who calls (`Caller`) is one of: a person (the admin token), a client (a known credential), or
anonymous. The rules (`bind_open`, `bind_registration`):

- an open with a credential takes its grant's values; one that states another sandbox (`undeclared_sandbox`),
  code version, kind, split or group size is a 403 naming the field, and so is a client id that another
  credential registered (an agent posing as an A/B's other side);
- `kind: debug` needs a person's key: the admin token, or a debug credential (a grant of kind debug,
  which only a person's config or the admin route makes); a train or eval client's credential never;
- a server that takes no anonymous use (`server.allow_anonymous` false, as every training server) takes
  no anonymous opens or registrations (401); a person's `swarm serve` without a trainer still does;
- a registration made with a credential must say what its grant says (403 naming the field).

The variable's name is deliberately not one `core.config_io.is_secret` matches: this is the client's own
credential, the one a contained client is given, bound to what its run declared; the run's credentials
(the admin token) never reach it. This module decides who may open what; it opens nothing (the opener,
`core.episodes.opener`) and speaks no HTTP (the routes read the headers).
"""

from __future__ import annotations

import hashlib
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from core.episodes.auth import same_secret
from core.episodes.errors import Refusal
from core.episodes.wire import ClientGrant, OpenEpisode, RegisterClient

GRANT_HEADER = "x-swarm-grant"  # the header a client sends its credential in (bearer stays the episode's key)
ADMIN_HEADER = "x-admin-token"  # the admin token beside a bearer key (a person's own client), or instead of one
GRANT_ENV = "SWARMRL_CLIENT_GRANT"  # the environment variable a launched client finds its credential in
PREFIX = "swg-"
SECRET_BYTES = 24  # 192 random bits: as hard to guess as an episode key
ID_CHARS = 12  # a credential's public id: a hash prefix, safe in logs and on registrations
# The open's fields a grant binds, as (open field, grant field).
OPEN_BINDS = (("sandbox", "sandbox"), ("client_version", "version"), ("kind", "kind"), ("split", "split"),
              ("group_size", "group_size"))
REGISTRATION_BINDS = ("sandbox", "version", "kind", "split", "group_size", "concurrency", "seed")
PERSON_ONLY = "debug episodes need a person's key (the admin token or a debug credential), never a client's"


@dataclass(frozen=True)
class Caller:
    """Who sent a request: a person (the admin token), a client (its credential's grant) or anonymous."""

    who: Literal["admin", "client", "anonymous"]
    grant: ClientGrant | None = None
    credential_id: str = ""  # the client's credential's public id ("" for the others)


def credential_id(secret: str) -> str:
    """The public id of a credential: who registered a client, without the secret."""
    return hashlib.sha256(secret.encode()).hexdigest()[:ID_CHARS]


class Credentials:
    """The server's issued credentials and their grants."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._grants: dict[str, ClientGrant] = {}  # secret -> its grant

    def issue(self, grant: ClientGrant) -> str:
        """A new credential bound to `grant`; the secret goes to one client process only."""
        secret = PREFIX + secrets.token_urlsafe(SECRET_BYTES)
        with self._lock:
            self._grants[secret] = grant
        return secret

    def count(self) -> int:
        with self._lock:
            return len(self._grants)

    def caller(self, grant_header: str, admin_token: str, *tokens: str) -> Caller:
        """Who a request is: the admin token (`tokens`: its bearer and `x-admin-token`), else the `X-Swarm-Grant`
        credential (401 when it is not one this server issued), else anonymous."""
        if any(same_secret(t, admin_token) for t in tokens if t):
            return Caller("admin")
        if not grant_header:
            return Caller("anonymous")
        with self._lock:
            found = next((g for s, g in self._grants.items() if same_secret(grant_header, s)), None)
        if found is None:
            raise Refusal(401, f"{GRANT_HEADER} is not a credential this server issued", "invalid_credential")
        return Caller("client", found, credential_id(grant_header))

    def bind_open(self, caller: Caller, body: OpenEpisode, anonymous_allowed: bool,
                  owner_of: Callable[[str], str | None]) -> OpenEpisode:
        """The open as the server will take it (the grant's values for a client), or the refusal."""
        if caller.who == "admin":
            return body
        if caller.who == "anonymous":
            if not anonymous_allowed:
                raise Refusal(401, "this server takes no anonymous opens: a client opens with the credential its "
                              f"run or `swarm swap` gave it ({GRANT_ENV}, sent as {GRANT_HEADER}); a person uses the "
                              "admin token", "credential_required")
            return body
        grant = caller.grant
        stated = body.model_fields_set
        if body.kind == "debug" and grant.kind != "debug":
            raise Refusal(403, PERSON_ONLY, "debug_needs_person", param="kind")
        if "sandbox" in stated and body.sandbox != grant.sandbox:
            raise Refusal(403, f"sandbox {body.sandbox!r} is not declared for this client: its run declares "
                          f"{grant.sandbox!r}", "undeclared_sandbox", param="sandbox")
        for field, bound in OPEN_BINDS:
            value = getattr(body, field)
            if field in stated and value is not None and value != getattr(grant, bound):
                raise Refusal(403, f"{field} {value!r} is not this client's: its credential binds "
                              f"{getattr(grant, bound)!r}", "credential_mismatch", param=field)
        owner = owner_of(body.client_id) if body.client_id else None
        if owner is not None and owner != caller.credential_id:
            raise Refusal(403, f"client id {body.client_id!r} is registered by another client", "client_id_taken",
                          param="client_id")
        return body.model_copy(update={"sandbox": grant.sandbox, "client_version": grant.version,
                                       "kind": grant.kind, "split": grant.split, "group_size": grant.group_size})

    def bind_registration(self, caller: Caller, req: RegisterClient, anonymous_allowed: bool) -> None:
        """A registration a client's credential makes must say what its grant says (403 naming the field)."""
        if caller.who == "anonymous" and not anonymous_allowed:
            raise Refusal(401, "this server takes no anonymous registrations: register with the credential "
                          f"your run gave you ({GRANT_HEADER})", "credential_required")
        if caller.who != "client":
            return
        for field in REGISTRATION_BINDS:
            if getattr(req, field) != getattr(caller.grant, field):
                raise Refusal(403, f"{field} {getattr(req, field)!r} is not this client's: its credential binds "
                              f"{getattr(caller.grant, field)!r}", "credential_mismatch", param=field)
