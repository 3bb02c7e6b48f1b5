"""Mix quotas hold in what trains: batch assembly takes groups by quota, admission shares the room.

The registry's rules run on a fake clock with groups arriving in adversarial orders; one real short
run (two sandboxes at `mix` 3:1, the 1-share one with four times the clients) checks the trained
batches over the run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from core.config_io import load_config
from core.episodes.errors import Refusal
from core.episodes.registry import Registry
from core.records import Call
from core.run.loop import CoreRun
from core.episodes.wire import OpenEpisode
from tests.support import train_in_process

ROOT = Path(__file__).resolve().parents[2]


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def _call(version: int = 0) -> Call:
    return Call(model="policy", version=version, prompt_ids=[1], completion_ids=[2], completion_logprobs=[-0.1])


def finish_group(reg: Registry, sandbox: str, task: str, size: int = 1, version: int = 0) -> None:
    for _ in range(size):
        ep, _ = reg.open(OpenEpisode(sandbox=sandbox, task_id=task, group_size=size), {"policy": version})
        reg.record(ep, _call(version))
        reg.finish(ep.id, {"policy": 1.0}, {"reward": 1.0})


def _count(batch) -> dict[str, int]:
    out: dict[str, int] = {}
    for g in batch.groups:
        out[g[0].sandbox] = out.get(g[0].sandbox, 0) + 1
    return out


def _simulate(reg: Registry, ticks: int, attempts: dict[str, int]) -> list[dict[str, int]]:
    """Clients on a fake clock: each tick, finish what opened the tick before, try `attempts[s]` opens
    per sandbox (refusals are retried next tick, as the runner does), and let the trainer take a batch."""
    batches, opened, n = [], [], 0
    for _ in range(ticks):
        for ep in opened:
            reg.record(ep, _call())
            reg.finish(ep.id, {"policy": 1.0}, {"reward": 1.0})
        opened = []
        for sandbox, tries in attempts.items():
            for _ in range(tries):
                n += 1
                try:
                    opened.append(reg.open(OpenEpisode(sandbox=sandbox, task_id=f"t{n}", group_size=1), {"policy": 0})[0])
                except Refusal:
                    pass
        batch = reg.take_batch({"policy": 0}, max_staleness=1)
        if batch is not None:
            batches.append(_count(batch))
    return batches


def test_batches_hold_the_mix_when_the_small_share_has_four_times_the_clients():
    reg = Registry(lease_s=60, default_group_size=1, batch_groups=4, mix={"a": 3.0, "b": 1.0}, clock=Clock())
    reg.admit_within(max_staleness=1)
    batches = _simulate(reg, ticks=40, attempts={"a": 1, "b": 4})
    assert len(batches) >= 8
    assert all(b == {"a": 3, "b": 1} for b in batches), batches  # every batch exactly 3:1
    trained = reg.trained_groups()
    assert trained == {"a": 3 * len(batches), "b": len(batches)}
    assert reg.counters["trained"] == 4 * len(batches)


def test_without_quotas_arrival_order_would_have_trained_the_fast_sandbox_more():
    # The same clients with one sandbox name per rate but no mix: what the quotas correct.
    reg = Registry(lease_s=60, default_group_size=1, batch_groups=4, clock=Clock())
    reg.admit_within(max_staleness=1)
    batches = _simulate(reg, ticks=40, attempts={"a": 1, "b": 4})
    b = sum(x.get("b", 0) for x in batches)
    a = sum(x.get("a", 0) for x in batches)
    assert b > a  # arrival order: b, four times the clients, dominates


def test_a_batch_waits_for_an_owed_sandbox_with_a_group_coming_and_not_for_one_gone_for_a_lease():
    clock = Clock()
    reg = Registry(lease_s=60, default_group_size=1, batch_groups=4, mix={"a": 3.0, "b": 1.0}, clock=clock)
    for i in range(6):
        finish_group(reg, "a", f"a{i}")
    open_b, _ = reg.open(OpenEpisode(sandbox="b", task_id="b0", group_size=1), {"policy": 0})
    # six a groups are ready, but b is owed a slot and its group is under way: the batch waits
    assert reg.ready_groups() == 6 and reg.take_batch({"policy": 0}, max_staleness=0) is None
    assert reg.ready_groups() == 6 and reg.counters["trained"] == 0  # waiting took nothing
    reg.record(open_b, _call())
    reg.finish(open_b.id, {"policy": 0.5}, {"reward": 0.5})
    assert _count(reg.take_batch({"policy": 0}, max_staleness=0)) == {"a": 3, "b": 1}
    # b's client is between episodes: nothing under way, but it asked within a lease, so it is waited for
    finish_group(reg, "a", "a6")
    assert reg.ready_groups() == 4 and reg.take_batch({"policy": 0}, max_staleness=0) is None
    # b silent for a lease (its client is gone): the trainer is not stopped, a fills the batch
    clock.now += 61
    assert _count(reg.take_batch({"policy": 0}, max_staleness=0)) == {"a": 4}


def _finish_until_refused(reg: Registry, sandbox: str, limit: int = 50) -> int:
    for i in range(limit):
        try:
            finish_group(reg, sandbox, f"{sandbox}{i}")
        except Refusal as e:
            assert e.code == "mix_quota", e
            return i
    raise AssertionError(f"{sandbox} finished {limit} groups without a refusal")


def test_a_mixed_sandbox_whose_clients_have_not_registered_yet_keeps_its_share_for_a_lease():
    clock = Clock()
    reg = Registry(lease_s=60, default_group_size=1, batch_groups=4, mix={"a": 3.0, "b": 1.0}, clock=clock)
    # a's clients are still starting: b, alone so far, is held to its quarter and trains nothing alone
    held = _finish_until_refused(reg, "b")
    assert held < 4 and reg.take_batch({"policy": 0}, max_staleness=0) is None
    for i in range(3):
        finish_group(reg, "a", f"a{i}")
    assert _count(reg.take_batch({"policy": 0}, max_staleness=0)) == {"a": 3, "b": 1}
    # a sandbox that never shows up holds the others for one lease from the start, not for ever
    late = Registry(lease_s=60, default_group_size=1, batch_groups=4, mix={"a": 3.0, "b": 1.0}, clock=clock)
    held = _finish_until_refused(late, "b")
    clock.now += 61
    for i in range(held, 4):  # the whole mix is b's now
        finish_group(late, "b", f"b{i}")
    assert _count(late.take_batch({"policy": 0}, max_staleness=0)) == {"b": 4}


def test_a_group_dropped_whole_as_stale_fills_no_slot_and_no_quota():
    reg = Registry(lease_s=60, default_group_size=1, batch_groups=2, mix={"a": 1.0, "b": 1.0}, clock=Clock())
    finish_group(reg, "b", "old", version=0)
    finish_group(reg, "a", "a0", version=3)
    finish_group(reg, "b", "new", version=3)
    batch = reg.take_batch({"policy": 3}, max_staleness=1)
    assert _count(batch) == {"a": 1, "b": 1} and batch.dropped_stale == 1
    assert [g[0].task_id for g in batch.groups if g[0].sandbox == "b"] == ["new"]
    assert reg.trained_groups() == {"a": 1, "b": 1} and reg.ready_groups() == 0


def test_stale_groups_never_leave_a_step_short_the_fresh_ones_wait_for_a_full_batch():
    reg = Registry(lease_s=60, default_group_size=1, batch_groups=2, clock=Clock())
    finish_group(reg, "a", "old", version=0)
    finish_group(reg, "a", "fresh", version=3)
    assert reg.take_batch({"policy": 3}, max_staleness=1) is None  # one fresh group is not a batch of two
    assert reg.ready_groups() == 1 and reg.counters["stale"] == 1 and reg.counters["trained"] == 0
    finish_group(reg, "a", "next", version=3)
    batch = reg.take_batch({"policy": 3}, max_staleness=1)
    assert [g[0].task_id for g in batch.groups] == ["fresh", "next"] and batch.dropped_stale == 0


def test_groups_of_a_sandbox_outside_the_mix_go_in_arrival_order():
    reg = Registry(lease_s=60, default_group_size=1, batch_groups=2, mix={"a": 3.0, "b": 1.0}, clock=Clock())
    finish_group(reg, "stranger", "s0")
    finish_group(reg, "a", "a0")
    assert [g[0].sandbox for g in reg.take_batch({"policy": 0}, max_staleness=0).groups] == ["stranger", "a"]


def test_admission_gives_each_active_sandbox_its_share_of_the_room():
    clock = Clock()
    reg = Registry(lease_s=10, default_group_size=1, batch_groups=4, mix={"a": 3.0, "b": 1.0}, clock=clock)
    reg.admit_within(max_staleness=0)  # room for one step: four groups
    clock.now += 11  # a lease since the start and b never asked: only a is active, it may use the whole room
    first = [reg.open(OpenEpisode(sandbox="a", task_id=f"a{i}"), {"policy": 0})[0] for i in range(4)]
    with pytest.raises(Refusal) as e:
        reg.open(OpenEpisode(sandbox="b", task_id="b0"), {"policy": 0})
    assert e.value.code == "admission"  # the room is full, but b is active from now on
    for ep in first:
        reg.finish(ep.id, {"policy": 1.0}, {"reward": 1.0})
    # b asked, but the full room keeps it out: waiting for it would never end
    assert _count(reg.take_batch({"policy": 0}, max_staleness=0)) == {"a": 4}
    # b asked within a lease: a gets ceil(3/4 * 4) = 3 groups of the room and b keeps one
    for i in range(3):
        reg.open(OpenEpisode(sandbox="a", task_id=f"n{i}", lease_s=100), {"policy": 0})
    with pytest.raises(Refusal) as e:
        reg.open(OpenEpisode(sandbox="a", task_id="n3"), {"policy": 0})
    assert e.value.code == "admission" and "mix share" in str(e.value)
    # a sandbox silent for a lease gives its room back
    clock.now += 11
    assert reg.open(OpenEpisode(sandbox="a", task_id="n3"), {"policy": 0})


def test_back_pressure_spares_a_mixed_sandbox_with_nothing_ready():
    reg = Registry(lease_s=60, default_group_size=1, batch_groups=1, mix={"a": 3.0, "b": 1.0}, clock=Clock())
    finish_group(reg, "a", "a0")
    finish_group(reg, "a", "a1")
    with pytest.raises(Refusal) as e:
        reg.open(OpenEpisode(sandbox="a", task_id="a2"), {"policy": 0})
    assert e.value.code == "backpressure"
    assert reg.open(OpenEpisode(sandbox="b", task_id="b0"), {"policy": 0})  # the trainer may be waiting on b


@pytest.mark.slow
def test_a_real_run_at_mix_3_to_1_trains_groups_in_that_ratio(tmp_path):
    steps = 6
    data = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    # letters at 3 shares with 4 episodes in flight; arith at 1 share with 16: arrival alone would invert the mix
    data["clients"] = [{"agent": "sandbox:letters", "mix": 3, "concurrency": 4},
                       {"agent": "sandbox:arith", "mix": 1, "concurrency": 16}]
    cfg = load_config(data, [f"trainer.checkpoint_dir={tmp_path / 'ckpt'}", f"trainer.steps={steps}",
                             "trainer.group_size=2", "engine.default_max_tokens=8"])
    core = CoreRun(cfg)
    batches = []
    take = core.server.registry.take_batch

    def recording_take(*args, **kwargs):  # the real batch assembly, with what it hands the trainer kept
        batch = take(*args, **kwargs)
        if batch is not None:
            batches.append(batch)
        return batch

    core.server.registry.take_batch = recording_take
    train_in_process(core)
    assert len(batches) == steps
    trained = {"letters": 0, "arith": 0}
    for batch in batches:
        for sandbox, n in _count(batch).items():
            trained[sandbox] += n
    assert trained["letters"] + trained["arith"] == steps * cfg.trainer.batch_groups
    assert 2.7 <= trained["letters"] / trained["arith"] <= 3.3, trained  # 3:1 within 10%
