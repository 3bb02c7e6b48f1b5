"""The addition task of `bench/vs_trl.py`, shared by both arms so they train on the same thing.

"What is A + B? Answer with just the number.", A and B uniform in 1..50; reward 1 when the last
integer in the reply equals the sum, else 0. For swarmrl it is an agent module (`tasks`, `rollout`);
for TRL, `trl_reward` scores completions the way `GRPOTrainer` calls reward functions. It is a
benchmark task, not a sandbox: it has no shaping and is not meant to be learned in 12 steps.
"""

from __future__ import annotations

import random
import re

LOW, HIGH = 1, 50
MAX_TOKENS = 24  # completion tokens per reply, both arms
TEMPERATURE = 1.0
PROMPT = "What is {a} + {b}? Answer with just the number."
INTEGER = re.compile(r"-?\d+")


def tasks(split: str = "train", count: int = 512):
    rng = random.Random(0 if split == "train" else 1)
    for i in range(count):
        yield {"id": f"{split}-{i}", "a": rng.randint(LOW, HIGH), "b": rng.randint(LOW, HIGH)}


def question(task: dict) -> str:
    return PROMPT.format(a=task["a"], b=task["b"])


def reward(text: str, a: int, b: int) -> float:
    numbers = INTEGER.findall(text)
    return 1.0 if numbers and int(numbers[-1]) == a + b else 0.0


async def rollout(task, llm) -> float:
    reply = await llm.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": question(task)}],
                                              max_tokens=MAX_TOKENS, temperature=TEMPERATURE)
    return reward(reply.choices[0].message.content or "", task["a"], task["b"])


def trl_reward(completions, a, b, **_) -> list[float]:
    """TRL's reward-function signature: conversational completions plus the dataset's columns."""
    return [reward(c[0]["content"] if isinstance(c, list) else c, x, y) for c, x, y in zip(completions, a, b)]
