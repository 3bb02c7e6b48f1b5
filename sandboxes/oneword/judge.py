"""The oneword sandbox's judge (sandbox.toml `judge`): the server loads it, deals its tasks and scores with it.

It scores the reply the server recorded with `format_reward.py`, never a number the agent returns. The
episode makes one call (sandbox.toml `max_calls = 1`), and that call must have been asked the dealt task:
its last user message carries the task's prompt (which names the category), else the episode scores
`FAILURE`. An episode that raises, times out or expires scores `FAILURE` too. Read-only to every study proposal.
"""

from __future__ import annotations

from format_reward import reward, tasks  # noqa: F401 (tasks: the judge owns the splits episodes are dealt from)

FAILURE = 0.0  # what a reply without a single word earns: failing never beats answering


def score(task, episode) -> float:
    if not episode.calls or task["prompt"] not in episode.calls[-1].last_user():
        return FAILURE
    return reward(episode.calls[-1].text)
