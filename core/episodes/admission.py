"""Admission control, mix shares and back-pressure: whether the registry may open a new train episode now.

Admission control (on once a trainer calls `admit_within`) keeps generation from being wasted: an
episode that starts a new group is refused while the groups already started would fill every step
the staleness budget allows, `max_staleness + 1` steps, one fewer while an overlapped step is
between taking its batch and its weight sync; a step's worth is `batch_groups`, plus the extra groups
dynamic sampling's oversampling expects to tie (`extra_groups`, from `core.episodes.batching.Sieve`).
An episode that completes a started group is always admitted, so a partial group can never block the
trainer. Each active sandbox (one that tried to open within a lease) gets its share of that room, so
a fast sandbox cannot fill the budget the trainer is waiting on another one to use.

Back-pressure: clients that outrun the trainer (more than `READY_FACTOR` batches of ready groups)
wait, and so does a sandbox above its mix share of what is buffered and in flight.

`Admission` is an object of its own, owned by `core.episodes.registry.Registry` and called only under
the registry's lock: it holds what admission alone needs (the staleness budget, the overlapped steps,
whether training is over, when each sandbox last asked to open) and reads the registry's episodes
through a `Pool` the registry hands it on each call. It answers with a `core.episodes.errors.Refusal`
(a 409 `training_over` once no trainer will take another batch; a 503 with Retry-After: code
`backpressure`, `mix_quota` or `admission`) or None; it never opens, closes or trains an episode, and
keeps no lock of its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from core.episodes.errors import Refusal
from core.episodes.mix import active_share, room_share
from core.records import Episode

READY_FACTOR = 2  # more than this many batches of ready groups waiting means clients outrun the trainer
# Seconds a refused open is told to wait: about one short train step; HTTP allows whole seconds only.
ADMISSION_RETRY_S = 1.0
BACKPRESSURE_RETRY_S = 0.5  # the trainer is taking a batch soon: a short wait is enough


GroupKey = tuple[str, str, str]  # `Episode.train_group`: (sandbox, task id, client code version)


@dataclass(frozen=True)
class Pool:
    """The registry's train episodes as admission reads them: open, in ready groups, in groups still filling."""

    open: Iterable[Episode]
    ready: Sequence[list[Episode]]
    filling: Mapping[GroupKey, list[Episode]]

    def open_train(self) -> list[Episode]:
        return [e for e in self.open if e.kind == "train"]


class Admission:
    """Whether a train episode may open now. Not thread-safe: the registry calls it under its lock."""

    def __init__(self, batch_groups: int, default_group_size: int, mix: Mapping[str, float], lease_s: float,
                 clock: Callable[[], float]):
        self.batch_groups, self.default_group_size, self.mix = batch_groups, default_group_size, dict(mix)
        self.lease_s, self.clock = lease_s, clock
        self.max_staleness: int | None = None  # None: no admission control (no trainer consumes steps)
        self.overlapped_steps = 0  # steps that took their batch while generation goes on, not yet synced
        self.extra_groups = 0  # oversampling: groups a step may start beyond batch_groups (set by the registry)
        self.training_over: str | None = None  # why no trainer will take another batch (None: one may)
        # sandbox -> its last train open attempt (who shares room, who a batch waits for). A mix sandbox asks from
        # the start for one lease: batches taken before its clients register would give its share away for good.
        self.seen: dict[str, float] = dict.fromkeys(self.mix, clock())

    def asked(self, sandbox: str) -> None:
        """A train open of `sandbox` was attempted (a refused one counts: it wants room)."""
        self.seen[sandbox] = self.clock()

    def refusal(self, pool: Pool, sandbox: str, task_id: str, group_size: int, version: str) -> Refusal | None:
        """Why a train episode of (sandbox, task_id, version) may not open now; None: it may.
        `version`: the opening client's code version, part of its group's key (`Episode.train_group`)."""
        if self.training_over is not None:
            return Refusal(409, f"this server takes no more train episodes: {self.training_over}; open kind eval or "
                                "debug episodes, or start a run with more trainer.steps", "training_over")
        return self._quota_refusal(pool, sandbox) or self._admission_refusal(pool, sandbox, task_id, group_size, version)

    def coming(self, pool: Pool) -> set[str]:
        """Sandboxes able to deliver a group soon: one under way, or a client that asked to open within a lease
        (it may be between two episodes) and would be admitted (waiting on a sandbox the full room keeps out
        would never end). A dead client stops asking."""
        started = self._started_groups(pool)
        return {key[0] for key in started} | {s for s in self.active() if self._no_room(pool, s, started) is None}

    def active(self) -> set[str]:
        """Sandboxes whose clients asked to open a train episode within the last lease."""
        since = self.clock() - self.lease_s
        return {sandbox for sandbox, t in self.seen.items() if t > since}

    def _quota_refusal(self, pool: Pool, sandbox: str) -> Refusal | None:
        """Back-pressure: clients that outrun the trainer, or a sandbox above its mix share, wait."""
        ready, filling = pool.ready, pool.filling
        buffered = sum(len(g) for g in ready)
        capacity = READY_FACTOR * self.batch_groups * self.default_group_size
        mixed = len(self.mix) >= 2 and sandbox in self.mix
        # With a mix, a sandbox with no ready group is not outrunning the trainer: the next batch may
        # be waiting for it (quotas in `take_batch`).
        owed = mixed and not any(g[0].sandbox == sandbox for g in ready)
        if len(ready) >= READY_FACTOR * self.batch_groups and not owed:
            return Refusal(503, "the trainer is behind; retry shortly", "backpressure", BACKPRESSURE_RETRY_S)
        if not mixed:
            return None
        # The share among the sandboxes still trying to open: held to its share of a mix partner that
        # went silent, a sandbox would wait on a batch that no longer waits for that partner.
        share = active_share(sandbox, self.mix, self.active())
        open_train = pool.open_train()
        mine = sum(1 for e in open_train if e.sandbox == sandbox)
        mine += sum(len(g) for g in ready if g[0].sandbox == sandbox)
        mine += sum(len(g) for k, g in filling.items() if k[0] == sandbox)
        total = buffered + len(open_train) + sum(len(g) for g in filling.values())
        if mine >= math.ceil(share * max(total, capacity)) + self.default_group_size:
            return Refusal(503, f"sandbox {sandbox!r} is above its mix share", "mix_quota", BACKPRESSURE_RETRY_S)
        return None

    def _admission_refusal(self, pool: Pool, sandbox: str, task_id: str, group_size: int,
                           version: str) -> Refusal | None:
        if self.max_staleness is None:
            return None
        started = self._started_groups(pool)
        if started.get((sandbox, task_id, version), (0, group_size))[0] % group_size:
            return None  # completes a started group
        return self._no_room(pool, sandbox, started)

    def _no_room(self, pool: Pool, sandbox: str, started: dict[GroupKey, tuple[int, int]]) -> Refusal | None:
        """Why admission control would refuse a new group of `sandbox` now (None: there is room)."""
        if self.max_staleness is None:
            return None
        groups = len(pool.ready) + sum(math.ceil(n / k_size) for n, k_size in started.values())
        budget = (self.batch_groups + self.extra_groups) * (self.max_staleness + 1 - self.overlapped_steps)
        if groups >= budget:
            return Refusal(503, f"{groups} groups already fill the next {self.max_staleness + 1} steps; "
                           "retry after the weight sync", "admission", ADMISSION_RETRY_S)
        if len(self.mix) < 2 or sandbox not in self.mix:
            return None
        # Each active sandbox gets its share of the room (at least one group), so the groups the
        # quotas of `take_batch` wait for can always start.
        share, allowed = room_share(sandbox, self.mix, self.active(), budget)
        mine = sum(1 for g in pool.ready if g[0].sandbox == sandbox)
        mine += sum(math.ceil(n / k_size) for key, (n, k_size) in started.items() if key[0] == sandbox)
        if mine >= allowed:
            return Refusal(503, f"sandbox {sandbox!r} holds {mine} groups, its {share:.0%} mix share of the "
                           f"{budget} the next steps can train; retry after the weight sync", "admission",
                           ADMISSION_RETRY_S)
        return None

    def _started_groups(self, pool: Pool) -> dict[GroupKey, tuple[int, int]]:
        """Train groups under way (open episodes, or finished ones in a group still filling): key -> (episodes, size)."""
        started: dict[GroupKey, tuple[int, int]] = {}
        for e in pool.open_train():
            started[e.train_group] = (started.get(e.train_group, (0, 0))[0] + 1, e.group_size)
        abandoned_before = self.clock() - self.lease_s
        for key, group in pool.filling.items():
            # A partial group nobody touched for a lease is abandoned: it stops holding a slot.
            if key in started or max(e.ended_at or 0.0 for e in group) > abandoned_before:
                started[key] = (started.get(key, (0, 0))[0] + len(group), group[0].group_size)
        return started
