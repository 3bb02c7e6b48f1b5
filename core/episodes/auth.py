"""Credentials: bearer parsing, constant-time comparison, path secrets and masking for logs.

Every route that reads a credential parses it with `bearer` (episode keys on the OpenAI and swarm
routes, the admin token on admin routes), so there is one rule for what a bearer header is. The
path form `/episodes/{secret}/v1/...` authorizes by `path_secret(key)`, an HMAC of the episode key,
never by the episode id: ids appear in logs, status pages and MLflow, secrets do not. A path secret
lets a client that cannot set headers record calls; it cannot finish, abort or heartbeat the
episode, which need the key itself. This module checks credentials; it does not store them (the
registry keeps episode keys, the server the admin token).
"""

from __future__ import annotations

import hashlib
import hmac

from starlette.requests import Request

BEARER = "bearer "
# 128 bits of the HMAC: as hard to guess as the episode key (24 random bytes), short enough for a URL.
PATH_SECRET_HEX = 32
# Characters of a secret shown in logs: enough to tell two tokens apart, far too few to use one.
SHOWN_CHARS = 4


def bearer(request: Request) -> str:
    """The token of an `Authorization: Bearer <token>` header; "" when there is none."""
    auth = request.headers.get("authorization", "")
    return auth[len(BEARER):].strip() if auth.lower().startswith(BEARER) else ""


def same_secret(given: str, expected: str) -> bool:
    """Constant-time equality that also accepts non-ASCII input (an attacker's header) as unequal."""
    return bool(given) and hmac.compare_digest(given.encode(), expected.encode())


def path_secret(server_secret: bytes, key: str) -> str:
    """The path-form secret of an episode key: one-way, so a URL in a log cannot finish the episode."""
    return hmac.new(server_secret, key.encode(), hashlib.sha256).hexdigest()[:PATH_SECRET_HEX]


def masked(secret: str) -> str:
    """A secret as logs may show it: its first few characters only."""
    return secret[:SHOWN_CHARS] + "..." if secret else "(none)"  # ASCII: stdout may be a C-locale pipe
