"""Episode deadlines: cancel a rollout that runs past its limit, with an error naming its file and function.

An awaiting hang keeps the client's heartbeat going, so without a deadline its episode would never
expire and would hold its group's slot forever. `core.clients.runner` awaits every rollout through
`within_limit`; the failure it raises counts as a failed episode there. This module does not open,
abort or retry episodes, and it cannot stop a rollout that blocks its event loop (the server expires
those by lease, as their heartbeats stop with them).
"""

from __future__ import annotations

import asyncio
import inspect

from core.clients.sandbox import Agent, SandboxError

# The longest a rollout may run before it is cancelled and its episode aborted (0: no limit). An awaiting
# hang keeps heartbeating, so without this its episode would hold its group's slot forever. Ten minutes
# matches the hang watchdog's default `server.stall_s`: a rollout slower than that already reads as a
# stall, and it leaves room for several generations that each wait behind a weight sync.
EPISODE_TIMEOUT_S = 600.0
CANCEL_GRACE_S = 5.0  # how long a cancelled rollout may take to unwind before the runner moves on without it


class EpisodeTimeout(SandboxError):
    """A rollout ran past the episode limit and was cancelled; the message names its file and function."""


def rollout_source(agent: Agent) -> str:
    """The file that defines the agent's rollout (under `core.clients.sandbox`'s checking wrapper)."""
    try:
        return inspect.getsourcefile(inspect.unwrap(agent.rollout)) or agent.name
    except TypeError:  # not a Python function (a builtin or a C callable)
        return f"agent {agent.name}"


async def within_limit(rollout, limit_s: float, source: str):
    """Await `rollout` for at most `limit_s` seconds (0: no limit); past it, cancel it and raise `EpisodeTimeout`.
    A rollout that swallows the cancellation is left behind after CANCEL_GRACE_S rather than waited for."""
    if not limit_s:
        return await rollout
    task = asyncio.ensure_future(rollout)
    try:
        done, _ = await asyncio.wait({task}, timeout=limit_s)
        if done:
            return task.result()
        task.cancel()
        await asyncio.wait({task}, timeout=CANCEL_GRACE_S)
        raise EpisodeTimeout(f"{source} in rollout() ran past the {limit_s:g} s episode limit and was cancelled "
                             "(--episode-timeout, clients[].episode_timeout)")
    finally:
        task.cancel()  # a no-op when it is done; else the runner itself is being cancelled (a drain ran out)
