"""A batch is put in an order of what its episodes are, not of when they finished (`Batch.put_in_stable_order`):
the same episodes, finished in another order, give the same groups in the same order, so a repeated run's
float sums (reward/mean, the gradient) repeat to the last bit."""

from __future__ import annotations

from core.episodes.batching import Batch
from core.records import Episode


def episode(task: str, ordinal: int, reward: float, sandbox: str = "s") -> Episode:
    return Episode(id=f"{sandbox}-{task}-{ordinal}", sandbox=sandbox, task_id=task, ordinal=ordinal, group_size=4,
                   state="finished", opened_at=0.0, lease_expires_at=60.0, reward={"policy": reward})


def shape(groups: list[list[Episode]]) -> list[list[str]]:
    return [[e.id for e in g] for g in groups]


def test_two_groups_of_one_task_are_cut_by_ordinal_whichever_finished_first():
    eps = {i: episode("t", i, float(i % 3 == 0)) for i in range(8, 16)}
    other = [episode("a", i, 0.5 * i) for i in range(4)]
    # One run's first group of task t took 8-11 as they finished; another's took 8, 13, 14 and 15.
    one = Batch([[eps[i] for i in (11, 9, 8, 10)], [eps[i] for i in (12, 15, 13, 14)], other[::-1]])
    two = Batch([other, [eps[i] for i in (8, 13, 14, 15)], [eps[i] for i in (9, 10, 11, 12)]],
                kept_out=[episode("k", 1, 0.0), episode("k", 0, 0.0)])
    one.kept_out = [episode("k", 0, 0.0), episode("k", 1, 0.0)]
    one.put_in_stable_order()
    two.put_in_stable_order()
    assert shape(one.groups) == shape(two.groups) == [
        [f"s-a-{i}" for i in range(4)], [f"s-t-{i}" for i in range(8, 12)], [f"s-t-{i}" for i in range(12, 16)]]
    assert [e.id for e in one.kept_out] == [e.id for e in two.kept_out] == ["s-k-0", "s-k-1"]
    assert sorted(e.id for e in one.episodes) == sorted(e.id for e in two.episodes)  # nothing lost or added
