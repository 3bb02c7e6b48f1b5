"""An A/B that compares only code: groups of one version, the same tasks for both, scores paired on equal weights.

The registry keys groups by code version (`Episode.train_group`); the client table names an A/B's
leaders and follower and forgets the A/B when the loser drains or a side is gone; the open route
hands the follower the tasks its leaders opened (over HTTP, against a real in-process server); the
pair book compares two versions only on cells (task, weights at open) both reached, each cell counted
once whatever each version's episode count, every episode in the cell it opened in (a judged one that never
finished with its failure value, a stale one too); `swarm swap` gives the new client the old one's task settings.
"""

from __future__ import annotations

import pytest

from core.run.hotswap import inherited
from core.clients.retries import SwarmError
from core.clients.sdk import SwarmClient
from core.episodes.client_table import ClientTable
from core.config import ab_metric
from core.episodes import pairing
from core.episodes.pairing import DEBT_MAX_VERSIONS, Pairs, TaskPairing
from core.episodes.registry import Registry
from core.episodes.wire import DrainClients, OpenEpisode, RegisterClient
from core.records import Call, Episode


def _finish(reg: Registry, task: str, version: str, reward: float, weights: int = 0) -> Episode:
    ep, _ = reg.open(OpenEpisode(sandbox="s", task_id=task, group_size=2, client_version=version), {"policy": weights})
    reg.record(ep, Call(model="policy", version=weights, prompt_ids=[1], completion_ids=[2], completion_logprobs=[-0.1]))
    return reg.finish(ep.id, {"policy": reward}, {"reward": reward})


def test_a_group_never_mixes_code_versions():
    reg = Registry(lease_s=60, default_group_size=2, batch_groups=2)
    _finish(reg, "t", "v1", 1.0)
    _finish(reg, "t", "v2", 0.0)  # same task, other code: a group of its own
    assert reg.ready_groups() == 0  # under the old (sandbox, task) key these two were one ready group
    _finish(reg, "t", "v1", 1.0)
    _finish(reg, "t", "v2", 0.0)
    batch = reg.take_batch({"policy": 0}, max_staleness=1)
    assert sorted({e.client_version for e in g} == {g[0].client_version} for g in batch.groups) == [True, True]
    assert sorted(g[0].client_version for g in batch.groups) == ["v1", "v2"]


def _episode(task: str, version: str, opened_on: int, reward: float, calls_on: list[int] | None = None) -> Episode:
    calls = [Call(model="policy", version=w, prompt_ids=[1], completion_ids=[2], completion_logprobs=[-0.1])
             for w in calls_on or [opened_on]]
    return Episode(id=f"{task}-{version}-{reward}", sandbox="s", task_id=task, group_size=1, client_version=version,
                   opened_at=0.0, lease_expires_at=1.0, opened_versions={"policy": opened_on}, calls=calls,
                   reward={"policy": reward}, state="finished")


def test_pairs_compare_versions_only_on_the_same_task_and_weights_each_cell_counted_once():
    pairs = Pairs()
    for ep in [_episode("a", "v1", 3, 1.0), _episode("a", "v1", 3, 0.0), _episode("a", "v2", 3, 0.9),
               _episode("b", "v1", 3, 0.2), _episode("b", "v2", 4, 0.8),  # opened on other weights: no pair
               _episode("d", "v2", 4, 0.3), _episode("d", "v1", 4, 0.1)]:
        pairs.add(ep, sum(ep.reward.values()))
    metrics = pairs.take()
    # Cells a@3 (v1 mean 0.5 over its two episodes, v2 0.9) and d@4: each version over the same two cells.
    assert metrics == pytest.approx({ab_metric("s", "v1"): (0.5 + 0.1) / 2, ab_metric("s", "v2"): (0.9 + 0.3) / 2,
                                     "ab/s/pairs": 2.0})
    assert {(p["task_id"], tuple(map(tuple, p["weights"]))) for p in pairs.status()} == {
        ("a", (("policy", 3),)), ("d", (("policy", 4),))}
    assert pairs.take() == {}  # taken once
    pairs.add(_episode("b", "v2", 3, 0.7), 0.7)  # the other version reaches b@3 late: now it pairs
    assert pairs.take()[ab_metric("s", "v2")] == pytest.approx(0.7)


def test_an_episode_whose_calls_span_a_weight_change_stays_in_the_cell_it_opened_in():
    # v1 waits for new weights after a bad reply and calls again on 4: under the old span key (3-4) its episode
    # fell in a cell v2 never reached, so only its good episodes paired. Fixed at open, the bad one counts at 3.
    pairs = Pairs()
    for ep in [_episode("a", "v1", 3, 0.0, calls_on=[3, 4]), _episode("a", "v2", 3, 0.5),
               _episode("b", "v1", 3, 1.0), _episode("b", "v2", 3, 0.5)]:
        pairs.add(ep, sum(ep.reward.values()))
    assert pairs.take() == pytest.approx({ab_metric("s", "v1"): 0.5, ab_metric("s", "v2"): 0.5, "ab/s/pairs": 2.0})


def _judged_registry(now: list[float]) -> Registry:
    reg = Registry(lease_s=5, default_group_size=2, batch_groups=1, clock=lambda: now[0])
    reg.failure_scores = {"s": -1.0}
    return reg


def test_an_expired_judged_episode_scores_failure_in_the_cell_it_opened_in_and_the_cell_waits_for_it():
    now = [1000.0]
    reg = _judged_registry(now)
    old, _ = reg.open(OpenEpisode(sandbox="s", task_id="t", group_size=2, client_version="v1"), {"policy": 3})
    new, _ = reg.open(OpenEpisode(sandbox="s", task_id="t", group_size=2, client_version="v2"), {"policy": 3})
    reg.record(old, Call(model="policy", version=4, prompt_ids=[1], completion_ids=[2], completion_logprobs=[-0.1]))
    reg.finish(new.id, {"policy": 0.5}, {"reward": 0.5}, score=0.5)
    assert reg.pairs.take() == {}  # both versions reached t@3, but v1's episode still runs: no pair without it
    now[0] += 10  # v1's agent hangs on a bad reply until its lease runs out (its call ran on newer weights)
    reg.expire_due()
    assert old.state == "finished" and old.score == -1.0
    assert reg.pairs.take() == pytest.approx({ab_metric("s", "v1"): -1.0, ab_metric("s", "v2"): 0.5, "ab/s/pairs": 1.0})
    assert reg.pairs.status()[-1]["weights"] == [["policy", 3]]


def test_an_aborted_judged_episode_counts_and_a_stale_one_still_counts_in_its_cell():
    now = [1000.0]
    reg = _judged_registry(now)
    for version, outcome in (("v1", "abort"), ("v2", "finish")):
        ep, _ = reg.open(OpenEpisode(sandbox="s", task_id="t", group_size=1, client_version=version), {"policy": 0})
        reg.record(ep, Call(model="policy", version=0, prompt_ids=[1], completion_ids=[2], completion_logprobs=[-0.1]))
        if outcome == "abort":
            reg.abort(ep.id, "the agent gave up on a bad reply")
        else:
            reg.finish(ep.id, {"policy": 1.0}, {"reward": 1.0}, score=1.0)
    # Both groups are stale by the time the trainer looks: dropped from the batch, never from their cell.
    assert reg.take_batch({"policy": 5}, max_staleness=1) is None and reg.counters["stale"] == 2
    assert reg.pairs.take() == pytest.approx({ab_metric("s", "v1"): -1.0, ab_metric("s", "v2"): 1.0, "ab/s/pairs": 1.0})


def test_a_debt_is_paid_in_order_put_back_when_refused_and_dropped_once_the_weights_moved_on():
    pairing = TaskPairing()
    pairing.owe("s", "t1", None, {"policy": 5})
    pairing.owe("s", "t2", {"id": "t2"}, {"policy": 6})
    first = pairing.take("s", {"policy": 5 + DEBT_MAX_VERSIONS})
    assert first.task_id == "t1"
    pairing.put_back("s", first)
    assert pairing.owed() == {"s": 2}
    assert pairing.take("s", {"policy": 7}).task_id == "t2"  # t1 is two versions old: dropped, not paid
    assert pairing.dropped == {"s": 1} and pairing.take("s", {"policy": 7}) is None


def _reg(cid: str, version: str) -> RegisterClient:
    return RegisterClient(client_id=cid, sandbox="s", version=version, pid=1, group_size=2, seed="0/1", split="train",
                          tasks=50, episode_timeout=30.0)


def test_the_table_names_leaders_and_follower_until_the_loser_drains():
    pairing = TaskPairing()
    table = ClientTable(on_ab_end=pairing.close)
    table.register(_reg("old", "v1"), "")
    table.register(_reg("new", "v2"), "")
    assert table.ab_role("s", "old") is None  # no A/B yet
    table.drain(DrainClients(sandbox="s", client_ids=["old"], successor="new", ab=True))
    assert (table.ab_role("s", "old"), table.ab_role("s", "new"), table.ab_open()) == ("leader", "follower", {"s": 1})
    pairing.owe("s", "t", None, {})
    table.drain(DrainClients(sandbox="s", client_ids=["old"], successor="new"))  # the old version lost
    assert table.ab_role("s", "new") is None and table.ab_open() == {} and pairing.owed() == {}


def test_an_ab_whose_follower_left_is_over():
    table = ClientTable()
    table.register(_reg("old", "v1"), "")
    key = table.register(_reg("new", "v2"), "").key
    table.drain(DrainClients(sandbox="s", client_ids=["old"], successor="new", ab=True))
    table.leave("new", key)
    assert table.ab_role("s", "old") is None and table.ab_open() == {}


def test_swap_starts_the_new_client_with_the_old_ones_task_settings():
    old = _reg("old", "v1").model_dump()
    assert inherited(old) == {"split": "train", "seed": "0/1", "tasks": 50, "episode_timeout": 30.0}
    assert inherited({**old, "seed": None, "tasks": None, "episode_timeout": None, "split": "eval"}) == {
        "split": "eval", "seed": None, "tasks": None, "episode_timeout": None}


def test_over_http_the_follower_opens_the_tasks_its_leader_opened(live_server):
    server = live_server()
    leader = SwarmClient(server.url, client_id="old", client_version="v1")
    follower = SwarmClient(server.url, client_id="new", client_version="v2")
    try:
        leader.register(_reg("old", "v1").model_dump())
        follower.register(_reg("new", "v2").model_dump())
        leader.call("POST", "/admin/drain", {"sandbox": "s", "client_ids": ["old"], "successor": "new", "ab": True},
                    key=server.admin_token)
        opened = [leader.call("POST", "/episodes", leader.open_body(task, "s", 2, "train", None))
                  for task in ("t7", "t3")]
        assert [o["task_id"] for o in opened] == ["t7", "t3"]
        # The follower asks for its own next task; the server opens its leader's, in order.
        paired = [follower.call("POST", "/episodes", follower.open_body("t0", "s", 2, "train", None))["task_id"]
                  for _ in range(2)]
        assert paired == ["t7", "t3"]
        with pytest.raises(SwarmError) as nothing_owed:  # nothing left to pay: a 503 to retry, not its own task
            follower.call("POST", "/episodes", follower.open_body("t0", "s", 2, "train", None), deadline_s=0.5)
        assert nothing_owed.value.status == 503
        status = follower.call("GET", "/status", key=server.admin_token)["ab"]  # the A/B: the admin token's to read
        assert status["open"] == {"s": 1} and status["owed"] == {}
        # Eval episodes are not paired, and once the A/B is over the follower chooses its own tasks again.
        assert follower.call("POST", "/episodes", follower.open_body("e1", "s", 2, "eval", None))["task_id"] == "e1"
        leader.call("POST", "/admin/drain", {"sandbox": "s", "client_ids": ["old"], "successor": "new"},
                    key=server.admin_token)
        assert follower.call("POST", "/episodes", follower.open_body("t0", "s", 2, "train", None))["task_id"] == "t0"
    finally:
        leader.close()
        follower.close()


def test_a_server_whose_weights_never_move_forgets_its_oldest_idle_cells_but_never_a_running_one(monkeypatch):
    monkeypatch.setattr(pairing, "CELLS_KEPT", 3)
    pairs = Pairs()
    running = _episode("held", "v1", 0, 0.0)
    pairs.opened(running)
    for i in range(6):
        pairs.add(_episode(f"t{i}", "v1", 0, 1.0), 1.0)
    pairs.add(_episode("t5", "v2", 0, 0.5), 0.5)  # the newest cells are kept: t5 pairs
    pairs.add(running, 0.0)
    pairs.add(_episode("held", "v2", 0, 1.0), 1.0)  # the running one's cell was never forgotten: it pairs too
    assert pairs.take()["ab/s/pairs"] == 2.0
    pairs.add(_episode("t0", "v2", 0, 0.5), 0.5)  # t0 was forgotten: alone, no pair
    assert pairs.take() == {}
