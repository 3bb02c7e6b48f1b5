"""`SwarmClient`: the thin SDK that client code uses to open, run and finish episodes.

    client = SwarmClient("http://127.0.0.1:8000")
    with client.episode(task_id="t1", sandbox="math") as ep:
        reply = ep.openai.chat.completions.create(model="policy", messages=[...])
        ep.finish(reward=1.0)

The episode context opens the episode, keeps its lease alive from a background heartbeat, hands out
OpenAI clients bound to it, and aborts it if the block is left without a reward. Swarm routes are
retried with backoff when the server is down or answers 503 + Retry-After (paused, back-pressure), so
a client waits instead of crashing. `finish` is safe to retry because the server makes it idempotent.
The async twin, `client.aepisode(...)`, does the same for asyncio code.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import threading
import time
from typing import Any

import httpx
import openai

log = logging.getLogger(__name__)

RETRY_DEADLINE_S = 300.0  # how long a swarm call waits out a down or paused server before giving up
BACKOFF_START_S, BACKOFF_MAX_S = 0.2, 5.0
HEARTBEAT_FRACTION = 1 / 3  # renew the lease after a third of it: two missed beats still keep it
OPENAI_TIMEOUT_S = 600.0  # a generation may wait behind a weight sync; latency, not an error


class SwarmError(RuntimeError):
    def __init__(self, status: int, body: Any):
        msg = body.get("error", {}).get("message") if isinstance(body, dict) else str(body)
        super().__init__(f"swarm server answered {status}: {msg}")
        self.status, self.body = status, body


def _retry_delay(attempt: int, retry_after: str | None) -> float:
    if retry_after:
        try:
            return float(retry_after)
        except ValueError:
            pass
    return min(BACKOFF_MAX_S, BACKOFF_START_S * 2**attempt) * (0.5 + random.random() / 2)


def _settle(resp: httpx.Response) -> dict:
    if resp.status_code >= 400:
        try:
            body = resp.json()
        except ValueError:
            body = resp.text
        raise SwarmError(resp.status_code, body)
    return resp.json()


class SwarmClient:
    def __init__(self, url: str, client_id: str | None = None, client_version: str = "", deadline_s: float = RETRY_DEADLINE_S):
        self.url = url.rstrip("/")
        self.client_id = client_id or f"{socket.gethostname()}-{os.getpid()}"
        self.client_version = client_version
        self.deadline_s = deadline_s
        self._http = httpx.Client(timeout=30.0)

    def call(self, method: str, path: str, json: dict | None = None) -> dict:
        """A swarm route with retries on connection errors and 503."""
        start, attempt = time.monotonic(), 0
        while True:
            try:
                resp = self._http.request(method, f"{self.url}/swarm/v1{path}", json=json)
                if resp.status_code != 503:
                    return _settle(resp)
                delay = _retry_delay(attempt, resp.headers.get("retry-after"))
            except httpx.TransportError as e:
                delay = _retry_delay(attempt, None)
                log.debug("swarm server unreachable (%s); retrying in %.1fs", e, delay)
            if time.monotonic() - start + delay > self.deadline_s:
                raise SwarmError(503, f"gave up on {path} after {self.deadline_s:.0f}s")
            time.sleep(delay)
            attempt += 1

    def open_body(self, task_id: str, sandbox: str, group_size: int | None, kind: str, lease_s: float | None) -> dict:
        body = {"sandbox": sandbox, "task_id": str(task_id), "kind": kind, "client_id": self.client_id,
                "client_version": self.client_version}
        if group_size is not None:
            body["group_size"] = group_size
        if lease_s is not None:
            body["lease_s"] = lease_s
        return body

    def episode(self, task_id: str, sandbox: str = "default", group_size: int | None = None,
                kind: str = "train", lease_s: float | None = None) -> Episode:
        opened = self.call("POST", "/episodes", self.open_body(task_id, sandbox, group_size, kind, lease_s))
        return Episode(self, opened)

    def aepisode(self, task_id: str, sandbox: str = "default", group_size: int | None = None,
                 kind: str = "train", lease_s: float | None = None, cancel: asyncio.Event | None = None) -> AsyncEpisode:
        """`cancel`: stop waiting for the episode to open once set (a draining client opens nothing new)."""
        return AsyncEpisode(self, self.open_body(task_id, sandbox, group_size, kind, lease_s), cancel)

    def status(self) -> dict:
        return self.call("GET", "/status")

    def close(self) -> None:
        self._http.close()


class _EpisodeBase:
    def __init__(self, client: SwarmClient, opened: dict):
        self.client = client
        self.id: str = opened["episode_id"]
        self.api_key: str = opened["api_key"]
        self.base_url: str = opened["base_url"]
        self.model_versions: dict[str, int] = opened["model_versions"]
        self.lease_s = max(1.0, opened["lease_expires_at"] - time.time())
        self.result: dict | None = None

    @property
    def finished(self) -> bool:
        return self.result is not None

    def _finish_body(self, reward: float | dict[str, float], metrics: dict[str, float] | None) -> dict:
        body: dict[str, Any] = {"reward": reward}
        if metrics:
            body["metrics"] = metrics
        return body


class Episode(_EpisodeBase):
    """A synchronous episode: `openai` is an `openai.OpenAI` bound to it."""

    def __init__(self, client: SwarmClient, opened: dict):
        super().__init__(client, opened)
        self.openai = openai.OpenAI(base_url=self.base_url, api_key=self.api_key, timeout=OPENAI_TIMEOUT_S, max_retries=2)
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, daemon=True, name=f"heartbeat-{self.id}")
        self._beat.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.lease_s * HEARTBEAT_FRACTION):
            try:
                self.client.call("POST", f"/episodes/{self.id}/heartbeat")
            except SwarmError as e:
                if e.status == 409:
                    return  # ended elsewhere (expired, finished): nothing left to keep alive
                log.warning("heartbeat for %s failed: %s", self.id, e)

    def finish(self, reward: float | dict[str, float], metrics: dict[str, float] | None = None) -> dict:
        self.result = self.client.call("POST", f"/episodes/{self.id}/finish", self._finish_body(reward, metrics))
        self._stop.set()
        return self.result

    def abort(self, reason: str = "") -> None:
        self._stop.set()
        try:
            self.client.call("POST", f"/episodes/{self.id}/abort", {"reason": reason[:2000]})
        except SwarmError as e:
            if e.status != 409:
                raise

    def __enter__(self) -> Episode:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._stop.set()
        if not self.finished:
            self.abort(f"{exc_type.__name__}: {exc}" if exc_type else "left the episode without a reward")
        self.openai.close()


class AsyncEpisode(_EpisodeBase):
    """The asyncio twin: `async with client.aepisode(...) as ep:`; `ep.openai` is an `AsyncOpenAI`."""

    def __init__(self, client: SwarmClient, body: dict, cancel: asyncio.Event | None = None):
        self.client, self._body, self._cancel = client, body, cancel
        self._http = httpx.AsyncClient(timeout=30.0)
        self._beat: asyncio.Task | None = None
        self.openai: openai.AsyncOpenAI | None = None

    async def call(self, path: str, json: dict | None = None) -> dict:
        start, attempt = time.monotonic(), 0
        while True:
            try:
                resp = await self._http.post(f"{self.client.url}/swarm/v1{path}", json=json)
                if resp.status_code != 503:
                    return _settle(resp)
                delay = _retry_delay(attempt, resp.headers.get("retry-after"))
            except httpx.TransportError:
                delay = _retry_delay(attempt, None)
            if time.monotonic() - start + delay > self.client.deadline_s:
                raise SwarmError(503, f"gave up on {path} after {self.client.deadline_s:.0f}s")
            if path == "/episodes" and self._cancel is not None and self._cancel.is_set():
                raise SwarmError(503, "the client is stopping; no new episodes")
            await asyncio.sleep(delay)
            attempt += 1

    async def __aenter__(self) -> AsyncEpisode:
        try:
            opened = await self.call("/episodes", self._body)
        except BaseException:
            await self._http.aclose()
            raise
        super().__init__(self.client, opened)
        self.openai = openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, timeout=OPENAI_TIMEOUT_S, max_retries=2)
        self._beat = asyncio.create_task(self._heartbeat())
        return self

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.lease_s * HEARTBEAT_FRACTION)
            try:
                await self.call(f"/episodes/{self.id}/heartbeat")
            except SwarmError as e:
                if e.status == 409:
                    return
                log.warning("heartbeat for %s failed: %s", self.id, e)

    async def finish(self, reward: float | dict[str, float], metrics: dict[str, float] | None = None) -> dict:
        self.result = await self.call(f"/episodes/{self.id}/finish", self._finish_body(reward, metrics))
        return self.result

    async def abort(self, reason: str = "") -> None:
        try:
            await self.call(f"/episodes/{self.id}/abort", {"reason": reason[:2000]})
        except SwarmError as e:
            if e.status != 409:
                raise

    async def __aexit__(self, exc_type, exc, tb) -> None:
        if self._beat is not None:
            self._beat.cancel()
        try:
            if not self.finished:
                await self.abort(f"{exc_type.__name__}: {exc}" if exc_type else "left the episode without a reward")
        finally:
            await self.openai.close()
            await self._http.aclose()
