"""An A/B's books: the same tasks for both code versions, and their scores compared only on the same weights.

While `swarm swap --ab` keeps two code versions of a sandbox serving side by side (the client table,
`core.episodes.client_table`, says which clients lead and which one follows), two things make their comparison
one of code alone:

- `TaskPairing`: every train episode a leader (an old-version client) opens leaves a debt, its task, and
  the follower (the new version's client) opens nothing but those debts, first come first served. So each
  task drawn goes to both versions, at about the same moment, hence mostly on the same weights. A debt
  left unpaid for `DEBT_MAX_VERSIONS` weight versions is dropped: it could no longer pair.
- `Pairs`: train episodes fall into cells (sandbox, task id, the weights versions it opened on), fixed when
  it opens: what its calls later ran on does not move it, so an agent that waits for new weights after a
  bad reply stays in the cell it opened in. An episode counts in its cell when it ends: finished, its
  number (`scored`: the judge's score when the sandbox is judged, else the reward); a judged one that
  never finished (aborted, expired, refused a call beyond `max_calls`) with its judge's failure value,
  as the registry finishes it (counted, never dropped; an unjudged one that never finished has no number
  and leaves its cell). A cell that both versions reached is a compared pair, each version scored by its
  mean over its episodes there, once none of its episodes is still open: a pair is never compared
  without an episode that is still running. Per trainer step, the pairs completed since the last step
  give each version's mean under `core.config.ab_metric`: both means are over the same cells, so their
  difference holds neither task mix nor weights, only code. The registry tells the book of every open
  and end (`opened`, `ended`), so a train episode is counted whether or not it is ever trained (a stale
  one is dropped from its batch, never from its cell).

Groups never mix versions because they are keyed by `Episode.train_group`. Nothing here opens,
trains or decides; the verdict on the per-step differences is the researcher's
(`researcher.evidence.ab`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from core.config import ab_metric
from core.records import Episode

# A debt the follower has not paid once the weights moved this many versions past those it was drawn
# on is dropped: its episode would run on other weights than the leader's, a cell that never pairs.
DEBT_MAX_VERSIONS = 1
DEBTS_KEPT = 4096  # per sandbox: far more than any client's concurrency can leave owed at once
# Unpaired cells are forgotten once the newest weights are this many versions past theirs: a late
# episode of the other version can still finish there while it runs (max_staleness + 1 at most).
CELL_MAX_VERSIONS = 4
RECENT_PAIRS = 200  # compared pairs kept for `/status` (people, and the live A/B test, look at them)
# Cells kept at most: a server whose weights never move (no trainer) forgets none by age, so the oldest with no
# episode still running go first (as many as the registry keeps tombstones: far more than any A/B needs at once).
CELLS_KEPT = 20_000


@dataclass
class Debt:
    task_id: str
    task: dict[str, Any] | None  # a judged sandbox's dealt task; None when clients choose (the id is enough)
    versions: dict[str, int]  # weights when the leader opened it


class TaskPairing:
    """Per sandbox in an A/B: the tasks the leaders opened that the follower still owes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._debts: dict[str, deque[Debt]] = {}
        self.dropped: dict[str, int] = {}  # debts dropped unpaid, per sandbox

    def owe(self, sandbox: str, task_id: str, task: dict[str, Any] | None, versions: dict[str, int]) -> None:
        with self._lock:
            self._debts.setdefault(sandbox, deque(maxlen=DEBTS_KEPT)).append(Debt(task_id, task, dict(versions)))

    def take(self, sandbox: str, current: dict[str, int]) -> Debt | None:
        """The oldest debt still on (about) the current weights; older ones are dropped. None: nothing owed."""
        with self._lock:
            debts = self._debts.get(sandbox)
            while debts:
                debt = debts.popleft()
                if all(current.get(m, v) - v <= DEBT_MAX_VERSIONS for m, v in debt.versions.items()):
                    return debt
                self.dropped[sandbox] = self.dropped.get(sandbox, 0) + 1
            return None

    def put_back(self, sandbox: str, debt: Debt) -> None:
        """A debt whose open was refused goes back to the front: it is still owed."""
        with self._lock:
            self._debts.setdefault(sandbox, deque(maxlen=DEBTS_KEPT)).appendleft(debt)

    def close(self, sandbox: str) -> None:
        """The A/B ended: nothing is owed any more."""
        with self._lock:
            self._debts.pop(sandbox, None)

    def owed(self) -> dict[str, int]:
        with self._lock:
            return {s: len(d) for s, d in self._debts.items() if d}


Cell = tuple[str, str, tuple[tuple[str, int], ...]]  # (sandbox, task id, ((model, version at open), ...) sorted)


def cell_of(ep: Episode) -> Cell:
    """The cell an episode is compared in: its sandbox, task and the weights it opened on, fixed at open."""
    return (ep.sandbox, ep.task_id, tuple(sorted(ep.opened_versions.items())))


def scored(ep: Episode) -> float | None:
    """The number a study reads of one episode: its judge's score when its sandbox is judged (the failure
    value when it never finished), else its reward averaged over the models that acted; None when it has neither."""
    if ep.score is not None:
        return ep.score
    return sum(ep.reward.values()) / len(ep.reward) if ep.reward else None


@dataclass
class _Cell:
    by_version: dict[str, list[tuple[str, float]]] = field(default_factory=dict)  # version -> (episode id, score)
    open: set[str] = field(default_factory=set)  # its episodes still running: the cell is not compared before they end


class Pairs:
    """Train episodes by (sandbox, task, weights at open) cell, until both versions of an A/B reached one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cells: OrderedDict[Cell, _Cell] = OrderedDict()
        self._newest: dict[str, int] = {}  # model -> newest weights seen
        self.recent: deque[dict] = deque(maxlen=RECENT_PAIRS)

    def opened(self, ep: Episode) -> None:
        """A train episode opened: its cell waits for it (the registry calls this from `open`)."""
        if ep.kind != "train":
            return
        with self._lock:
            self._see(ep)
            self._cells.setdefault(cell_of(ep), _Cell()).open.add(ep.id)

    def ended(self, ep: Episode) -> None:
        """A train episode ended, however (the registry calls this when it closes one): counted in its cell with
        `scored(ep)` when it has a number, else it only stops holding the cell."""
        self.add(ep, scored(ep) if ep.state == "finished" else None)

    def add(self, ep: Episode, score: float | None) -> None:
        """One ended train episode and the number the study reads of it (None: it leaves its cell uncounted)."""
        if ep.kind != "train":
            return
        with self._lock:
            self._see(ep)
            key = cell_of(ep)
            cell = self._cells.get(key)
            if cell is None:
                if score is None:
                    return
                cell = self._cells[key] = _Cell()
            cell.open.discard(ep.id)
            if score is not None:
                cell.by_version.setdefault(ep.client_version or "unknown", []).append((ep.id, score))
            self._forget_old()

    def _see(self, ep: Episode) -> None:
        for model, version in ep.opened_versions.items():
            self._newest[model] = max(self._newest.get(model, version), version)

    def _forget_old(self) -> None:
        """Cells the weights left `CELL_MAX_VERSIONS` behind with no episode still running there: one version
        never reached them, and no episode can open there any more."""
        old = [key for key, cell in self._cells.items() if not cell.open
               and any(self._newest.get(m, v) - v > CELL_MAX_VERSIONS for m, v in key[2])]
        for key in old:
            del self._cells[key]
        if len(self._cells) > CELLS_KEPT:
            idle = [key for key, cell in self._cells.items() if not cell.open]
            for key in idle[: len(self._cells) - CELLS_KEPT]:
                del self._cells[key]

    def take(self) -> dict[str, float]:
        """The pairs completed since the last call, as metrics: per sandbox, each version's mean score over
        them (`ab_metric`) and their count (`ab/<sandbox>/pairs`). Each cell counts once, equally, whatever
        the number of episodes each version ran in it (the versions' unequal shares cancel); a cell with an
        episode still running waits for it."""
        with self._lock:
            done = [(key, cell) for key, cell in self._cells.items() if len(cell.by_version) >= 2 and not cell.open]
            sums: dict[tuple[str, str], list[float]] = {}
            count: dict[str, int] = {}
            for key, cell in done:
                del self._cells[key]
                sandbox, task_id, weights = key
                count[sandbox] = count.get(sandbox, 0) + 1
                for version, scores in cell.by_version.items():
                    sums.setdefault((sandbox, version), []).append(sum(s for _, s in scores) / len(scores))
                self.recent.append({"sandbox": sandbox, "task_id": task_id, "weights": [list(w) for w in weights],
                                    "episodes": {v: [i for i, _ in scores] for v, scores in cell.by_version.items()}})
        out = {ab_metric(sandbox, version): sum(v) / len(v) for (sandbox, version), v in sums.items()}
        out.update({f"ab/{sandbox}/pairs": float(n) for sandbox, n in count.items()})
        return out

    def status(self) -> list[dict]:
        with self._lock:
            return list(self.recent)
