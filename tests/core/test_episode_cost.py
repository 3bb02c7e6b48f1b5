"""Calls and tokens per episode (issue 38): what an episode cost is logged beside its score, so a harness that buys
its score with more compute (an agent that resamples until its own check passes) says so."""

from __future__ import annotations

from core.records import Call, Episode
from core.run.rollout_metrics import episode_cost


def _episode(i: int, calls: int, tokens: int) -> Episode:
    return Episode(id=f"e{i}", sandbox="letters", task_id="t", group_size=4, opened_at=0.0, lease_expires_at=60.0,
                   calls=[Call(model="policy", version=0, prompt_ids=[1, 2], completion_ids=list(range(tokens)),
                               completion_logprobs=[0.0] * tokens) for _ in range(calls)])


def test_calls_and_completion_tokens_are_averaged_per_episode() -> None:
    shipped = [_episode(i, 1, 12) for i in range(4)]
    resampling = [_episode(i, 4 if i % 2 else 5, 12) for i in range(4)]  # 4.5 calls an episode
    assert episode_cost(shipped, "episode") == {"episode/calls": 1.0, "episode/tokens": 12.0}
    cost = episode_cost(resampling, "episode/letters/version/v2")
    assert cost == {"episode/letters/version/v2/calls": 4.5, "episode/letters/version/v2/tokens": 54.0}
    assert episode_cost([], "episode") == {}
