"""Batch assembly: which ready groups make the trainer's next batch, and how stale an episode is.

`assemble` is the pure part of `Registry.take_batch`: it walks the ready groups (oldest first, or by
mix quota through `core.episodes.mix.next_group`), drops episodes generated more than `max_staleness`
weight versions ago, and says which groups the batch trains and which it consumes. It is
deliberately not the registry: it holds no lock, keeps no state and counts nothing; the registry
calls it under its lock and applies the outcome to its books.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.episodes.mix import next_group
from core.records import Episode


@dataclass
class Batch:
    groups: list[list[Episode]]
    dropped_stale: int = 0

    @property
    def episodes(self) -> list[Episode]:
        return [e for g in self.groups for e in g]

    def by_version(self) -> dict[tuple[str, str], list[Episode]]:
        """The batch's episodes by (sandbox, client code version; "unknown" when the client sent none)."""
        out: dict[tuple[str, str], list[Episode]] = {}
        for e in self.episodes:
            out.setdefault((e.sandbox, e.client_version or "unknown"), []).append(e)
        return out


@dataclass
class Assembly:
    """What one `assemble` decided: the groups to train, the ready groups it used up, and the ledger after."""

    groups: list[list[Episode]]  # fresh episodes of each trained group; empty: nothing trains this call
    consumed: list[list[Episode]]  # ready groups (as queued) to take off the ready queue
    dropped: int  # stale episodes dropped
    taken: dict[str, int]  # groups trained per sandbox once this batch trains (the mix quotas' ledger)


def assemble(ready: list[list[Episode]], trained: dict[str, int], batch_groups: int, mix: dict[str, float],
             coming: set[str], current_versions: dict[str, int], max_staleness: int) -> Assembly | None:
    """Plan a batch of `batch_groups` groups from `ready`; None while it waits for a sandbox owed its share.

    `coming`: the sandboxes able to deliver a group soon (`next_group` waits only for those)."""
    candidates, taken = list(ready), dict(trained)
    groups, consumed, stale_whole, dropped = [], [], [], 0
    while candidates and len(groups) < batch_groups:
        group = next_group(candidates, taken, mix, coming)
        if group is None:
            return None  # the plan is dropped, nothing taken: it is made again on the next call
        candidates = [g for g in candidates if g is not group]
        consumed.append(group)
        fresh = [e for e in group if staleness(e, current_versions) <= max_staleness]
        dropped += len(group) - len(fresh)
        if fresh:  # a group dropped whole as stale fills no slot and counts for no quota
            groups.append(fresh)
            taken[group[0].sandbox] = taken.get(group[0].sandbox, 0) + 1
        else:
            stale_whole.append(group)
    if len(groups) < batch_groups:
        # Stale groups left too few fresh ones: drop only the stale, keep the fresh ready for the
        # next call, so that every step trains `batch_groups` groups and none is consumed short.
        consumed, groups = stale_whole, []
        dropped = sum(len(g) for g in stale_whole)
    return Assembly(groups, consumed, dropped, taken)


def staleness(ep: Episode, current: dict[str, int]) -> int:
    """Versions between the oldest weights that generated this episode's tokens and the current ones.

    A call's version is the one that prefilled it (the oldest behind any of its tokens), so an
    episode opened before a weight sync whose calls all ran after it is not stale."""
    oldest: dict[str, int] = {}
    for call in ep.calls:
        oldest[call.model] = min(oldest.get(call.model, call.version), call.version)
    return max((current.get(m, v) - v for m, v in oldest.items()), default=0)
