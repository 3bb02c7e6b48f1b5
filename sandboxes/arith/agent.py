"""Short arithmetic for SmolLM2-135M: "What is a + b?" with two worked examples in the context.

Measured on the base model (bench notes in docs/benchmarks.md): asked plainly, it restates the
question and rarely ends on the right number; with two examples before the question it answers with
a bare number about 80% of the time but is right only about 2% of the time. An exact-match reward
would leave nearly every group without variance, so the reward is shaped: 1 for the exact sum, else
up to 0.5 for being close (0.5 * (1 - |answer - sum| / sum)), 0 without a number. Every group then
has reward variance, and getting closer to the sum is what earns more.
"""

from __future__ import annotations

import random
import re

MAX_TOKENS = 8
TRAIN_TASKS, EVAL_TASKS = 512, 64
LOW, HIGH = 1, 20
INT_RE = re.compile(r"-?\d+")
EXAMPLES = [
    {"role": "user", "content": "What is 3 + 4?"},
    {"role": "assistant", "content": "7"},
    {"role": "user", "content": "What is 12 + 5?"},
    {"role": "assistant", "content": "17"},
]


def tasks(split: str = "train"):
    rng = random.Random(0 if split == "train" else 1)
    for i in range(TRAIN_TASKS if split == "train" else EVAL_TASKS):
        yield {"id": f"{split}-{i}", "a": rng.randint(LOW, HIGH), "b": rng.randint(LOW, HIGH)}


def messages(task) -> list[dict]:
    return EXAMPLES + [{"role": "user", "content": f"What is {task['a']} + {task['b']}?"}]


def reward(task, text: str) -> float:
    numbers = INT_RE.findall(text)
    if not numbers:
        return 0.0
    answer, total = int(numbers[0]), task["a"] + task["b"]
    if answer == total:
        return 1.0
    return 0.5 * max(0.0, 1.0 - abs(answer - total) / total)


async def rollout(task, llm) -> float:
    # No temperature here: the server's engine.default_temperature applies, so studies can vary it.
    reply = await llm.chat.completions.create(model=llm.model, messages=messages(task), max_tokens=MAX_TOKENS)
    return reward(task, reply.choices[0].message.content or "")
