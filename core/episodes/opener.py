"""Opening an episode, in one object: `EpisodeOpener.open` returns an opened episode or raises its refusal.

An open passes, in this order:

- **the task**: a judged sandbox's task is dealt by the server (`core.sandbox.dealer`); an open that names
  its own task id for one is a 409 (`judged_sandbox`). An unjudged sandbox's client names its task.
- **the A/B's debts**: while `swarm swap --ab` keeps two versions serving (`ClientTable.ab_role`), each
  train episode a leader (an old-version client) opens leaves its task owed to the follower, and the
  follower opens nothing but the oldest owed task (`core.episodes.pairing.TaskPairing`), held like
  admission until one is owed (503 `ab_pairing` after the hold).
- **admission**: the registry's rules (`core.episodes.admission`). An open refused by admission control
  is held here, polling for room (the trainer taking its batch), for up to `ADMISSION_HOLD_S` before its
  503 + Retry-After, so a client is not left asleep for a whole second after room opened.
- **undo**: a refused open takes nothing: its dealt task goes back to the deck, its debt back to the
  front of the follower's queue.

Who may open what (the caller's credential and what it binds) is decided before this, by
`core.episodes.credentials`; the opener takes the open as already authorized. It does not speak HTTP
(the route renders its `Refusal`), and it keeps no books: the registry, the dealer and the pairing do.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from core.episodes.client_table import ClientTable
from core.episodes.errors import Refusal
from core.episodes.pairing import Debt
from core.episodes.registry import Registry
from core.episodes.wire import OpenEpisode
from core.records import Episode
from core.sandbox.dealer import Dealer, Dealt
from core.sandbox.judge import JudgeError

# How long an open refused by admission control is held, polling for room, before its 503. Room opens
# when the trainer takes a batch; Retry-After has whole-second resolution only.
ADMISSION_HOLD_S = 2.0
ADMISSION_POLL_S = 0.02
# An A/B's new version with no task owed after the hold retries after this: its old version is idle
# (the trainer is behind, or it drains); whole seconds are all Retry-After can say.
PAIRING_RETRY_S = 1.0


@dataclass(frozen=True)
class Opened:
    """An episode the registry opened: its record, its key and path secret, and a dealt task if any."""

    episode: Episode
    key: str
    path: str
    task: dict[str, Any] | None  # a judged sandbox's task, dealt by the server; None when the client chose


class EpisodeOpener:
    def __init__(self, registry: Registry, clients: ClientTable, dealer: Dealer, judged: Callable[[str], bool],
                 versions: Callable[[], dict[str, int]], hold_s: float = ADMISSION_HOLD_S):
        self.registry, self.clients, self.dealer = registry, clients, dealer
        self.judged, self.versions, self.hold_s = judged, versions, hold_s

    async def open(self, body: OpenEpisode) -> Opened:
        judged = self.judged(body.sandbox)
        if judged and body.task_id is not None:
            raise Refusal(409, f"sandbox {body.sandbox!r} is judged: the server deals its tasks from its judge; "
                          "open its episodes without task_id and run the task the answer carries", "judged_sandbox",
                          param="task_id")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.hold_s
        # In an A/B the successor opens only the tasks the old version's clients opened.
        role = self.clients.ab_role(body.sandbox, body.client_id) if body.kind == "train" else None
        while True:
            debt = self.registry.pairing.take(body.sandbox, self.versions()) if role == "follower" else None
            if role == "follower" and debt is None:
                if loop.time() >= deadline:
                    raise Refusal(503, "an A/B's new version runs the old version's tasks: none is owed yet",
                                  "ab_pairing", retry_after=PAIRING_RETRY_S)
                await asyncio.sleep(ADMISSION_POLL_S)
                continue
            try:  # no await between the deal and the open: nobody else deals in between
                opened = self._try(body, judged, debt)
                break
            except Refusal as e:
                if e.code != "admission" or loop.time() >= deadline:
                    if e.code == "admission":
                        self.registry.note_refused()
                    raise
            await asyncio.sleep(ADMISSION_POLL_S)
        if role == "leader":  # owed to the A/B's new version, on these weights
            ep = opened.episode
            self.registry.pairing.owe(body.sandbox, ep.task_id, opened.task, ep.opened_versions)
        return opened

    def _try(self, body: OpenEpisode, judged: bool, debt: Debt | None) -> Opened:
        """One attempt: deal (or pay the debt), open, and undo the deal or the debt if the registry refuses."""
        dealt = Dealt(debt.task_id, debt.task) if debt is not None and judged else self._deal(body) if judged else None
        task_id = debt.task_id if debt is not None else dealt.task_id if dealt is not None else body.task_id
        try:
            ep, key = self.registry.open(body.model_copy(update={"task_id": task_id}), self.versions())
        except Refusal:
            if debt is not None:
                self.registry.pairing.put_back(body.sandbox, debt)
            elif dealt is not None:
                self.dealer.undo()
            raise
        if dealt is not None:
            self.dealer.assign(ep.id, dealt)
        return Opened(ep, key, self.registry.path_of(ep.id), dealt.task if dealt is not None else None)

    def _deal(self, body: OpenEpisode) -> Dealt:
        """The next task of a judged sandbox's (kind, split) deck; a judge whose tasks() fails is a 500 naming it."""
        try:
            return self.dealer.deal(body.sandbox, body.kind, body.split, body.group_size or self.registry.default_group_size)
        except JudgeError as e:
            raise Refusal(500, f"the judge of sandbox {body.sandbox!r} cannot deal a task: {e}", "judge_error") from None
