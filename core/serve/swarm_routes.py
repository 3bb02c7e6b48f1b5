"""The swarm routes under `/swarm/v1`: open, heartbeat, finish, abort, status, client registration, admin.

Finishing is idempotent: the same body again returns the same answer, a different body is a 409.
Heartbeat, finish and abort need the episode's key as bearer (401 otherwise, and nothing changes);
admin routes need the server's admin token. Who may open or register what, and what `/status` shows
them, is the caller's credential's (`core.episodes.credentials`; `/admin/credentials` issues one). An open is `core.episodes.opener.EpisodeOpener`'s (dealing,
an A/B's debts, admission with its hold, undo on refusal). These handlers translate HTTP into calls of
the opener, the registry and the client table and back; the rules live there, and every refusal is a
`core.episodes.errors.Refusal` the gateway renders.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Request

from core.episodes.auth import bearer, same_secret
from core.episodes.credentials import ADMIN_HEADER, GRANT_HEADER, Caller
from core.episodes.errors import Refusal
from core.episodes.opener import EpisodeOpener
from core.serve.judging import judged_finish
from core.serve.state import ServerState
from core.episodes.wire import (AbortEpisode, ClientGrant, ClientOrders, CredentialIssued, DrainClients, EpisodeOpened,
                                EpisodeState, FinishEpisode, OpenEpisode, RegisterClient, SwapRecord)

log = logging.getLogger(__name__)


def swarm_router(server: ServerState) -> APIRouter:
    router = APIRouter()
    registry = server.registry
    opener = EpisodeOpener(registry, server.clients, server.dealer, lambda sandbox: sandbox in server.judges,
                           server.versions)

    def state_of(ep) -> EpisodeState:
        return EpisodeState(episode_id=ep.id, state=ep.state, lease_expires_at=ep.lease_expires_at, reward=ep.reward)

    def caller(request: Request) -> Caller:
        """Who sent `request`: the admin token, a client's credential (`X-Swarm-Grant`), or anonymous."""
        return server.credentials.caller(request.headers.get(GRANT_HEADER, "").strip(), server.admin_token,
                                         bearer(request), request.headers.get(ADMIN_HEADER, ""))

    @router.post("/episodes", response_model=EpisodeOpened)
    async def open_episode(body: OpenEpisode, request: Request):
        # The caller's credential decides what the open may say (core.episodes.credentials), then the opener
        # deals, pays A/B debts, waits for admission and undoes a refusal (core.episodes.opener).
        body = server.credentials.bind_open(caller(request), body, server.allow_anonymous, server.clients.owner_of)
        opened = await opener.open(body)
        ep, base = opened.episode, str(request.base_url).rstrip("/")
        return EpisodeOpened(episode_id=ep.id, api_key=opened.key, base_url=f"{base}/episodes/{opened.path}/v1",
                             lease_expires_at=ep.lease_expires_at, model_versions=ep.opened_versions,
                             task_id=ep.task_id, task=opened.task)

    @router.post("/episodes/{episode_id}/heartbeat", response_model=EpisodeState)
    async def heartbeat(episode_id: str, request: Request):
        registry.authorize(episode_id, bearer(request))
        return state_of(registry.heartbeat(episode_id))

    @router.post("/episodes/{episode_id}/finish", response_model=EpisodeState)
    async def finish(episode_id: str, body: FinishEpisode, request: Request):
        registry.authorize(episode_id, bearer(request))
        ep = registry.get_open(episode_id) if not _ended_finished(registry, episode_id) else None
        if ep is not None and ep.sandbox in server.judges:  # the judge's score, never the agent's number
            rewards, score, metrics = await asyncio.to_thread(judged_finish, server, ep, body)
            return state_of(registry.finish(episode_id, rewards, body.model_dump(exclude_none=True), score, metrics))
        rewards = _rewards(server, body.reward, ep)
        return state_of(registry.finish(episode_id, rewards, body.model_dump(exclude_none=True)))

    @router.post("/episodes/{episode_id}/abort", response_model=EpisodeState)
    async def abort(episode_id: str, request: Request, body: AbortEpisode | None = None):
        registry.authorize(episode_id, bearer(request))
        return state_of(registry.abort(episode_id, body.reason if body else ""))

    @router.get("/status")
    async def status(request: Request):
        """The server's state; other clients' ids and versions, the swaps and the A/B only for the admin token."""
        who = caller(request)
        full = server.status()
        if who.who == "admin":
            return full
        own = {c["client_id"] for c in server.clients.listing(owner=who.credential_id)} if who.who == "client" else set()
        return {**full, "clients": [c for c in full["clients"] if c["client_id"] in own], "swaps": [],
                "ab": {"open": {}, "owed": {}, "dropped": {}, "pairs": []}}

    @router.post("/clients", response_model=ClientOrders)
    async def register_client(body: RegisterClient, request: Request):
        """A client's registration, sent again as its heartbeat; the answer says whether to drain. One made
        with a credential must say what its grant says, and is that credential's (its opens' client id)."""
        who = caller(request)
        server.credentials.bind_registration(who, body, server.allow_anonymous)
        key = bearer(request)  # the registration's key for a renewal; a person's admin token is no such key
        return server.clients.register(body, "" if same_secret(key, server.admin_token) else key, who.credential_id)

    @router.delete("/clients/{client_id}")
    async def leave(client_id: str, request: Request):
        server.clients.leave(client_id, bearer(request))
        return {"client_id": client_id, "state": "left"}

    def admin(request: Request) -> None:
        token = bearer(request) or request.headers.get("x-admin-token", "")
        if not same_secret(token, server.admin_token):
            raise Refusal(401, "admin routes need the admin token", "invalid_admin_token")

    @router.post("/admin/credentials", response_model=CredentialIssued)
    async def issue_credential(body: ClientGrant, request: Request):
        """`swarm swap` (or a person) registers the credential of a client it is about to start."""
        admin(request)
        return CredentialIssued(credential=server.credentials.issue(body), grant=body)

    @router.post("/admin/drain", response_model=SwapRecord | None)
    async def drain(body: DrainClients, request: Request):
        """`swarm swap`: the named clients drain (finish in-flight episodes, open none, exit)."""
        admin(request)
        return await asyncio.to_thread(server.clients.drain, body)  # on_swap may write to MLflow

    @router.post("/admin/pause")
    async def pause(request: Request):
        admin(request)
        registry.pause()
        return {"state": "paused"}

    @router.post("/admin/resume")
    async def resume(request: Request):
        admin(request)
        registry.resume()
        return {"state": "serving"}

    @router.post("/admin/checkpoint")
    async def checkpoint(request: Request):
        admin(request)
        if server.on_checkpoint is None:
            raise Refusal(409, "this server has no trainer to checkpoint", "no_trainer")

        return {"path": await asyncio.to_thread(server.on_checkpoint)}

    @router.post("/admin/shutdown")
    async def shutdown(request: Request):
        admin(request)
        if server.on_shutdown is not None:
            server.on_shutdown()
        else:
            server.request_exit()
        return {"state": "shutting_down"}

    return router


def _ended_finished(registry, episode_id: str) -> bool:
    try:
        registry.get_open(episode_id)
        return False
    except Refusal as e:
        if e.status == 404:
            raise
        return True  # ended: let finish() decide whether this is an idempotent repeat or a conflict


def _rewards(server: ServerState, reward: float | dict[str, float], ep) -> dict[str, float]:
    if isinstance(reward, dict):
        unknown = sorted(set(reward) - set(server.policies))
        if unknown:
            raise Refusal(400, f"reward names unknown models {unknown}; served: {sorted(server.policies)}",
                               "invalid_reward")
        # Every trainable model that acted needs its reward, or its trainer could not train the episode:
        # refuse the finish (the episode stays open) rather than lose the episode at batch time.
        acted = {c.model for c in ep.calls if server.policies[c.model].trainable} if ep is not None else set()
        missing = sorted(acted - set(reward))
        if missing:
            raise Refusal(400, f"reward names {sorted(reward)} but models {missing} also acted in this episode; "
                               "give each model that was called its reward", "invalid_reward")
        return dict(reward)
    called = sorted({c.model for c in ep.calls}) if ep is not None else []
    return {m: float(reward) for m in (called or server.policies)}

