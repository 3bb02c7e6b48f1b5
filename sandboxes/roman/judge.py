"""The roman sandbox's judge (sandbox.toml `judge`): the server deals its tasks and scores the reply it recorded.

It uses `numerals.py` (pure Python: the server has no `roman` package). An episode that raises, times out
or expires scores `FAILURE`. Read-only to studies.
"""

from __future__ import annotations

from numerals import reward, tasks  # noqa: F401 (tasks: the judge owns the splits episodes are dealt from)

FAILURE = 0.0  # what a reply that is no numeral earns: failing never beats answering


def score(task, episode) -> float:
    return reward(episode.completion, task["n"])
