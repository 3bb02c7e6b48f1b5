"""`SwarmClient`: the thin SDK that client code uses to open, run and finish episodes.

    client = SwarmClient("http://127.0.0.1:8000")
    with client.episode(task_id="t1", sandbox="math") as ep:
        reply = ep.openai.chat.completions.create(model=ep.model, messages=[...])
        ep.finish(reward=1.0)

The episode context opens the episode, keeps its lease alive from a background heartbeat, hands out
OpenAI clients bound to it, and aborts it if the block is left without a reward. Swarm routes are
retried with backoff when the server is down or answers 503 + Retry-After (paused, back-pressure), so
a client waits instead of crashing; how long and how often, and the errors a call raises, are
`core.clients.retries`'s. `finish` is safe to retry because the server makes it idempotent. The async
twin, `client.aepisode(...)`, does the same for asyncio code.

The model naming rule: an episode's `model` (also on its bound OpenAI client, `ep.openai.model`) is
the server's single served model, read from the open response; code that names a model explicitly
keeps its name. This module does not run agents or decide when a failing client gives up
(`core.clients.runner` does).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
import ssl
import threading
import time
from typing import Any

import httpx
import openai

from core.clients.retries import RETRY_DEADLINE_S, CallRetry, ClientStopping, SwarmError, settle
from core.episodes.credentials import ADMIN_HEADER, GRANT_ENV, GRANT_HEADER
from core.local_state import local_admin_token

log = logging.getLogger(__name__)

HEARTBEAT_FRACTION = 1 / 3  # renew the lease after a third of it: two missed beats still keep it
OPENAI_TIMEOUT_S = 600.0  # a generation may wait behind a weight sync; latency, not an error
# An abort is a courtesy: an episode nobody finishes expires with its lease anyway, so a client that
# is stopping never waits longer than this for a server that may be gone.
ABORT_DEADLINE_S = 5.0


@functools.cache
def tls_context() -> ssl.SSLContext:
    """One verifying TLS context per process (httpx's default one), shared by every HTTP client of every
    episode. Each client would otherwise build its own, reading the CA bundle: ~30 ms of CPU, twice per
    episode, which on a 2-core machine came out of the engine's share (profile of bench/vs_trl.py)."""
    return httpx.create_ssl_context()


def _bearer(key: str | None) -> dict[str, str]:
    """Headers that carry an episode key: heartbeat, finish and abort are refused (401) without it."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def model_to_call(served: tuple[str, ...] | list[str]) -> str:
    """The naming rule: the server's single served model; several need the code to name one."""
    if len(served) == 1:
        return served[0]
    if not served:
        raise ValueError("no served model is known here: this OpenAI client is not bound to a swarm episode; "
                         "pass model= explicitly")
    raise ValueError(f"the server serves several models {sorted(served)}: pass model= explicitly")


# A person's admin token for their own client (as `core.run.server_files.ADMIN_TOKEN_ENV`, which the client
# package may not import): with it, and no credential from a run, a person's script or `swarm client` opens.
PERSON_TOKEN_ENV = "SWARMRL_ADMIN_TOKEN"


def person_token(url: str) -> str:
    """A person's own client (no run or swap launched it, so no credential): the admin token, given in
    $SWARMRL_ADMIN_TOKEN or found in this machine's index of servers; "" when neither has it. A contained
    client finds neither (the variable is not passed, the index is masked: `core.local_state.token_files`)."""
    return os.environ.get(PERSON_TOKEN_ENV) or local_admin_token(url) or ""


class SwarmClient:
    def __init__(self, url: str, client_id: str | None = None, client_version: str = "",
                 deadline_s: float = RETRY_DEADLINE_S, unreachable_s: float | None = None,
                 credential: str | None = None, person: str | None = None):
        """`unreachable_s`: how long a call retries a server it cannot connect to (default: `deadline_s`).
        `credential`: the client credential its run or `swarm swap` issued (default: `$SWARMRL_CLIENT_GRANT`),
        sent as `X-Swarm-Grant` on every swarm route; the server binds what this client may open to it.
        `person`: without a credential, a person's admin token, sent as `x-admin-token` (a person's own client;
        default: `person_token`, so a person's script against their own server on this machine just works)."""
        self.url = url.rstrip("/")
        self.credential = credential if credential is not None else os.environ.get(GRANT_ENV, "")
        self.person = person if person is not None else ("" if self.credential else person_token(self.url))
        self.client_id = client_id or f"{socket.gethostname()}-{os.getpid()}"
        self.client_version = client_version
        self.deadline_s = deadline_s
        self.unreachable_s = deadline_s if unreachable_s is None else unreachable_s
        self._http = httpx.Client(timeout=30.0, verify=tls_context())

    def grant_header(self) -> dict[str, str]:
        if self.credential:
            return {GRANT_HEADER: self.credential}
        return {ADMIN_HEADER: self.person} if self.person else {}

    def retry(self, path: str, deadline_s: float | None = None) -> CallRetry:
        deadline = self.deadline_s if deadline_s is None else deadline_s
        return CallRetry(self.url, path, deadline, min(deadline, self.unreachable_s))

    def call(self, method: str, path: str, json: dict | None = None, deadline_s: float | None = None,
             key: str | None = None) -> dict:
        """A swarm route with retries on connection errors and 503; `key`: the episode key, sent as bearer."""
        retry = self.retry(path, deadline_s)
        headers = {**_bearer(key), **self.grant_header()}
        while True:
            try:
                resp = self._http.request(method, f"{self.url}/swarm/v1{path}", json=json, headers=headers)
                if resp.status_code != 503:
                    return settle(resp)
                delay = retry.after_busy(resp)
            except httpx.TransportError as e:
                delay = retry.after_unreachable(e)
            time.sleep(delay)

    def open_body(self, task_id: str | None, sandbox: str, group_size: int | None, kind: str, lease_s: float | None,
                  split: str | None = None) -> dict:
        """`task_id` None: a judged sandbox's episode, whose task the server deals (from `split`'s deck)."""
        body = {"sandbox": sandbox, "kind": kind, "client_id": self.client_id, "client_version": self.client_version}
        if task_id is not None:
            body["task_id"] = str(task_id)
        if split is not None:
            body["split"] = split
        if group_size is not None:
            body["group_size"] = group_size
        if lease_s is not None:
            body["lease_s"] = lease_s
        return body

    def episode(self, task_id: str | None, sandbox: str = "default", group_size: int | None = None,
                kind: str = "train", lease_s: float | None = None, split: str | None = None) -> Episode:
        """`task_id` None: the server deals a judged sandbox's task, in `ep.task`."""
        opened = self.call("POST", "/episodes", self.open_body(task_id, sandbox, group_size, kind, lease_s, split))
        return Episode(self, opened)

    def aepisode(self, task_id: str | None, sandbox: str = "default", group_size: int | None = None,
                 kind: str = "train", lease_s: float | None = None, cancel: asyncio.Event | None = None,
                 split: str | None = None) -> AsyncEpisode:
        """`cancel`: stop waiting for the episode to open once set (a draining client opens nothing new)."""
        return AsyncEpisode(self, self.open_body(task_id, sandbox, group_size, kind, lease_s, split), cancel)

    def status(self) -> dict:
        return self.call("GET", "/status")

    def register(self, info: dict, key: str = "", deadline_s: float | None = None) -> dict:
        """Register this client process (`core.episodes.wire.RegisterClient`), or renew it with its `key`: the
        answer (`ClientOrders`) carries the key for the next beat and whether to drain (a hot swap)."""
        return self.call("POST", "/clients", info, deadline_s=deadline_s, key=key or None)

    def leave(self, client_id: str, key: str) -> None:
        """Remove the registration on exit; a courtesy (a silent client is dropped anyway), so bounded."""
        try:
            self.call("DELETE", f"/clients/{client_id}", deadline_s=ABORT_DEADLINE_S, key=key)
        except SwarmError as e:
            log.debug("could not leave the client table: %s", e)

    def close(self) -> None:
        self._http.close()


class EpisodeOpenAI(openai.OpenAI):
    """`openai.OpenAI` bound to one episode; `model` is the model to call (the naming rule)."""

    served: tuple[str, ...] = ()  # the models the server serves, from the episode's open response

    @property
    def model(self) -> str:
        return model_to_call(self.served)


class EpisodeAsyncOpenAI(openai.AsyncOpenAI):
    """`openai.AsyncOpenAI` bound to one episode; `model` is the model to call (the naming rule)."""

    served: tuple[str, ...] = ()

    @property
    def model(self) -> str:
        return model_to_call(self.served)


class _EpisodeBase:
    def __init__(self, client: SwarmClient, opened: dict):
        self.client = client
        self.id: str = opened["episode_id"]
        self.api_key: str = opened["api_key"]
        self.base_url: str = opened["base_url"]
        self.model_versions: dict[str, int] = opened["model_versions"]
        self.task_id: str | None = opened.get("task_id")  # the episode's task id (the server's for a judged sandbox)
        self.task: dict | None = opened.get("task")  # a judged sandbox's task, dealt by the server; else None
        self.lease_s = max(1.0, opened["lease_expires_at"] - time.time())
        self.result: dict | None = None

    @property
    def model(self) -> str:
        """The model to call: the server's single served model (several: name one explicitly)."""
        return model_to_call(tuple(self.model_versions))

    @property
    def finished(self) -> bool:
        return self.result is not None

    def _finish_body(self, reward: float | dict[str, float], metrics: dict[str, float] | None,
                     answer: Any = None) -> dict:
        body: dict[str, Any] = {"reward": reward}
        if metrics:
            body["metrics"] = metrics
        if answer is not None:  # a judged sandbox's judge reads it beside the server's record
            body["answer"] = answer
        return body


class Episode(_EpisodeBase):
    """A synchronous episode: `openai` is an `openai.OpenAI` bound to it."""

    def __init__(self, client: SwarmClient, opened: dict):
        super().__init__(client, opened)
        self.openai = EpisodeOpenAI(base_url=self.base_url, api_key=self.api_key, timeout=OPENAI_TIMEOUT_S, max_retries=2,
                                    http_client=openai.DefaultHttpxClient(verify=tls_context()))
        self.openai.served = tuple(self.model_versions)
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, daemon=True, name=f"heartbeat-{self.id}")
        self._beat.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.lease_s * HEARTBEAT_FRACTION):
            try:
                self.client.call("POST", f"/episodes/{self.id}/heartbeat", key=self.api_key)
            except SwarmError as e:
                if e.status == 409:
                    return  # ended elsewhere (expired, finished): nothing left to keep alive
                log.warning("heartbeat for %s failed: %s", self.id, e)

    def finish(self, reward: float | dict[str, float], metrics: dict[str, float] | None = None,
               answer: Any = None) -> dict:
        self.result = self.client.call("POST", f"/episodes/{self.id}/finish", self._finish_body(reward, metrics, answer),
                                       key=self.api_key)
        self._stop.set()
        return self.result

    def abort(self, reason: str = "") -> None:
        self._stop.set()
        try:
            self.client.call("POST", f"/episodes/{self.id}/abort", {"reason": reason[:2000]}, deadline_s=ABORT_DEADLINE_S,
                             key=self.api_key)
        except SwarmError as e:
            if e.status not in (409, 503):  # 503: gone or busy; the lease expires the episode anyway
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
        self._http = httpx.AsyncClient(timeout=30.0, verify=tls_context())
        self._beat: asyncio.Task | None = None
        self.openai: EpisodeAsyncOpenAI | None = None

    async def call(self, path: str, json: dict | None = None, deadline_s: float | None = None,
                   key: str | None = None) -> dict:
        retry = self.client.retry(path, deadline_s)
        headers = {**_bearer(key), **self.client.grant_header()}
        while True:
            try:
                resp = await self._http.post(f"{self.client.url}/swarm/v1{path}", json=json, headers=headers)
                if resp.status_code != 503:
                    return settle(resp)
                delay = retry.after_busy(resp)
            except httpx.TransportError as e:
                delay = retry.after_unreachable(e)
            if path == "/episodes" and self._cancel is not None and self._cancel.is_set():
                raise ClientStopping()
            await asyncio.sleep(delay)

    async def __aenter__(self) -> AsyncEpisode:
        try:
            opened = await self.call("/episodes", self._body)
        except BaseException:
            await self._http.aclose()
            raise
        super().__init__(self.client, opened)
        self.openai = EpisodeAsyncOpenAI(base_url=self.base_url, api_key=self.api_key, timeout=OPENAI_TIMEOUT_S,
                                         max_retries=2, http_client=openai.DefaultAsyncHttpxClient(verify=tls_context()))
        self.openai.served = tuple(self.model_versions)
        self._beat = asyncio.create_task(self._heartbeat())
        return self

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.lease_s * HEARTBEAT_FRACTION)
            try:
                await self.call(f"/episodes/{self.id}/heartbeat", key=self.api_key)
            except SwarmError as e:
                if e.status == 409:
                    return
                log.warning("heartbeat for %s failed: %s", self.id, e)

    async def finish(self, reward: float | dict[str, float], metrics: dict[str, float] | None = None,
                     answer: Any = None) -> dict:
        self.result = await self.call(f"/episodes/{self.id}/finish", self._finish_body(reward, metrics, answer),
                                      key=self.api_key)
        return self.result

    async def abort(self, reason: str = "") -> None:
        try:
            await self.call(f"/episodes/{self.id}/abort", {"reason": reason[:2000]}, deadline_s=ABORT_DEADLINE_S,
                            key=self.api_key)
        except SwarmError as e:
            if e.status not in (409, 503):  # 503: gone or busy; the lease expires the episode anyway
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
