"""Dynamic sampling in batch assembly (`trainer.dynamic_sampling: filter`): a tied group never reaches the
trainer, its slot is refilled from the groups that arrive after it, a cap on refills keeps a saturated
task from stalling the run, the batch reports what was kept out per sandbox, and the step's reward
counts the kept-out episodes (filtering decides training, never scoring)."""

from __future__ import annotations

import itertools

import pytest

from core.config_io import load_config
from core.episodes.batching import Batch, Sieve, assemble
from core.episodes.errors import Refusal
from core.episodes.registry import Registry
from core.episodes.wire import OpenEpisode
from core.records import Call, Episode
from core.run.rollout_metrics import RolloutMeter
from core.serve.server import Server

_ids = itertools.count()


def group(rewards: list[float], sandbox: str = "s", version: int = 0) -> list[Episode]:
    task = f"t{next(_ids)}"
    return [Episode(id=f"{task}-{i}", sandbox=sandbox, task_id=task, group_size=len(rewards), state="finished",
                    opened_at=0.0, lease_expires_at=60.0, reward={"policy": r},
                    calls=[Call(model="policy", version=version, prompt_ids=[1], completion_ids=[2],
                                completion_logprobs=[-0.1])])
            for i, r in enumerate(rewards)]


class Queue:
    """The registry's part, as it applies a plan: the ready queue, the quota ledger and the sieve."""

    def __init__(self, batch_groups: int, sieve: Sieve | None):
        self.ready: list[list[Episode]] = []
        self.trained: dict[str, int] = {}
        self.batch_groups, self.sieve = batch_groups, sieve

    def take(self) -> Batch | None:
        plan = assemble(list(self.ready), self.trained, self.batch_groups, {}, set(), {"policy": 0}, 0, self.sieve)
        assert plan is not None  # no mix: it never waits for a sandbox
        gone = {id(g) for g in plan.consumed}
        self.ready = [g for g in self.ready if id(g) not in gone]
        if self.sieve is not None:
            self.sieve.record(plan)
        if not plan.groups:
            return None
        self.trained = plan.taken
        batch = Batch(plan.groups, plan.dropped)
        return self.sieve.take(batch, plan.capped) if self.sieve is not None else batch


def test_a_tied_group_never_reaches_the_trainer_and_its_slot_is_refilled_by_a_later_group():
    queue = Queue(batch_groups=2, sieve=Sieve(tolerance=1e-6, max_refills=8))
    signal, tied, later = group([1.0, 0.0]), group([1.0, 1.0 + 1e-9]), group([0.0, 1.0])
    queue.ready += [signal, tied]
    assert queue.take() is None  # one slot with signal: the step waits, the tied group is gone
    assert queue.ready == [signal]
    queue.ready.append(later)
    batch = queue.take()
    assert batch is not None and batch.groups == [signal, later]
    assert all(g is not tied for g in batch.groups)
    assert batch.kept_out == tied and batch.episodes_scored == signal + later + tied  # scored, not trained
    assert batch.metrics() == {"train/groups_filtered": 1.0, "train/filter_capped": 0.0,
                               "train/s/filtered_share": pytest.approx(1 / 3), "train/tie_rate": pytest.approx(1 / 3)}


def test_without_the_filter_a_tied_group_takes_a_slot():
    queue = Queue(batch_groups=2, sieve=None)
    signal, tied = group([1.0, 0.0]), group([1.0, 1.0])
    queue.ready += [signal, tied]
    batch = queue.take()
    assert batch is not None and batch.groups == [signal, tied]
    assert batch.metrics() == {"train/groups_filtered": 0.0}


def test_after_max_refills_tied_groups_in_a_row_the_batch_trains_what_it_has_and_says_so():
    queue = Queue(batch_groups=2, sieve=Sieve(tolerance=1e-6, max_refills=3))
    tied = [group([0.0, 0.0]) for _ in range(5)]
    queue.ready += tied
    batch = queue.take()
    assert batch is not None and batch.groups == tied[3:5]  # three kept out, then the cap
    assert batch.capped and batch.metrics()["train/groups_filtered"] == 3.0
    queue.ready += [group([1.0, 1.0])]
    assert queue.take() is None  # a new run of refills starts after a batch


def test_the_filtered_share_is_per_sandbox_and_a_group_ties_only_if_every_models_rewards_tie():
    sieve = Sieve(tolerance=0.01, max_refills=8)
    two_models = group([1.0, 1.0])
    two_models[1].reward = {"policy": 1.0, "judge": 0.5}
    two_models[0].reward = {"policy": 1.0, "judge": 0.0}
    assert not sieve.tied(two_models)  # the judge model still has signal
    assert sieve.tied(group([0.5, 0.505]))  # within the tolerance
    queue = Queue(batch_groups=2, sieve=sieve)
    queue.ready += [group([1.0, 1.0], "a"), group([0.0, 1.0], "a"), group([0.0, 0.0], "b"), group([1.0, 0.0], "b")]
    batch = queue.take()
    assert batch is not None
    metrics = batch.metrics()
    assert metrics["train/a/filtered_share"] == 0.5 and metrics["train/b/filtered_share"] == 0.5


def finish(reg: Registry, task: str, rewards: list[float]) -> None:
    for r in rewards:
        ep, _ = reg.open(OpenEpisode(sandbox="s", task_id=task, group_size=len(rewards)), {"policy": 0})
        reg.record(ep, Call(model="policy", version=0, prompt_ids=[1], completion_ids=[2], completion_logprobs=[-0.1]))
        reg.finish(ep.id, {"policy": r}, {"reward": r})


def test_the_registry_under_filter_refills_a_tied_groups_slot_from_the_next_group_to_finish():
    reg = Registry(lease_s=60, default_group_size=2, batch_groups=2)
    reg.sieve = Sieve(tolerance=1e-6, max_refills=8)
    finish(reg, "signal", [1.0, 0.0])
    finish(reg, "tied", [0.5, 0.5])
    assert reg.take_batch({"policy": 0}, max_staleness=0) is None
    assert reg.ready_groups() == 1  # the tied group left the buffer; the one with signal waits
    finish(reg, "refill", [0.0, 1.0])
    batch = reg.take_batch({"policy": 0}, max_staleness=0)
    assert batch is not None and [g[0].task_id for g in batch.groups] == ["signal", "refill"]
    assert batch.metrics()["train/groups_filtered"] == 1.0


def test_a_filtered_ab_group_still_counts_in_its_cells_verdict():
    # Both code versions of an A/B solve the task every time: each group ties and is kept out of training,
    # but their episodes are scored in their (task, weights) cell all the same.
    reg = Registry(lease_s=60, default_group_size=2, batch_groups=1)
    reg.sieve = Sieve(tolerance=1e-6, max_refills=8)
    for version in ("old", "new"):
        for _ in range(2):
            ep, _ = reg.open(OpenEpisode(sandbox="s", task_id="t", group_size=2, client_version=version), {"policy": 0})
            reg.record(ep, Call(model="policy", version=0, prompt_ids=[1], completion_ids=[2], completion_logprobs=[-0.1]))
            reg.finish(ep.id, {"policy": 1.0}, {"reward": 1.0})
    assert reg.take_batch({"policy": 0}, max_staleness=0) is None  # both groups tied: nothing trains
    assert reg.ready_groups() == 0
    verdict = reg.pairs.take()
    assert verdict["ab/s/pairs"] == 1.0
    assert verdict["ab/s/version/old"] == 1.0 and verdict["ab/s/version/new"] == 1.0


SMALL_STEPS = ["server.port=0", "trainer.batch_groups=2", "trainer.group_size=2"]


def test_the_steps_reward_mean_counts_the_tied_groups_the_filter_kept_out():
    # Early in a run most groups tie at 0: a reward/mean over the trained groups alone would read 0.5 here
    # while the policy earns 0.25, and the filter would look like learning.
    server = Server(load_config(overrides=SMALL_STEPS))
    server.registry.sieve = Sieve(tolerance=1e-6, max_refills=8)
    finish(server.registry, "signal", [1.0, 0.0])
    finish(server.registry, "tied", [0.0, 0.0])
    assert server.registry.take_batch({"policy": 0}, max_staleness=0) is None
    finish(server.registry, "refill", [0.0, 1.0])
    batch = server.registry.take_batch({"policy": 0}, max_staleness=0)
    assert batch is not None and [g[0].task_id for g in batch.groups] == ["signal", "refill"]
    metrics = RolloutMeter(server).metrics(batch)
    assert metrics["reward/mean"] == metrics["reward/s/mean"] == 2 / 6
    assert metrics["rollout/episodes_per_s"] > 0 and metrics["episode/calls"] == 1.0


def test_without_kept_out_groups_the_trainers_reward_mean_stands():
    server = Server(load_config(overrides=SMALL_STEPS))
    finish(server.registry, "a", [1.0, 0.0])
    finish(server.registry, "b", [0.0, 0.0])
    batch = server.registry.take_batch({"policy": 0}, max_staleness=0)
    assert batch is not None and not batch.kept_out
    assert "reward/mean" not in RolloutMeter(server).metrics(batch)  # the trainer's own, over what it trained


def test_oversampling_lets_a_step_start_the_groups_the_recent_tie_rate_expects_to_tie():
    reg = Registry(lease_s=60, default_group_size=2, batch_groups=2)
    reg.admit_within(max_staleness=0)
    reg.sieve = Sieve(tolerance=1e-6, max_refills=8, oversample=True)

    def opens(task: str) -> bool:
        try:
            reg.open(OpenEpisode(sandbox="s", task_id=task, group_size=2), {"policy": 0})
            return True
        except Refusal:
            return False

    finish(reg, "signal", [1.0, 0.0])
    finish(reg, "tied", [0.0, 0.0])
    assert not opens("third")  # before any tie was seen a step's room is its batch_groups
    assert reg.take_batch({"policy": 0}, max_staleness=0) is None  # the tied group is kept out
    # One tied group of one judged: the room doubles (at most one extra per batch group) to 4 groups: the
    # ready one with signal and three new, where without oversampling one refill would start.
    assert reg.sieve.tie_rate == 1.0 and reg.admission.extra_groups == 2
    assert opens("refill") and opens("spare") and opens("another spare") and not opens("one too many")


def test_extra_groups_follow_the_tie_rate_and_stay_zero_without_oversampling():
    sieve = Sieve(tolerance=1e-6, max_refills=8, oversample=True)
    assert sieve.extra_groups(4) == 0  # nothing judged yet
    sieve.recent.extend([True] * 3 + [False] * 9)  # a quarter tie: 4 * 1/3 = 1.33 more expected to tie
    assert sieve.extra_groups(4) == 2
    sieve.recent.extend([False] * 16)
    assert sieve.extra_groups(4) == 0
    off = Sieve(tolerance=1e-6, max_refills=8)
    off.recent.extend([True] * 16)
    assert off.extra_groups(4) == 0
