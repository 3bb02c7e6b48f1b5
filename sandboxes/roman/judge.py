"""The roman sandbox's judge (sandbox.toml `judge`): the server deals its tasks and scores the reply it recorded.

It uses `numerals.py` (pure Python: the server has no `roman` package). The episode makes one call
(sandbox.toml `max_calls = 1`), and that call must have been asked the dealt task: its last user message
carries the task's prompt (which names the number), else the episode scores `FAILURE`. An episode that
raises, times out or expires scores `FAILURE` too. Read-only to studies.
"""

from __future__ import annotations

from numerals import reward, tasks  # noqa: F401 (tasks: the judge owns the splits episodes are dealt from)

FAILURE = 0.0  # what a reply that is no numeral earns: failing never beats answering


def score(task, episode) -> float:
    if not episode.calls or task["prompt"] not in episode.calls[-1].last_user():
        return FAILURE
    return reward(episode.calls[-1].text, task["n"])
