"""The oneword sandbox's judge (sandbox.toml `judge`): the server loads it, deals its tasks and scores with it.

It scores the reply the server recorded with `format_reward.py`, never a number the agent returns; an
episode that raises, times out or expires scores `FAILURE`. Read-only to every study proposal.
"""

from __future__ import annotations

from format_reward import reward, tasks  # noqa: F401 (tasks: the judge owns the splits episodes are dealt from)

FAILURE = 0.0  # what a reply without a single word earns: failing never beats answering


def score(task, episode) -> float:
    return reward(episode.completion)
