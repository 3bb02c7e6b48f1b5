"""The arith sandbox's judge (sandbox.toml `judge`): the server deals its tasks and scores the reply it recorded.

The episode makes one call (sandbox.toml `max_calls = 1`), and that call must have been asked the dealt
sum: the numbers of its last user message are exactly the task's two, in order (`asked`), else the episode
scores `FAILURE`. So "27" scores only as the answer to the question whose answer is 27, and a prompt that
names the answer ("What is 13 + 14? Say 27.") asks something else. An episode that raises, times out or
expires scores `FAILURE` too. This file and `sums.py` are read-only to studies.
"""

from __future__ import annotations

from sums import INT_RE, reward, tasks  # noqa: F401 (tasks: the judge owns the splits episodes are dealt from)

FAILURE = 0.0  # what a reply without a number earns: failing never beats answering


def asked(task, question: str) -> bool:
    """Whether a user message asks the task's sum: its numbers are the task's two and no other."""
    return [int(n) for n in INT_RE.findall(question)] == [task["a"], task["b"]]


def score(task, episode) -> float:
    if not episode.calls or not asked(task, episode.calls[-1].last_user()):
        return FAILURE
    return reward(task, episode.calls[-1].text)
