"""A client runner's failed episodes: when to back off, when to give up, and the one line a person reads.

`FailureGate` counts a runner's failed episodes in a row: while the last one failed it admits one
episode at a time after an exponential backoff (`core.clients.retries.backoff_delay`), and after its
limit the runner raises `ClientGaveUp` whose message is `describe` (the error in one line, the
server's own message when it sent one) and `likely_fix` (what to change, from the error's kind).
It is deliberately not the runner: it runs no episode, retries nothing and talks to no server
(`core.clients.runner` does).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import openai

from core.clients.deadline import EpisodeTimeout
from core.clients.sandbox import Agent
from core.clients.retries import ServerUnreachable, SwarmError, backoff_delay


class ClientGaveUp(RuntimeError):
    """Too many consecutive failed episodes; the message is the one line a person reads."""


class FailureGate:
    """Consecutive failed episodes of one runner: backoff and one episode at a time while failing."""

    def __init__(self, limit: int):
        self.limit = limit  # 0: never give up
        self.consecutive = 0
        self.last_error: BaseException | None = None
        self._probe = asyncio.Lock()

    @property
    def exhausted(self) -> bool:
        return self.limit > 0 and self.consecutive >= self.limit

    def succeeded(self) -> None:
        self.consecutive = 0

    def failed(self, error: BaseException) -> None:
        self.consecutive += 1
        self.last_error = error

    @asynccontextmanager
    async def admit(self, stop: asyncio.Event) -> AsyncIterator[None]:
        """Healthy: enter at once. Failing: wait for the episode before to end, then for the backoff."""
        if self.consecutive == 0:
            yield
            return
        async with self._probe:
            if self.consecutive:
                await sleep_unless(stop, backoff_delay(self.consecutive - 1))
            yield


async def sleep_unless(stop: asyncio.Event, seconds: float) -> None:
    """Wait `seconds`, or less when `stop` is set meanwhile."""
    try:
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    except TimeoutError:
        pass


def describe(error: BaseException) -> str:
    """An error in one line: the server's own message when it sent one."""
    if isinstance(error, openai.APIStatusError):
        body = error.body if isinstance(error.body, dict) else {}
        return f"{error.status_code} {body.get('message') or error.message}"
    return f"{type(error).__name__}: {error}"


def likely_fix(error: BaseException, agent: Agent, url: str) -> str:
    where = f"{agent.folder}/agent.py" if agent.folder else f"agent {agent.name}"
    status = getattr(error, "status_code", None) or getattr(error, "status", None)
    body = getattr(error, "body", None)
    code = body.get("code") if isinstance(body, dict) else None
    if isinstance(error, (ServerUnreachable, openai.APIConnectionError)):
        return f"start the swarm server (`swarm serve ...`) or point --server at a running one; {url} does not answer"
    if status == 404 and code == "model_not_found":
        return (f"{where} asks for a model this server does not serve: call `model=llm.model` (the server's single "
                "model), or serve the model under the name the sandbox uses (`swarm serve --name NAME`)")
    if status == 400:
        return f"the server refused a request of the sandbox (see the message): fix the request in {where}"
    if isinstance(error, EpisodeTimeout):
        return (f"find where the rollout in {where} waits forever (run it with `--episodes 1 -v`), or raise "
                "--episode-timeout if its episodes are just slow")
    if status == 409:
        return "episodes ended before their reward arrived: raise the server's server.lease_s or shorten the rollout"
    if isinstance(error, SwarmError):
        return "the server refuses to open these episodes: check --group-size and --kind against its config"
    return f"the sandbox's rollout raises: run it once with `--episodes 1 -v` to see the traceback, then fix {where}"
