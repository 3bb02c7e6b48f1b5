"""How a call to a swarm route fails and is waited out: the SDK's errors, the one backoff schedule, one call's deadlines.

A busy server (503, with Retry-After when it says how long: paused, back-pressure) and an unreachable
one are waited out with backoff until the caller's deadline; past it the call raises `SwarmError`
(`ServerUnreachable` when it never connected). `backoff_delay` is the one backoff schedule: the
runner waits it between failed episodes and the supervisor between restarts of a client. This module
sends nothing and keeps no connection: `core.clients.sdk` makes the calls and reads `settle`'s answer.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any

import httpx

log = logging.getLogger(__name__)

RETRY_DEADLINE_S = 300.0  # how long a swarm call waits out a paused or busy server (503) before giving up
BACKOFF_START_S, BACKOFF_MAX_S = 0.2, 5.0


class SwarmError(RuntimeError):
    def __init__(self, status: int, body: Any):
        msg = body.get("error", {}).get("message") if isinstance(body, dict) else str(body)
        super().__init__(f"swarm server answered {status}: {msg}")
        self.status, self.body = status, body


class ServerUnreachable(SwarmError):
    """No connection to the swarm server for longer than the caller was willing to wait."""

    def __init__(self, url: str, waited_s: float, cause: Exception):
        RuntimeError.__init__(self, f"swarm server at {url} unreachable for {waited_s:.0f}s ({type(cause).__name__}: {cause})")
        self.status, self.body = 503, str(cause)


class ClientStopping(SwarmError):
    """The client was told to stop while it waited to open an episode: nothing was opened."""

    def __init__(self) -> None:
        super().__init__(503, "the client is stopping; no new episodes")


def backoff_delay(attempt: int, retry_after: str | None = None) -> float:
    """Seconds to wait before retry number `attempt` (0-based): the server's Retry-After when it sent one,
    else exponential from BACKOFF_START_S up to BACKOFF_MAX_S, with jitter so that clients spread out."""
    if retry_after:
        try:
            return float(retry_after)
        except ValueError:
            pass
    return min(BACKOFF_MAX_S, BACKOFF_START_S * 2 ** min(attempt, 32)) * (0.5 + random.random() / 2)


def settle(resp: httpx.Response) -> dict:
    """A swarm route's answer: its JSON body, or a `SwarmError` for a status of 400 and above."""
    if resp.status_code >= 400:
        try:
            body = resp.json()
        except ValueError:
            body = resp.text
        raise SwarmError(resp.status_code, body)
    return resp.json()


class CallRetry:
    """The schedule of one swarm call: a busy server (503) is waited out for `deadline_s`, an unreachable
    one for `unreachable_s`; past either, the call raises."""

    def __init__(self, url: str, path: str, deadline_s: float, unreachable_s: float):
        self.url, self.path, self.deadline_s, self.unreachable_s = url, path, deadline_s, unreachable_s
        self.start = time.monotonic()
        self.attempt = 0
        self.unreachable_since: float | None = None

    def after_busy(self, resp: httpx.Response) -> float:
        self.unreachable_since = None
        delay = backoff_delay(self.attempt, resp.headers.get("retry-after"))
        if time.monotonic() - self.start + delay > self.deadline_s:
            raise SwarmError(503, f"gave up on {self.path} after {self.deadline_s:.0f}s: {resp.text[:200]}")
        self.attempt += 1
        return delay

    def after_unreachable(self, error: httpx.TransportError) -> float:
        now = time.monotonic()
        self.unreachable_since = self.unreachable_since if self.unreachable_since is not None else now
        delay = backoff_delay(self.attempt)
        waited = now - self.unreachable_since
        if waited + delay > self.unreachable_s or now - self.start + delay > self.deadline_s:
            raise ServerUnreachable(self.url, waited, error)
        log.debug("swarm server unreachable (%s); retrying in %.1fs", error, delay)
        self.attempt += 1
        return delay
