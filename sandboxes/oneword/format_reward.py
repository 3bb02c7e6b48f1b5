"""The oneword sandbox's reward and tasks, in a file of their own that its judge imports.

A study may edit the agent but not the score nor the tasks: the judge (`judge.py`, named in
sandbox.toml) imports this file, so no proposal may change it.

Named `format_reward` rather than `reward`: sandboxes import sibling modules by plain name, and
two sandboxes loaded into one process must not share a module (letters has `reward.py`).
"""

from __future__ import annotations

import random
import re

CATEGORIES = ["fruit", "color", "animal", "country", "vegetable", "flower", "metal", "planet", "tree", "bird",
              "fish", "city", "sport", "instrument", "tool", "drink", "spice", "gem", "insect", "vehicle"]
TEMPLATES = ["Name a {c}. Answer with one lowercase word.", "Give me one {c}, as a single lowercase word.",
             "Which {c} do you like? Reply with just one word in lowercase."]
TRAIN_TASKS, EVAL_TASKS = 200, 40
LOWER_WORD = re.compile(r"^[a-z]+\.?$")
ANY_WORD = re.compile(r"^[A-Za-z]+\.?$")


def reward(text: str) -> float:
    text = text.strip()
    if LOWER_WORD.match(text):
        return 1.0
    if ANY_WORD.match(text):
        return 0.5
    return 0.25 * max(0.0, (6 - len(text.split())) / 4) if len(text.split()) > 1 else 0.0


def tasks(split: str = "train"):
    rng = random.Random(0 if split == "train" else 1)
    for i in range(TRAIN_TASKS if split == "train" else EVAL_TASKS):
        yield {"id": f"{split}-{i}", "prompt": rng.choice(TEMPLATES).format(c=rng.choice(CATEGORIES))}
