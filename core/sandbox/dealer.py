"""The dealer: which task a judged sandbox's next episode gets, drawn by the server from the judge's splits.

For a judged sandbox the agent does not choose its tasks (a patch could then drop the hard ones): a
client opens an episode without a task id and the server deals it one from the judge's `tasks(split)`.
Each task is dealt `group_size` times in a row, so the episodes of one group share it, and a split is
dealt pass after pass: the train split in an order shuffled by the run's seed, sandbox and pass
(`core.clients.sandbox.task_order`, as a client shuffles its own), other splits as the judge yields
them. Every client of a sandbox, and of each (kind, split), draws from the one deck, so several
clients fill groups together. `deal` takes a slot; `undo` puts back the last one when the open it was
for is refused (no await lies between the two, so on the server's event loop nobody deals in between).

A checkpoint keeps each deck's place (`state`: the pass and how many tasks of it were drawn), so a
resumed run deals on from there rather than from the first task again; `restore` replays the pass to
that place. The task being dealt when the checkpoint was written is dealt again from its first slot:
its open episodes did not survive the restart, and a group needs all of its slots.

Deliberately not here: scoring (`core.sandbox.judge`), the open route (`core.serve.swarm_routes`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from core.sandbox.judge import Judge, JudgeError, task_json
from core.sandbox.folder import task_order

SHUFFLED_SPLIT = "train"  # only this split is dealt shuffled, as clients draw their own tasks
# Dealt tasks remembered per open episode until it is judged; an episode that expires is never judged, so
# the oldest are forgotten past this many (far more than `server.max_open_episodes` can hold open at once).
TASKS_KEPT = 20_000


@dataclass
class Dealt:
    task_id: str
    task: dict[str, Any]


class _Deck:
    """One (sandbox, kind, split): its current task, how often it was dealt, and the passes so far."""

    def __init__(self, judge: Judge, split: str, seed: str):
        self.judge, self.split, self.seed = judge, split, seed
        self.passes = 0
        self.drawn = 0  # tasks drawn from the current pass (a put-back one counts when drawn again)
        self.order: Iterator[tuple[int, Any]] = iter(())
        self.current: Dealt | None = None
        self.dealt = 0  # slots of `current` dealt so far
        self.previous: tuple[Dealt | None, int] | None = None  # the state before the last deal (for undo)
        self.put_back: Dealt | None = None  # a task drawn for a deal that was undone: drawn again next

    def _next(self) -> Dealt:
        if self.put_back is not None:
            drawn, self.put_back = self.put_back, None
            self.drawn += 1
            return drawn
        for _ in range(2):  # a fresh pass when this one is spent; an empty split is an error, not a spin
            try:
                pair = next(self.order, None)
            except Exception as e:  # noqa: BLE001 - raised inside the judge's tasks() generator
                raise JudgeError(f"{self.judge.file}: tasks({self.split!r}) raised {type(e).__name__}: {e}") from e
            if pair is not None:
                index, task = pair
                task = task_json(self.judge, task)
                self.drawn += 1
                return Dealt(str(task.get("id", index)), task)
            shuffle = f"{self.seed}/{self.judge.sandbox}/{self.split}/{self.passes}" if self.split == SHUFFLED_SPLIT else None
            self.passes, self.drawn = self.passes + 1, 0
            try:
                self.order = iter(task_order(self.judge.tasks(self.split), shuffle))
            except Exception as e:  # noqa: BLE001 - the judge's own code: named with its file
                raise JudgeError(f"{self.judge.file}: tasks({self.split!r}) raised {type(e).__name__}: {e}") from e
        raise JudgeError(f"{self.judge.file}: tasks({self.split!r}) yields no task; the server has nothing to deal "
                         f"for sandbox {self.judge.sandbox!r}")

    def deal(self, group_size: int) -> Dealt:
        self.previous = (self.current, self.dealt)
        if self.current is None or self.dealt >= group_size:
            self.current, self.dealt = self._next(), 0
        self.dealt += 1
        return self.current

    def undo(self) -> None:
        if self.previous is not None:
            if self.previous[0] is not self.current:  # the deal drew a new task: it comes first again
                self.put_back = self.current
                self.drawn -= 1
            self.current, self.dealt = self.previous
            self.previous = None


    def state(self) -> dict[str, int]:
        return {"passes": self.passes, "drawn": self.drawn}

    def restore(self, passes: int, drawn: int) -> None:
        """Replay to a saved place: the pass's order is rebuilt from the same seed and judge, then drawn
        again up to the task that was current, which is dealt from its first slot."""
        self.passes, self.drawn, self.order, self.put_back, self.previous = max(passes - 1, 0), 0, iter(()), None, None
        self.current, self.dealt = None, 0
        for _ in range(drawn - 1):
            self._next()


class Dealer:
    """The decks of every judged sandbox of one server."""

    def __init__(self, judges: dict[str, Judge], seed: int | str):
        self.judges, self.seed = judges, str(seed)
        self._decks: dict[tuple[str, str, str], _Deck] = {}
        self._lock = threading.Lock()
        self._last: _Deck | None = None
        self._tasks: OrderedDict[str, dict[str, Any]] = OrderedDict()  # episode id -> its dealt task

    def deal(self, sandbox: str, kind: str, split: str, group_size: int) -> Dealt:
        judge = self.judges[sandbox]
        with self._lock:
            deck = self._decks.get((sandbox, kind, split))
            if deck is None:
                deck = self._decks[(sandbox, kind, split)] = _Deck(judge, split, self.seed)
            self._last = deck
            return deck.deal(group_size)

    def undo(self) -> None:
        """Put back the slot the last `deal` took (its open was refused)."""
        with self._lock:
            if self._last is not None:
                self._last.undo()
                self._last = None

    def assign(self, episode_id: str, dealt: Dealt) -> None:
        """Remember the task an opened episode was dealt, for its judge."""
        with self._lock:
            self._last = None  # the deal is used: nothing to undo
            self._tasks[episode_id] = dealt.task
            while len(self._tasks) > TASKS_KEPT:
                self._tasks.popitem(last=False)

    def state(self) -> dict[str, dict[str, int]]:
        """Each deck's place, keyed "sandbox/kind/split", for a checkpoint (plain JSON)."""
        with self._lock:
            return {"/".join(key): deck.state() for key, deck in self._decks.items() if deck.passes}

    def restore(self, state: dict[str, dict[str, int]]) -> None:
        """Put the decks back where a checkpoint found them; a sandbox this run no longer judges is skipped."""
        with self._lock:
            for key, place in state.items():
                sandbox, kind, split = key.split("/", 2)
                if sandbox in self.judges:
                    deck = self._decks[(sandbox, kind, split)] = _Deck(self.judges[sandbox], split, self.seed)
                    deck.restore(int(place["passes"]), int(place["drawn"]))

    def task_of(self, episode_id: str) -> dict[str, Any] | None:
        """The task dealt to an episode (None when none was, or it was forgotten); kept for a repeated finish."""
        with self._lock:
            return self._tasks.get(episode_id)
