"""The episode a generation belongs to, as a context variable: what replica routing keys on.

The episode registry sets it when a request's key (or path secret) resolves to an open episode, in
that request's own task, so every engine call the request makes afterwards (and the tasks it starts,
which copy the context) can tell which episode it serves. `core.engine.replicas` reads it to keep
an episode's calls on one replica. Deliberately only the variable: it imports nothing.
"""

from __future__ import annotations

import contextvars

# The episode of the current request (None: anonymous, or not a gateway request).
EPISODE: contextvars.ContextVar[str | None] = contextvars.ContextVar("swarm_episode", default=None)
