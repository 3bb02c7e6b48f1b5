"""The swarm routes under `/swarm/v1`: open, heartbeat, finish, abort, status, client registration, admin.

Finishing is idempotent: the same body again returns the same answer, a different body is a 409.
Heartbeat, finish and abort need the episode's key as bearer (401 otherwise, and nothing changes);
admin routes need the server's admin token. An open refused by admission control waits here for
room (the trainer taking its batch) for up to `ADMISSION_HOLD_S` before it is answered 503 +
Retry-After, so a client is not left asleep for a whole second after room opened. While an A/B is open
(`core.episodes.client_table.ClientTable.ab_role`) each train episode an old-version client opens is owed to
the new version's client, whose opens take those tasks (held like admission until one is owed). These handlers
translate HTTP into registry calls and back; the rules themselves live in `core.episodes.registry` (and, for
client registration and `/admin/drain`, the hot-swap path, in `core.episodes.client_table`).
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Request

from core.episodes.auth import bearer, same_secret
from core.sandbox.dealer import Dealt
from core.sandbox.judge import JudgeError
from core.episodes.errors import Refusal
from core.serve.judging import judged_finish
from core.serve.state import ServerState
from core.episodes.wire import AbortEpisode, ClientOrders, DrainClients, EpisodeOpened, EpisodeState, FinishEpisode, OpenEpisode, RegisterClient, SwapRecord

log = logging.getLogger(__name__)

# How long an open refused by admission control is held server-side, polling for room, before its
# 503. Room opens when the trainer takes a batch; Retry-After has whole-second resolution only.
ADMISSION_HOLD_S = 2.0
ADMISSION_POLL_S = 0.02
# An A/B's new version with no task owed after the hold retries after this: its old version is idle
# (the trainer is behind, or it drains); whole seconds are all Retry-After can say.
PAIRING_RETRY_S = 1.0


def swarm_router(server: ServerState) -> APIRouter:
    router = APIRouter()
    registry = server.registry

    def state_of(ep) -> EpisodeState:
        return EpisodeState(episode_id=ep.id, state=ep.state, lease_expires_at=ep.lease_expires_at, reward=ep.reward)

    @router.post("/episodes", response_model=EpisodeOpened)
    async def open_episode(body: OpenEpisode, request: Request):
        judged = body.sandbox in server.judges
        if judged and body.task_id is not None:
            raise Refusal(409, f"sandbox {body.sandbox!r} is judged: the server deals its tasks from its judge; "
                               "open its episodes without task_id and run the task the answer carries", "judged_sandbox")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ADMISSION_HOLD_S
        # In an A/B the successor opens only the tasks the old version's clients opened (core.episodes.pairing).
        role = server.clients.ab_role(body.sandbox, body.client_id) if body.kind == "train" else None
        while True:
            debt = server.clients.pairing.take(body.sandbox, server.versions()) if role == "follower" else None
            if role == "follower" and debt is None:
                if loop.time() >= deadline:
                    raise Refusal(503, "an A/B's new version runs the old version's tasks: none is owed yet",
                                       "ab_pairing", retry_after=PAIRING_RETRY_S)
                await asyncio.sleep(ADMISSION_POLL_S)
                continue
            dealt = Dealt(debt.task_id, debt.task) if debt is not None and judged else (
                _deal(server, body) if judged else None)
            task_id = debt.task_id if debt is not None else dealt.task_id if dealt is not None else body.task_id
            try:  # no await between the deal and the open: nobody else deals in between
                ep, key = registry.open(body.model_copy(update={"task_id": task_id}), server.versions())
                break
            except Refusal as e:
                if debt is not None:
                    server.clients.pairing.put_back(body.sandbox, debt)
                elif dealt is not None:
                    server.dealer.undo()
                if e.code != "admission" or loop.time() >= deadline:
                    if e.code == "admission":
                        registry.note_refused()
                    raise
            await asyncio.sleep(ADMISSION_POLL_S)
        if dealt is not None:
            server.dealer.assign(ep.id, dealt)
        if role == "leader":  # owed to the A/B's new version, on these weights
            server.clients.pairing.owe(body.sandbox, ep.task_id, dealt.task if dealt else None, ep.opened_versions)
        base = str(request.base_url).rstrip("/")
        return EpisodeOpened(episode_id=ep.id, api_key=key, base_url=f"{base}/episodes/{registry.path_of(ep.id)}/v1",
                             lease_expires_at=ep.lease_expires_at, model_versions=ep.opened_versions,
                             task_id=ep.task_id, task=dealt.task if dealt is not None else None)

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
    async def status():
        return server.status()

    @router.post("/clients", response_model=ClientOrders)
    async def register_client(body: RegisterClient, request: Request):
        """A client's registration, sent again as its heartbeat; the answer says whether to drain."""
        return server.clients.register(body, bearer(request))

    @router.delete("/clients/{client_id}")
    async def leave(client_id: str, request: Request):
        server.clients.leave(client_id, bearer(request))
        return {"client_id": client_id, "state": "left"}

    def admin(request: Request) -> None:
        token = bearer(request) or request.headers.get("x-admin-token", "")
        if not same_secret(token, server.admin_token):
            raise Refusal(401, "admin routes need the admin token", "invalid_admin_token")

    @router.post("/admin/drain", response_model=SwapRecord | None)
    async def drain(body: DrainClients, request: Request):
        """`swarm swap`: the named clients drain (finish in-flight episodes, open none, exit)."""
        admin(request)
        return await asyncio.to_thread(server.clients.drain, body)  # on_swap may write to MLflow

    @router.post("/admin/pause")
    async def pause(request: Request):
        admin(request)
        registry.paused = True
        return {"state": "paused"}

    @router.post("/admin/resume")
    async def resume(request: Request):
        admin(request)
        registry.paused = False
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


def _deal(server: ServerState, body: OpenEpisode) -> Dealt:
    """The next task of a judged sandbox's (kind, split) deck; a judge whose tasks() fails is a 500 naming it."""
    try:
        return server.dealer.deal(body.sandbox, body.kind, body.split, body.group_size or server.registry.default_group_size)
    except JudgeError as e:
        raise Refusal(500, f"the judge of sandbox {body.sandbox!r} cannot deal a task: {e}", "judge_error") from None
