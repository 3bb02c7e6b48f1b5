"""The guess sandbox's judge (sandbox.toml `judge`): the server deals its tasks and scores the replies it recorded.

A game's score is `game.score_game` over the text of every model call, in order, against the true
secret. A game is `TURNS` calls (sandbox.toml `max_calls = 3`: the server refuses a fourth); a game the
agent stops early scores its missing turns as replies without a number, so stopping after a lucky guess
does not pay. The game must be played, not told: when a user or system message names the secret before
the model has guessed it (and it is not a bound of the range), the episode scores `FAILURE`. An episode
that raises, times out or expires scores `FAILURE` too. Read-only to studies.
"""

from __future__ import annotations

from game import ANY_NUMBER, HIGH, LOW, score_game, tasks  # noqa: F401 (tasks: the judge owns the splits)

FAILURE = 0.0  # what a game without a number earns: failing never beats playing
TURNS = 3  # model calls in a game (agent.py TURNS, sandbox.toml max_calls)


def told(secret: int, episode) -> bool:
    """Whether the environment's side of the game named the secret before the model guessed it."""
    guessed: set[int] = {LOW, HIGH}  # the range's bounds are in the rules, whatever the secret
    for call in episode.calls:
        for message in call.messages:
            if message.get("role") in ("user", "system") and isinstance(message.get("content"), str):
                if secret in {int(n) for n in ANY_NUMBER.findall(message["content"])} - guessed:
                    return True
        guessed |= {int(n) for n in ANY_NUMBER.findall(call.text)}
    return False


def score(task, episode) -> float:
    if told(task["secret"], episode):
        return FAILURE
    replies = [call.text for call in episode.calls]
    return score_game(replies + [""] * (TURNS - len(replies)), task["secret"])
