"""Mix quotas as arithmetic: which group fills the next batch slot, and a sandbox's share of the room.

`mix` maps sandbox names to weights (`clients[].mix` of the train clients). The registry
(`core.episodes.registry`) holds the state and the lock and asks these two functions; they keep no state,
read no clock and know nothing of episodes beyond the sandbox each group belongs to.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from core.records import Episode


def next_group(candidates: Sequence[list[Episode]], taken: dict[str, int], mix: dict[str, float],
               coming: set[str]) -> list[Episode] | None:
    """The next group for a batch, from `candidates` (ready groups, oldest first).

    Without a mix of two or more, or for a sandbox outside it, the oldest group (arrival order). With
    one, the oldest group of the sandbox furthest below its share of `taken` (groups trained so far,
    this batch's included) once this slot is filled; ties keep config order. None when that sandbox
    has no ready group but one `coming`: waiting keeps every sandbox within one group of its share.
    A sandbox neither ready nor coming is skipped."""
    oldest = candidates[0]
    if len(mix) < 2 or oldest[0].sandbox not in mix:
        return oldest
    total, weight = sum(taken.get(s, 0) for s in mix), sum(mix.values())
    owed = sorted(mix, key=lambda s: taken.get(s, 0) - mix[s] / weight * (total + 1))
    for sandbox in owed:
        mine = next((g for g in candidates if g[0].sandbox == sandbox), None)
        if mine is not None:
            return mine
        if sandbox in coming:
            return None
    return oldest


def active_share(sandbox: str, mix: dict[str, float], active: set[str]) -> float:
    """`sandbox`'s share of the mix among the `active` sandboxes (itself included): a sandbox whose
    clients went silent (all dead, or drained) holds no share the others must leave free for it."""
    return mix[sandbox] / sum(mix[s] for s in active | {sandbox} if s in mix)


def room_share(sandbox: str, mix: dict[str, float], active: set[str], room: int) -> tuple[float, int]:
    """(share, groups): `sandbox`'s active share and the groups of `room` that share allows, at least
    one, so every active sandbox can always start one."""
    share = active_share(sandbox, mix, active)
    return share, max(1, math.ceil(share * room))
