"""The arith sandbox's tasks and shaped reward, in a file of their own that its judge imports (read-only to studies).

Named `sums` so that two sandboxes loaded into one process never share a sibling module by name.
"""

from __future__ import annotations

import random
import re

TRAIN_TASKS, EVAL_TASKS = 512, 64
LOW, HIGH = 1, 20
INT_RE = re.compile(r"-?\d+")


def tasks(split: str = "train"):
    rng = random.Random(0 if split == "train" else 1)
    for i in range(TRAIN_TASKS if split == "train" else EVAL_TASKS):
        yield {"id": f"{split}-{i}", "a": rng.randint(LOW, HIGH), "b": rng.randint(LOW, HIGH)}


def reward(task, text: str) -> float:
    numbers = INT_RE.findall(text)
    if not numbers:
        return 0.0
    answer, total = int(numbers[0]), task["a"] + task["b"]
    if answer == total:
        return 1.0
    return 0.5 * max(0.0, 1.0 - abs(answer - total) / total)
