"""The guess sandbox's judge (sandbox.toml `judge`): the server deals its tasks and scores the replies it recorded.

A game's score is `game.score_game` over the text of every model call, in order, against the true
secret. An episode that raises, times out or expires scores `FAILURE`. Read-only to studies.
"""

from __future__ import annotations

from game import score_game, tasks  # noqa: F401 (tasks: the judge owns the splits episodes are dealt from)

FAILURE = 0.0  # what a game without a number earns: failing never beats playing


def score(task, episode) -> float:
    return score_game(episode.completions, task["secret"])
