"""The arith sandbox's judge (sandbox.toml `judge`): the server deals its tasks and scores the reply it recorded.

An episode that raises, times out or expires scores `FAILURE`. This file and `sums.py` are read-only to studies.
"""

from __future__ import annotations

from sums import reward, tasks  # noqa: F401 (tasks: the judge owns the splits episodes are dealt from)

FAILURE = 0.0  # what a reply without a number earns: failing never beats answering


def score(task, episode) -> float:
    return reward(task, episode.completion)
