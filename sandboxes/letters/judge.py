"""The letters sandbox's judge (sandbox.toml `judge`): the server loads it, deals its tasks and scores with it.

It scores the reply the server recorded with `reward.py`, never a number the agent returns. The episode
makes one call (sandbox.toml `max_calls = 1`), and that call must have been asked the dealt task: its
last user message carries the task's prompt, else the episode scores `FAILURE` (a reply to another
question answers nothing that was dealt). An episode that raises, times out or expires scores `FAILURE`
too. This file and what it imports are read-only to every study proposal.
"""

from __future__ import annotations

from reward import reward, tasks  # noqa: F401 (tasks: the judge owns the splits episodes are dealt from)

FAILURE = 0.0  # the lowest score a reply can earn: failing never beats answering


def score(task, episode) -> float:
    """The share of lowercase letters in the reply the server recorded (see reward.py), if it was asked the task."""
    if not episode.calls or task["prompt"] not in episode.calls[-1].last_user():
        return FAILURE
    return reward(episode.calls[-1].text)
