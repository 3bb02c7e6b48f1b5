"""Only judged scores are decided on (issue 38, item 5): in a batch with judged episodes, reward/mean is the mean of
the judged ones; an unjudged sandbox's episodes (`reward: 1000` from episodes opened under a name nobody judges)
are logged under their own name and never reach reward/mean."""

from __future__ import annotations

from core.records import Episode
from core.run.scores import judged_metrics


def _episode(i: int, sandbox: str, score: float | None, reward: float) -> Episode:
    return Episode(id=f"e{i}", sandbox=sandbox, task_id=f"t{i}", group_size=4, kind="train", score=score,
                   reward={"policy": reward}, opened_at=0.0, lease_expires_at=60.0, state="finished", ended_at=1.0)


def test_a_shadow_sandboxs_rewards_never_reach_reward_mean() -> None:
    judged = [_episode(i, "letters", 0.2, 0.2) for i in range(4)]
    shadow = [_episode(10 + i, "shadow", None, 1000.0) for i in range(12)]  # crowding the batch out
    metrics = judged_metrics(judged + shadow)
    assert metrics["reward/mean"] == metrics["reward/letters/mean"] == 0.2
    assert metrics["unjudged_reward/shadow/mean"] == 1000.0
    assert "reward/shadow/mean" not in metrics
