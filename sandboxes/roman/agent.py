"""Roman numerals: write a number from 1 to 50 in Roman numerals, one call per episode.

It exists to show a sandbox with dependencies of its own: the reward parses the reply with the
`roman` package, which `sandbox.toml` lists under `requirements` and which the project does not
install. An isolated client of this sandbox runs in a cached venv holding it (`core.clients.venvs`).
Reward: 1 for the right numeral, 0.25 for a valid numeral of another number, 0 otherwise.
"""

from __future__ import annotations

import random

import roman  # this sandbox's own dependency (sandbox.toml: requirements)

MAX_TOKENS = 8
HIGHEST = 50


def tasks(split: str = "train"):
    rng = random.Random(0 if split == "train" else 1)
    for i in range(100 if split == "train" else 20):
        n = rng.randint(1, HIGHEST)
        yield {"id": f"{split}-{i}", "n": n, "prompt": f"Write {n} in Roman numerals. Answer with the numeral only."}


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
