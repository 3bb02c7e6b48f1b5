"""Format following for SmolLM2-135M: name one thing of a category, as a single lowercase word.

The base model usually answers in a sentence or capitalises ("Apple"), yet sometimes gives exactly
what was asked (about 4% of replies, measured). Reward: 1 for one lowercase word (an optional final
period allowed), 0.5 for one word with capitals, and for longer replies a small brevity credit
(0.25 for two words falling to 0 at six), so that nearly every group has reward variance.
The behaviour is easy to verify and quick to learn on CPU, which makes it the core's learning check.
"""

from __future__ import annotations

import random

from format_reward import reward  # a sibling file (kept apart so studies can mark it read-only)

MAX_TOKENS = 8
CATEGORIES = ["fruit", "color", "animal", "country", "vegetable", "flower", "metal", "planet", "tree", "bird",
              "fish", "city", "sport", "instrument", "tool", "drink", "spice", "gem", "insect", "vehicle"]
TEMPLATES = ["Name a {c}. Answer with one lowercase word.", "Give me one {c}, as a single lowercase word.",
             "Which {c} do you like? Reply with just one word in lowercase."]


def tasks(split: str = "train"):
    rng = random.Random(0 if split == "train" else 1)
    for i in range(200 if split == "train" else 40):
        yield {"id": f"{split}-{i}", "prompt": rng.choice(TEMPLATES).format(c=rng.choice(CATEGORIES))}


async def rollout(task, llm) -> float:
    reply = await llm.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": task["prompt"]}],
                                              max_tokens=MAX_TOKENS)
    return reward(reply.choices[0].message.content or "")
