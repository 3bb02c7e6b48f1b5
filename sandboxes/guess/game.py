"""The guess sandbox's tasks and shaped score, in a file of their own that its judge imports (read-only to studies).

How a game is scored is described in agent.py's docstring. Named `game` so that two sandboxes loaded
into one process never share a sibling module by name.
"""

from __future__ import annotations

import random
import re

LOW, HIGH = 1, 50
TRAIN_TASKS, EVAL_TASKS = 512, 64
# Shaping weights: a bare in-range number is worth most of a turn, so format is learnable first;
# consistency with the hints adds the rest; closeness of the final guess breaks ties between games.
MENTION, BARE, CLOSENESS = 0.2, 0.6, 0.25
BARE_NUMBER = re.compile(r"^\s*(\d+)\s*\.?\s*$")
ANY_NUMBER = re.compile(r"\d+")


def tasks(split: str = "train"):
    rng = random.Random(0 if split == "train" else 1)
    for i in range(TRAIN_TASKS if split == "train" else EVAL_TASKS):
        yield {"id": f"{split}-{i}", "secret": rng.randint(LOW, HIGH)}


def parse_guess(text: str) -> tuple[int | None, bool]:
    """(the guessed number or None, whether the reply is a bare number and nothing else)."""
    bare = BARE_NUMBER.match(text)
    if bare:
        return int(bare.group(1)), True
    found = ANY_NUMBER.search(text)
    return (int(found.group()) if found else None), False


def turn_score(text: str, low: int, high: int) -> float:
    """The score of one reply, given the interval [low, high] the hints so far leave open."""
    guess, bare = parse_guess(text)
    if guess is None:
        return 0.0
    if not bare or not LOW <= guess <= HIGH:
        return MENTION
    return 1.0 if low <= guess <= high else BARE


def narrow(guess: int | None, secret: int, low: int, high: int) -> tuple[int, int]:
    """The interval still open after the hint for `guess` (unchanged when the reply had no number)."""
    if guess is None:
        return low, high
    if guess < secret:
        return max(low, guess + 1), high
    if guess > secret:
        return low, min(high, guess - 1)
    return secret, secret


def score_game(replies: list[str], secret: int) -> float:
    """The episode's reward from its replies in order (shaped; see the module docstring)."""
    low, high, total = LOW, HIGH, 0.0
    for text in replies:
        total += turn_score(text, low, high)
        low, high = narrow(parse_guess(text)[0], secret, low, high)
    last, bare = parse_guess(replies[-1]) if replies else (None, False)
    closeness = max(0.0, 1 - abs(last - secret) / (HIGH - LOW + 1)) if bare and last is not None else 0.0
    return total / max(len(replies), 1) + CLOSENESS * closeness
