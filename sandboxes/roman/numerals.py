"""The roman sandbox's tasks and its judge's scoring, in pure Python: the judge runs in the server, which does
not install the `roman` package this sandbox's agent depends on (sandbox.toml `requirements`).

A numeral counts when it is the canonical Roman numeral of a number from 1 to 3999 (what `roman.toRoman`
writes and `roman.fromRoman` accepts). Named `numerals` so that two sandboxes loaded into one process
never share a sibling module by name. Read-only to studies: the judge imports it.
"""

from __future__ import annotations

import random

HIGHEST = 50
TRAIN_TASKS, EVAL_TASKS = 100, 20
LARGEST = 3999  # the largest number standard Roman numerals write
SYMBOLS = [(1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"), (50, "L"), (40, "XL"),
           (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I")]


def tasks(split: str = "train"):
    rng = random.Random(0 if split == "train" else 1)
    for i in range(TRAIN_TASKS if split == "train" else EVAL_TASKS):
        n = rng.randint(1, HIGHEST)
        yield {"id": f"{split}-{i}", "n": n, "prompt": f"Write {n} in Roman numerals. Answer with the numeral only."}


def to_roman(n: int) -> str:
    out = []
    for value, symbol in SYMBOLS:
        count, n = divmod(n, value)
        out.append(symbol * count)
    return "".join(out)


VALUES = {to_roman(n): n for n in range(1, LARGEST + 1)}  # every canonical numeral -> its number


def reward(reply: str, n: int) -> float:
    """1 for the right numeral as the reply's first word, 0.25 for a valid numeral of another number, else 0."""
    words = reply.strip().rstrip(".").split()
    value = VALUES.get(words[0].upper()) if words else None
    if value is None:
        return 0.0
    return 1.0 if value == n else 0.25
