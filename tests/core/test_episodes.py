"""The episode registry's rules, on a fake clock: groups, staleness, back-pressure and mix quotas."""

from __future__ import annotations

import pytest

from core.episodes.errors import Refusal
from core.episodes.registry import Registry
from core.records import Call
from core.episodes.wire import OpenEpisode


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def finish_group(reg, sandbox, task, size, version=0):
    for _ in range(size):
        ep, _ = reg.open(OpenEpisode(sandbox=sandbox, task_id=task, group_size=size), {"policy": version})
        reg.record(ep, Call(model="policy", version=version, prompt_ids=[1], completion_ids=[2], completion_logprobs=[-0.1]))
        reg.finish(ep.id, {"policy": 1.0}, {"reward": 1.0})


def test_a_group_is_ready_only_when_all_its_episodes_finished():
    reg = Registry(lease_s=60, default_group_size=2, batch_groups=1, clock=Clock())
    ep, _ = reg.open(OpenEpisode(task_id="t"), {"policy": 0})
    reg.finish(ep.id, {"policy": 1.0}, {"reward": 1.0})
    assert reg.ready_groups() == 0
    ep2, _ = reg.open(OpenEpisode(task_id="t"), {"policy": 0})
    reg.abort(ep2.id, "crashed")  # an aborted episode never fills the group
    assert reg.ready_groups() == 0
    ep3, _ = reg.open(OpenEpisode(task_id="t"), {"policy": 0})
    reg.finish(ep3.id, {"policy": 0.0}, {"reward": 0.0})
    assert reg.ready_groups() == 1


def test_stale_episodes_are_dropped_from_the_batch():
    reg = Registry(lease_s=60, default_group_size=2, batch_groups=2, clock=Clock())
    finish_group(reg, "s", "old", 2, version=0)
    finish_group(reg, "s", "new", 2, version=3)
    assert reg.take_batch({"policy": 3}, max_staleness=1) is None  # the stale group goes; one fresh is no batch
    assert reg.counters["stale"] == 2 and reg.ready_groups() == 1
    finish_group(reg, "s", "newer", 2, version=3)
    batch = reg.take_batch({"policy": 3}, max_staleness=1)
    assert [g[0].task_id for g in batch.groups] == ["new", "newer"] and batch.dropped_stale == 0


def test_expired_leases_free_their_key_with_a_409():
    clock = Clock()
    reg = Registry(lease_s=5, default_group_size=1, batch_groups=1, clock=clock)
    ep, key = reg.open(OpenEpisode(task_id="t"), {"policy": 0})
    clock.now += 6
    with pytest.raises(Refusal) as e:
        reg.by_key(key)
    assert e.value.status == 409 and reg.counters["expired"] == 1


def test_back_pressure_when_the_trainer_falls_behind():
    reg = Registry(lease_s=60, default_group_size=1, batch_groups=1, clock=Clock())
    finish_group(reg, "s", "a", 1)
    finish_group(reg, "s", "b", 1)
    with pytest.raises(Refusal) as e:
        reg.open(OpenEpisode(task_id="c"), {"policy": 0})
    assert e.value.status == 503 and e.value.retry_after


def open_until_refused(reg: Registry, sandbox: str, limit: int = 100) -> tuple[int, Refusal]:
    for opened in range(limit):
        try:
            reg.open(OpenEpisode(sandbox=sandbox, task_id=f"{sandbox}-{opened}-{reg.clock()}"), {"policy": 0})
        except Refusal as e:
            return opened, e
    raise AssertionError(f"{sandbox} opened {limit} episodes without a refusal")


def test_a_sandbox_above_its_mix_share_waits_while_others_may_open():
    reg = Registry(lease_s=60, default_group_size=1, batch_groups=8, mix={"big": 3.0, "small": 1.0}, clock=Clock())
    assert reg.open(OpenEpisode(sandbox="big", task_id="x"), {"policy": 0})  # both sandboxes have clients
    opened, refused = open_until_refused(reg, "small")
    assert refused.code == "mix_quota" and opened < 10  # a quarter of 16 in flight, plus one group
    assert reg.open(OpenEpisode(sandbox="big", task_id="y"), {"policy": 0})


def test_a_sandbox_whose_mix_partner_went_silent_is_not_held_to_its_share():
    clock = Clock()
    reg = Registry(lease_s=60, default_group_size=1, batch_groups=8, mix={"big": 3.0, "small": 1.0}, clock=clock)
    reg.open(OpenEpisode(sandbox="big", task_id="x"), {"policy": 0})
    opened, refused = open_until_refused(reg, "small")
    assert refused.code == "mix_quota"
    clock.now += 61  # big's clients all died: no open attempt for a lease
    for i in range(3 * opened):  # small has the whole mix to itself now
        reg.open(OpenEpisode(sandbox="small", task_id=f"after-{i}"), {"policy": 0})


def call_at(version: int) -> Call:
    return Call(model="policy", version=version, prompt_ids=[1], completion_ids=[2], completion_logprobs=[-0.1])


def test_staleness_counts_by_the_weights_that_generated_not_the_version_at_open():
    reg = Registry(lease_s=60, default_group_size=2, batch_groups=1, clock=Clock())
    for calls in ([3], [3, 2]):  # both opened at version 1; the second has a call from version 2
        ep, _ = reg.open(OpenEpisode(task_id="t"), {"policy": 1})
        for v in calls:
            reg.record(ep, call_at(v))
        reg.finish(ep.id, {"policy": 1.0}, {"reward": 1.0})
    batch = reg.take_batch({"policy": 3}, max_staleness=0)
    assert batch.dropped_stale == 1 and len(batch.groups[0]) == 1
    assert batch.groups[0][0].calls[0].version == 3


def test_admission_refuses_new_groups_once_the_staleness_budget_is_full():
    reg = Registry(lease_s=60, default_group_size=2, batch_groups=1, clock=Clock())
    reg.admit_within(max_staleness=0)  # room for one step's groups: one group of two
    first, _ = reg.open(OpenEpisode(task_id="a"), {"policy": 0})
    with pytest.raises(Refusal) as e:
        reg.open(OpenEpisode(task_id="b"), {"policy": 0})
    assert e.value.status == 503 and e.value.code == "admission" and e.value.retry_after
    second, _ = reg.open(OpenEpisode(task_id="a"), {"policy": 0})  # completing a started group is always fine
    for ep in (first, second):
        reg.record(ep, call_at(0))
        reg.finish(ep.id, {"policy": 1.0}, {"reward": 1.0})
    with pytest.raises(Refusal):
        reg.open(OpenEpisode(task_id="b"), {"policy": 0})  # finished but untrained still fills the step
    assert reg.take_batch({"policy": 0}, max_staleness=0) is not None
    assert reg.open(OpenEpisode(task_id="b"), {"policy": 0})  # the batch left: room for the next step


def test_an_overlapped_step_in_progress_takes_one_step_of_budget_until_its_sync():
    reg = Registry(lease_s=60, default_group_size=1, batch_groups=1, clock=Clock())
    reg.admit_within(max_staleness=1)  # two steps' worth: two groups of one
    reg.open(OpenEpisode(task_id="a"), {"policy": 0})
    reg.step_started()
    with pytest.raises(Refusal):
        reg.open(OpenEpisode(task_id="b"), {"policy": 0})  # would be two versions old when trained
    reg.step_synced()
    assert reg.open(OpenEpisode(task_id="b"), {"policy": 1})


def test_a_partial_group_abandoned_for_a_lease_stops_holding_a_slot():
    clock = Clock()
    reg = Registry(lease_s=5, default_group_size=2, batch_groups=1, clock=clock)
    reg.admit_within(max_staleness=0)
    ep, _ = reg.open(OpenEpisode(task_id="a"), {"policy": 0})
    reg.finish(ep.id, {"policy": 1.0}, {"reward": 1.0})
    with pytest.raises(Refusal):
        reg.open(OpenEpisode(task_id="b"), {"policy": 0})
    clock.now += 6
    assert reg.open(OpenEpisode(task_id="b"), {"policy": 0})


def test_without_a_trainer_there_is_no_admission_control():
    reg = Registry(lease_s=60, default_group_size=1, batch_groups=1, clock=Clock())
    for i in range(5):
        reg.open(OpenEpisode(task_id=f"t{i}"), {"policy": 0})


def test_wasted_counts_stale_drops_and_episodes_that_generated_then_ended_untrained():
    reg = Registry(lease_s=60, default_group_size=1, batch_groups=1, clock=Clock())
    finish_group(reg, "s", "old", 1, version=0)
    reg.take_batch({"policy": 2}, max_staleness=1)  # dropped as stale
    aborted, _ = reg.open(OpenEpisode(task_id="x"), {"policy": 2})
    reg.record(aborted, call_at(2))
    reg.abort(aborted.id, "crashed")
    empty, _ = reg.open(OpenEpisode(task_id="y"), {"policy": 2})
    reg.abort(empty.id, "never called")  # generated nothing, wasted nothing
    finish_group(reg, "s", "new", 1, version=2)
    assert reg.take_batch({"policy": 2}, max_staleness=1) is not None
    assert reg.counters["generated"] == 3 and reg.counters["wasted"] == 2 and reg.counters["stale"] == 1


@pytest.mark.parametrize("lease_s", [5.0, 86400.0])
def test_a_heartbeat_extends_the_episodes_own_lease_not_the_servers_default(lease_s):
    clock = Clock()
    reg = Registry(lease_s=60, default_group_size=1, batch_groups=1, clock=clock)
    ep, _ = reg.open(OpenEpisode(task_id="t", lease_s=lease_s), {"policy": 0})
    clock.now += 2
    assert reg.heartbeat(ep.id).lease_expires_at == clock.now + lease_s


def test_a_finish_with_a_reward_beyond_max_abs_reward_is_a_400_and_the_episode_stays_open():
    reg = Registry(lease_s=60, default_group_size=1, batch_groups=1, clock=Clock(), max_abs_reward=1e6)
    ep, _ = reg.open(OpenEpisode(task_id="t"), {"policy": 0})
    with pytest.raises(Refusal) as e:
        reg.finish(ep.id, {"policy": 1e308}, {"reward": 1e308})
    assert e.value.status == 400 and e.value.code == "invalid_reward" and "max_abs_reward" in str(e.value)
    assert reg.get_open(ep.id).state == "open" and reg.ready_groups() == 0
    assert reg.finish(ep.id, {"policy": -1e6}, {"reward": -1e6}).state == "finished"  # the bound itself is fine
