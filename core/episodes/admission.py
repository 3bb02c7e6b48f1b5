"""Admission control, mix shares and back-pressure: whether the registry may open a new train episode now.

Admission control (on once a trainer calls `admit_within`) keeps generation from being wasted: an
episode that starts a new group is refused while the groups already started would fill every step
the staleness budget allows, `max_staleness + 1` steps, one fewer while an overlapped step is
between taking its batch and its weight sync. An episode that completes a started group is always
admitted, so a partial group can never block the trainer. Each active sandbox (one that tried to
open within a lease) gets its share of that room, so a fast sandbox cannot fill the budget the
trainer is waiting on another one to use.

Back-pressure: clients that outrun the trainer (more than `READY_FACTOR` batches of ready groups)
wait, and so does a sandbox above its mix share of what is buffered and in flight.

`Admission` is a mix-in of `core.episodes.registry.Registry`: it reads the registry's books under the
registry's lock and answers with a `core.episodes.errors.Refusal` (always a 503 with Retry-After: code `backpressure`, `mix_quota` or `admission`) or None. It keeps no
books of its own beyond the admission settings, and it never opens, closes or trains an episode.
"""

from __future__ import annotations

import math

from core.episodes.errors import Refusal
from core.episodes.mix import active_share, room_share

READY_FACTOR = 2  # more than this many batches of ready groups waiting means clients outrun the trainer
# Seconds a refused open is told to wait: about one short train step; HTTP allows whole seconds only.
ADMISSION_RETRY_S = 1.0
BACKPRESSURE_RETRY_S = 0.5  # the trainer is taking a batch soon: a short wait is enough


class Admission:
    """The registry's admission rules (a mix-in: the books it reads are `core.episodes.registry.Registry`'s)."""

    max_staleness: int | None = None  # None: no admission control (no trainer consumes steps)
    _overlapped_steps = 0  # steps that took their batch while generation goes on, not yet synced
    training_over: str | None = None  # why no trainer will take another batch (None: one may)

    def end_training(self, reason: str) -> None:
        """No trainer will consume another batch: new train episodes are refused for good (409), not
        left to wait on back-pressure that can never ease; eval and debug episodes still open."""
        with self._lock:
            self.training_over = reason

    def admit_within(self, max_staleness: int) -> None:
        """Turn admission control on, for a trainer that drops episodes older than `max_staleness`."""
        with self._lock:
            self.max_staleness = max_staleness

    def step_started(self) -> None:
        """An overlapped step took its batch: episodes generated now will be one version old at once."""
        with self._lock:
            self._overlapped_steps += 1

    def step_synced(self) -> None:
        with self._lock:
            self._overlapped_steps = max(0, self._overlapped_steps - 1)

    def note_refused(self) -> None:
        """Count an open that admission control finally refused (after any wait for room)."""
        with self._lock:
            self.counters["refused"] += 1

    def _quota_refusal(self, sandbox: str) -> Refusal | None:
        """Back-pressure: clients that outrun the trainer, or a sandbox above its mix share, wait."""
        buffered = sum(len(g) for g in self._ready)
        capacity = READY_FACTOR * self.batch_groups * self.default_group_size
        mixed = len(self.mix) >= 2 and sandbox in self.mix
        # With a mix, a sandbox with no ready group is not outrunning the trainer: the next batch may
        # be waiting for it (quotas in `take_batch`).
        owed = mixed and not any(g[0].sandbox == sandbox for g in self._ready)
        if len(self._ready) >= READY_FACTOR * self.batch_groups and not owed:
            return Refusal(503, "the trainer is behind; retry shortly", "backpressure", BACKPRESSURE_RETRY_S)
        if not mixed:
            return None
        # The share among the sandboxes still trying to open: held to its share of a mix partner that
        # went silent, a sandbox would wait on a batch that no longer waits for that partner.
        share = active_share(sandbox, self.mix, self._active_sandboxes())
        mine = sum(1 for e in self._open.values() if e.sandbox == sandbox and e.kind == "train")
        mine += sum(len(g) for g in self._ready if g[0].sandbox == sandbox)
        mine += sum(len(g) for k, g in self._filling.items() if k[0] == sandbox)
        total = buffered + sum(1 for e in self._open.values() if e.kind == "train")
        total += sum(len(g) for g in self._filling.values())
        if mine >= math.ceil(share * max(total, capacity)) + self.default_group_size:
            return Refusal(503, f"sandbox {sandbox!r} is above its mix share", "mix_quota", BACKPRESSURE_RETRY_S)
        return None

    def _admission_refusal(self, sandbox: str, task_id: str, group_size: int, version: str = "") -> Refusal | None:
        """`version`: the opening client's code version, part of its group's key (`Episode.train_group`)."""
        if self.max_staleness is None:
            return None
        started = self._started_groups()
        if started.get((sandbox, task_id, version), (0, group_size))[0] % group_size:
            return None  # completes a started group
        return self._no_room(sandbox, started)

    def _no_room(self, sandbox: str, started: dict[tuple[str, str, str], tuple[int, int]]) -> Refusal | None:
        """Why admission control would refuse a new group of `sandbox` now (None: there is room)."""
        if self.max_staleness is None:
            return None
        groups = len(self._ready) + sum(math.ceil(n / k_size) for n, k_size in started.values())
        budget = self.batch_groups * (self.max_staleness + 1 - self._overlapped_steps)
        if groups >= budget:
            return Refusal(503, f"{groups} groups already fill the next {self.max_staleness + 1} steps; "
                           "retry after the weight sync", "admission", ADMISSION_RETRY_S)
        if len(self.mix) < 2 or sandbox not in self.mix:
            return None
        # Each active sandbox gets its share of the room (at least one group), so the groups the
        # quotas of `take_batch` wait for can always start.
        share, allowed = room_share(sandbox, self.mix, self._active_sandboxes(), budget)
        mine = sum(1 for g in self._ready if g[0].sandbox == sandbox)
        mine += sum(math.ceil(n / k_size) for key, (n, k_size) in started.items() if key[0] == sandbox)
        if mine >= allowed:
            return Refusal(503, f"sandbox {sandbox!r} holds {mine} groups, its {share:.0%} mix share of the "
                           f"{budget} the next steps can train; retry after the weight sync", "admission",
                           ADMISSION_RETRY_S)
        return None

    def _active_sandboxes(self) -> set[str]:
        """Sandboxes whose clients asked to open a train episode within the last lease."""
        since = self.clock() - self.lease_s
        return {sandbox for sandbox, t in self._seen.items() if t > since}

    def _started_groups(self) -> dict[tuple[str, str, str], tuple[int, int]]:
        """Train groups under way (open episodes, or finished ones in a group still filling): key -> (episodes, size)."""
        started: dict[tuple[str, str, str], tuple[int, int]] = {}
        for e in self._open.values():
            if e.kind == "train":
                started[e.train_group] = (started.get(e.train_group, (0, 0))[0] + 1, e.group_size)
        abandoned_before = self.clock() - self.lease_s
        for key, group in self._filling.items():
            # A partial group nobody touched for a lease is abandoned: it stops holding a slot.
            if key in started or max(e.ended_at or 0.0 for e in group) > abandoned_before:
                started[key] = (started.get(key, (0, 0))[0] + len(group), group[0].group_size)
        return started
