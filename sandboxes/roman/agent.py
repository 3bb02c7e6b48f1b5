"""Roman numerals: write a number from 1 to 50 in Roman numerals, one call per episode.

It exists to show a sandbox with dependencies of its own: the reward parses the reply with the
`roman` package, which `sandbox.toml` lists under `requirements` and which the project does not
install. An isolated client of this sandbox runs in a cached venv holding it (`core.contain.venvs`).
Reward: 1 for the right numeral, 0.25 for a valid numeral of another number, 0 otherwise. The sandbox is
judged (sandbox.toml `judge`): the server deals `judge.py`'s tasks and scores the reply it recorded with
`numerals.py` (pure Python, as the server has no `roman`); the reward this file returns is only logged.
"""

from __future__ import annotations

import roman  # this sandbox's own dependency (sandbox.toml: requirements)
from numerals import HIGHEST, tasks  # noqa: F401 (the judge's file: the tasks it deals)

MAX_TOKENS = 8


def reward(reply: str, n: int) -> float:
    words = reply.strip().rstrip(".").split()
    if not words:
        return 0.0
    try:
        value = roman.fromRoman(words[0].upper())
    except roman.InvalidRomanNumeralError:
        return 0.0
    return 1.0 if value == n else 0.25


async def rollout(task, llm) -> float:
    reply = await llm.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": task["prompt"]}],
                                              max_tokens=MAX_TOKENS)
    return reward(reply.choices[0].message.content or "", task["n"])
