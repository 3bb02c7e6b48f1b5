"""The registry's finished episodes until the trainer takes them: train groups filling and ready, eval episodes, the mix quotas' ledger.

A finished train episode joins its group, keyed by `Episode.train_group` (sandbox, task, client code
version: an A/B never mixes versions in a group); a group with `group_size` finished episodes is ready.
A train step takes a batch of ready groups (`take`): which ones is `core.episodes.batching.assemble`'s
pure function (mix quotas, staleness, dynamic sampling's `Sieve`); this applies its outcome to the
queue, the ledger and the registry's books. Finished eval episodes wait for the trainer's metrics, the
oldest dropped past `EVAL_KEPT`. A checkpoint keeps what is buffered (`buffered`) and puts it back
(`restore`).

`GroupBuffer` is an object of its own, owned by `core.episodes.registry.Registry` and called only under
the registry's lock, as `Admission` is: it keeps no lock, and never opens, ends or leases an episode.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from core.episodes.admission import GroupKey
from core.episodes.batching import Batch, Sieve, assemble
from core.episodes.books import Books
from core.records import Episode

# Finished eval episodes kept for the trainer's metrics: a server without a trainer never takes them,
# so the oldest go first rather than growing for as long as the server lives.
EVAL_KEPT = 10_000


class GroupBuffer:
    """Finished episodes waiting for the trainer. Not thread-safe: the registry calls it under its lock."""

    def __init__(self, batch_groups: int, mix: Mapping[str, float]):
        self.batch_groups, self.mix = batch_groups, dict(mix)
        self.filling: dict[GroupKey, list[Episode]] = {}  # Episode.train_group -> its finished episodes
        self.ready: deque[list[Episode]] = deque()
        self.finished_eval: deque[Episode] = deque(maxlen=EVAL_KEPT)
        self.trained: dict[str, int] = {}  # sandbox -> groups trained so far: the mix quotas' ledger

    def add(self, ep: Episode) -> None:
        """A finished episode where it goes: its group (train), the eval list, or nowhere (debug)."""
        if ep.kind == "train":
            group = self.filling.setdefault(ep.train_group, [])
            group.append(ep)
            if len(group) >= ep.group_size:
                self.ready.append(self.filling.pop(ep.train_group))
        elif ep.kind == "eval":
            self.finished_eval.append(ep)

    def take(self, coming: set[str], current_versions: dict[str, int], max_staleness: int, sieve: Sieve | None,
             books: Books) -> Batch | None:
        """The next batch (`Registry.take_batch`), its episodes counted in `books`; None while it waits.
        `coming`: the sandboxes able to deliver a group soon (`Admission.coming`)."""
        plan = assemble(list(self.ready), self.trained, self.batch_groups, self.mix, coming,
                        current_versions, max_staleness, sieve)
        if plan is None:
            return None  # the plan is dropped, nothing taken: it is made again on the next call
        groups, consumed, dropped = plan.groups, plan.consumed, plan.dropped
        if sieve is not None:
            sieve.record(plan)
        gone = {id(g) for g in consumed}
        self.ready = deque(g for g in self.ready if id(g) not in gone)
        if groups:
            self.trained = plan.taken
        # A group dynamic sampling kept out was taken by a batch too: it leaves the buffer, never to train.
        books.trained += sum(len(g) for g in groups) + sum(len(g) for g in plan.filtered)
        books.stale += dropped
        books.wasted += dropped
        if not groups:
            return None
        batch = Batch(groups, dropped)
        return sieve.take(batch, plan.capped) if sieve is not None else batch

    def take_eval(self) -> list[Episode]:
        done = list(self.finished_eval)
        self.finished_eval.clear()
        return done

    def buffered(self) -> list[list[Episode]]:
        """Finished but untrained episodes, by group: what a checkpoint must keep."""
        return [list(g) for g in self.ready] + [list(g) for g in self.filling.values()]

    def restore(self, groups: list[list[Episode]]) -> int:
        """Put a checkpoint's `buffered` groups back -> how many episodes came back."""
        for group in groups:
            if group and len(group) >= group[0].group_size:
                self.ready.append(group)
            elif group:
                self.filling[group[0].train_group] = group
        return sum(len(g) for g in groups)

    def status(self) -> dict[str, int]:
        return {"ready_groups": len(self.ready), "filling_groups": len(self.filling),
                "buffered_episodes": sum(len(g) for g in self.ready) + sum(len(g) for g in self.filling.values())}
