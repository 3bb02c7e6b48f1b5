"""An A/B's books: the same tasks for both code versions, and their scores compared only on the same weights.

While `swarm swap --ab` keeps two code versions of a sandbox serving side by side (the client table,
`core.episodes.client_table`, says which clients lead and which one follows), two things make their comparison
one of code alone:

- `TaskPairing`: every train episode a leader (an old-version client) opens leaves a debt, its task, and
  the follower (the new version's client) opens nothing but those debts, first come first served. So each
  task drawn goes to both versions, at about the same moment, hence mostly on the same weights. A debt
  left unpaid for `DEBT_MAX_VERSIONS` weight versions is dropped: it could no longer pair.
- `Pairs`: trained episodes fall into cells (sandbox, task id, weights they ran on); a cell that both
  versions reached is a compared pair, each version scored by its mean over its episodes there (the
  number a study reads: the judge's score when the sandbox is judged, else the reward). Per trainer step, the pairs
  completed since the last step give each version's mean under `core.config.ab_metric`: both means
  are over the same cells, so their difference holds neither task mix nor weights, only code.

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


Cell = tuple[str, str, tuple]  # (sandbox, task id, Episode.weights)


@dataclass
class _Cell:
    by_version: dict[str, list[tuple[str, float]]] = field(default_factory=dict)  # version -> (episode id, score)


class Pairs:
    """Finished train episodes by (sandbox, task, weights) cell, until both versions of an A/B reached one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cells: OrderedDict[Cell, _Cell] = OrderedDict()
        self._newest: dict[str, int] = {}  # model -> newest weights seen
        self.recent: deque[dict] = deque(maxlen=RECENT_PAIRS)

    def add(self, ep: Episode, score: float | None) -> None:
        """One finished train episode and the number the study reads of it (`core.run.scores.scored`)."""
        if ep.kind != "train" or score is None:
            return
        with self._lock:
            weights = ep.weights
            for model, _oldest, newest in weights:
                self._newest[model] = max(self._newest.get(model, newest), newest)
            cell = self._cells.setdefault((ep.sandbox, ep.task_id, weights), _Cell())
            cell.by_version.setdefault(ep.client_version or "unknown", []).append((ep.id, score))
            self._forget_old()

    def _forget_old(self) -> None:
        old = [key for key in self._cells
               if any(self._newest.get(m, v) - v > CELL_MAX_VERSIONS for m, v, _ in key[2])]
        for key in old:
            del self._cells[key]

    def take(self) -> dict[str, float]:
        """The pairs completed since the last call, as metrics: per sandbox, each version's mean score over
        them (`ab_metric`) and their count (`ab/<sandbox>/pairs`). Each cell counts once, equally, whatever
        the number of episodes each version ran in it (the versions' unequal shares cancel)."""
        with self._lock:
            done = [(key, cell) for key, cell in self._cells.items() if len(cell.by_version) >= 2]
            sums: dict[tuple[str, str], list[float]] = {}
            count: dict[str, int] = {}
            for key, cell in done:
                del self._cells[key]
                sandbox, task_id, weights = key
                count[sandbox] = count.get(sandbox, 0) + 1
                for version, scored in cell.by_version.items():
                    sums.setdefault((sandbox, version), []).append(sum(s for _, s in scored) / len(scored))
                self.recent.append({"sandbox": sandbox, "task_id": task_id, "weights": [list(w) for w in weights],
                                    "episodes": {v: [i for i, _ in scored] for v, scored in cell.by_version.items()}})
        out = {ab_metric(sandbox, version): sum(v) / len(v) for (sandbox, version), v in sums.items()}
        out.update({f"ab/{sandbox}/pairs": float(n) for sandbox, n in count.items()})
        return out

    def status(self) -> list[dict]:
        with self._lock:
            return list(self.recent)
