"""The letters sandbox's judge (sandbox.toml `judge`): the server loads it, deals its tasks and scores with it.

It scores the reply the server recorded (the last call's completion text) with `reward.py`, never a
number the agent returns; an episode that raises, times out or expires scores `FAILURE`. This file
and what it imports are read-only to every study proposal.
"""

from __future__ import annotations

from reward import reward, tasks  # noqa: F401 (tasks: the judge owns the splits episodes are dealt from)

FAILURE = 0.0  # the lowest score a reply can earn: failing never beats answering


def score(task, episode) -> float:
    """The share of lowercase letters in the reply the server recorded (see reward.py)."""
    return reward(episode.completion)
