"""Batch assembly: which ready groups make the trainer's next batch, and how stale an episode is.

`assemble` is the pure part of `Registry.take_batch`: it walks the ready groups (oldest first, or by
mix quota through `core.episodes.mix.next_group`), drops episodes generated more than `max_staleness`
weight versions ago, and says which groups the batch trains and which it consumes. It is
deliberately not the registry: it holds no lock, keeps no state and counts nothing; the registry
calls it under its lock and applies the outcome to its books.

Dynamic sampling (`trainer.dynamic_sampling: filter`, DAPO's): a group whose rewards tie, for every
model it has rewards for, has zero advantage and teaches nothing, so `assemble` takes it off the ready
queue without giving it a slot; the slot stays open for the groups that keep arriving, so a step trains
`batch_groups` groups with signal. `Sieve` is the one piece of state this needs: how many tied groups
were kept out since the last batch (the cap on consecutive refills, `trainer.max_refills`: past it,
tied groups fill slots again and the batch says so) and of which sandboxes, which the batch carries
to the run's metrics (`Batch.metrics`). Filtering happens after an episode finished, so it decides
training only: an A/B cell (`core.episodes.pairing`) has already counted the episode at its finish,
and the batch carries the kept-out episodes (`Batch.kept_out`) to the step's reward metrics, which
count them (`Batch.episodes_scored`): a mean over the trained groups alone would leave out every group
tied at 0 early and at 1 late, and move `reward/mean` by the filter instead of by the policy.

Oversampling (`trainer.oversample`, opt-in under the filter): a refill found only once a tied group has
finished costs a whole extra rollout, one after the other. The sieve keeps the tie rate of the last
`TIE_WINDOW` groups it judged, and `Sieve.extra_groups` turns it into the groups admission control
lets start beyond `batch_groups` per step (`core.episodes.admission`), so the refills expected are
generated beside the batch (DAPO over-samples the same way). What is left over on-policy is stale once
the weights move and is dropped, counted in `episodes/wasted_frac`; with no ties seen, nothing extra.
Which of the extra groups train is whichever finish first, so an oversampled run does not repeat step
for step; and on a CPU, where a decode step's cost grows with its rows, it did not pay
(docs/benchmarks.md): it is off by default.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from core.episodes.mix import next_group
from core.records import Episode


# Oversampling's estimate: the tie rate over this many of the latest groups the sieve judged, about 8 steps of the
# default batch: short enough to follow a task as it learns (a group of 8 at reward 0.1 ties at 0 with p 0.43, at
# 0.3 with p 0.06), long enough that one tied group does not double the room.
TIE_WINDOW = 16
# At most this many extra groups per batch group: room at most doubles, whatever the rate (a task that ties
# nearly always is saturated, which `max_refills` handles; oversampling it would only waste rollouts).
MAX_EXTRA_PER_GROUP = 1


@dataclass
class Batch:
    groups: list[list[Episode]]
    dropped_stale: int = 0
    # Dynamic sampling: tied groups kept out of the trainer since the previous batch, by sandbox, and
    # whether the refill cap let tied groups into this batch.
    filtered: dict[str, int] = field(default_factory=dict)
    capped: bool = False
    sieved: bool = False  # assembled under dynamic sampling
    kept_out: list[Episode] = field(default_factory=list)  # episodes of those tied groups: scored, never trained
    tie_rate: float = 0.0  # the sieve's recent tie rate when it took this batch (oversampling's estimate)

    def metrics(self) -> dict[str, float]:
        """`train/groups_filtered` (DESIGN §3.6: always, 0 without dynamic sampling) and, under it, each
        sandbox's filtered share (of its groups this batch saw) and whether the refill cap was reached."""
        if not self.sieved:
            return {"train/groups_filtered": 0.0}
        trained: dict[str, int] = {}
        for g in self.groups:
            trained[g[0].sandbox] = trained.get(g[0].sandbox, 0) + 1
        out = {"train/groups_filtered": float(sum(self.filtered.values())), "train/filter_capped": float(self.capped),
               "train/tie_rate": self.tie_rate}
        for sandbox in sorted(set(trained) | set(self.filtered)):
            kept_out = self.filtered.get(sandbox, 0)
            out[f"train/{sandbox}/filtered_share"] = kept_out / (kept_out + trained.get(sandbox, 0))
        return out

    @property
    def episodes(self) -> list[Episode]:
        """The episodes the trainer gets."""
        return [e for g in self.groups for e in g]

    @property
    def episodes_scored(self) -> list[Episode]:
        """Every finished episode this batch consumed, trained or kept out as tied (a tied group whole,
        with any stale episode of it): what its step's reward metrics count, so that dynamic sampling
        decides training, never scoring."""
        return self.episodes + self.kept_out

    def put_in_stable_order(self) -> None:
        """Order the batch by what its episodes are, not by when they finished: groups by (sandbox, task, code
        version), episodes by ordinal, kept-out episodes likewise. Float sums over a batch (reward/mean, the
        gradient) depend on the order of their terms, so a run that repeats its episodes
        (`engine.repeatable_sampling`) then logs the same rewards and feeds its trainer the same samples.
        Two groups of one task in one batch (a task list shorter than the groups in flight deals a task
        again before its first group has finished) are cut again from their episodes in ordinal order: which
        finished episode joined which group was timing. (A cut may make a tied group: it trains with zero
        advantage.)"""
        by_group: dict[tuple[str, str, str], list[list[Episode]]] = {}
        for g in self.groups:
            by_group.setdefault(g[0].train_group, []).append(g)
        self.groups = []
        for key in sorted(by_group):
            same = by_group[key]
            episodes = sorted((e for g in same for e in g), key=lambda e: e.ordinal)
            for size in sorted(len(g) for g in same):
                self.groups.append(episodes[:size])
                episodes = episodes[size:]
        self.kept_out = sorted(self.kept_out, key=lambda e: (e.sandbox, e.task_id, e.ordinal))

    def by_version(self) -> dict[tuple[str, str], list[Episode]]:
        """The batch's scored episodes by (sandbox, client code version; "unknown" when the client sent none)."""
        out: dict[tuple[str, str], list[Episode]] = {}
        for e in self.episodes_scored:
            out.setdefault((e.sandbox, e.client_version or "unknown"), []).append(e)
        return out


@dataclass
class Assembly:
    """What one `assemble` decided: the groups to train, the ready groups it used up, and the ledger after."""

    groups: list[list[Episode]]  # fresh episodes of each trained group; empty: nothing trains this call
    consumed: list[list[Episode]]  # ready groups (as queued) to take off the ready queue
    dropped: int  # stale episodes dropped
    taken: dict[str, int]  # groups trained per sandbox once this batch trains (the mix quotas' ledger)
    filtered: list[list[Episode]] = field(default_factory=list)  # tied groups kept out (also in `consumed`)
    capped: bool = False  # the refill cap was reached: tied groups took slots


class Sieve:
    """Dynamic sampling's state across `assemble` calls: tied groups kept out since the last batch.

    `tied` says whether a group has no signal; `record` applies an assembly's outcome (the registry
    calls it with the plan it applies, so a plan that is dropped changes nothing); `take` hands the
    count to the batch that trains and starts a new run of refills."""

    def __init__(self, tolerance: float, max_refills: int, oversample: bool = False):
        self.tolerance = tolerance
        self.max_refills = max_refills
        self.oversample = oversample
        self.recent: deque[bool] = deque(maxlen=TIE_WINDOW)  # whether each of the latest groups judged tied
        self.filtered: dict[str, int] = {}  # sandbox -> tied groups kept out since the last batch
        self.kept_out: list[Episode] = []  # their episodes, for the next batch's reward metrics

    @property
    def refills(self) -> int:
        return sum(self.filtered.values())

    def tied(self, group: list[Episode]) -> bool:
        """No model can learn from it: for each model with rewards, they lie within `tolerance` of each other."""
        rewards: dict[str, list[float]] = {}
        for e in group:
            for model, r in (e.reward or {}).items():
                rewards.setdefault(model, []).append(r)
        return all(max(rs) - min(rs) <= self.tolerance for rs in rewards.values())

    def record(self, plan: Assembly) -> None:
        for g in plan.filtered:
            self.filtered[g[0].sandbox] = self.filtered.get(g[0].sandbox, 0) + 1
            self.kept_out.extend(g)
            self.recent.append(True)
        # A batch's groups are judged once, when it forms (a short plan leaves them ready, to be seen again).
        self.recent.extend(self.tied(g) for g in plan.groups)

    @property
    def tie_rate(self) -> float:
        return sum(self.recent) / len(self.recent) if self.recent else 0.0

    def extra_groups(self, batch_groups: int) -> int:
        """Groups a step may start beyond `batch_groups` (oversampling): as many as the recent tie rate p says
        will tie, batch_groups * p / (1 - p), rounded up, at most `MAX_EXTRA_PER_GROUP` per batch group."""
        most = MAX_EXTRA_PER_GROUP * batch_groups
        rate = self.tie_rate
        if not self.oversample or rate == 0.0:
            return 0
        return most if rate >= 1.0 else min(most, math.ceil(batch_groups * rate / (1.0 - rate) - 1e-9))

    def take(self, batch: Batch, capped: bool) -> Batch:
        batch.filtered, batch.capped, batch.sieved, self.filtered = self.filtered, capped, True, {}
        batch.kept_out, self.kept_out, batch.tie_rate = self.kept_out, [], self.tie_rate
        return batch


def assemble(ready: list[list[Episode]], trained: dict[str, int], batch_groups: int, mix: dict[str, float],
             coming: set[str], current_versions: dict[str, int], max_staleness: int,
             sieve: Sieve | None = None) -> Assembly | None:
    """Plan a batch of `batch_groups` groups from `ready`; None while it waits for a sandbox owed its share.

    `coming`: the sandboxes able to deliver a group soon (`next_group` waits only for those).
    `sieve`: dynamic sampling; a tied group is consumed without a slot until `sieve.max_refills`
    tied groups have been kept out in a row (it reads the sieve, `Sieve.record` applies the plan)."""
    candidates, taken = list(ready), dict(trained)
    groups, consumed, stale_whole, filtered, dropped, capped = [], [], [], [], 0, False
    while candidates and len(groups) < batch_groups:
        group = next_group(candidates, taken, mix, coming)
        if group is None:
            return None  # the plan is dropped, nothing taken: it is made again on the next call
        candidates = [g for g in candidates if g is not group]
        consumed.append(group)
        fresh = [e for e in group if staleness(e, current_versions) <= max_staleness]
        dropped += len(group) - len(fresh)
        if fresh and sieve is not None and sieve.tied(fresh):
            if sieve.refills + len(filtered) < sieve.max_refills:
                filtered.append(group)  # consumed, no slot, no quota: the slot waits for a group with signal
                dropped -= len(group) - len(fresh)  # its stale episodes are filtered with it, not counted stale
                continue
            capped = True
        if fresh:  # a group dropped whole as stale fills no slot and counts for no quota
            groups.append(fresh)
            taken[group[0].sandbox] = taken.get(group[0].sandbox, 0) + 1
        else:
            stale_whole.append(group)
    if len(groups) < batch_groups:
        # Stale groups left too few fresh ones: drop only the stale, keep the fresh ready for the
        # next call, so that every step trains `batch_groups` groups and none is consumed short.
        # Filtered groups go either way: they never train.
        consumed, groups = stale_whole + filtered, []
        dropped = sum(len(g) for g in stale_whole)
    return Assembly(groups, consumed, dropped, taken, filtered, capped)


def staleness(ep: Episode, current: dict[str, int]) -> int:
    """Versions between the oldest weights that generated this episode's tokens and the current ones.

    A call's version is the one that prefilled it (the oldest behind any of its tokens), so an
    episode opened before a weight sync whose calls all ran after it is not stale."""
    oldest: dict[str, int] = {}
    for call in ep.calls:
        oldest[call.model] = min(oldest.get(call.model, call.version), call.version)
    return max((current.get(m, v) - v for m, v in oldest.items()), default=0)
