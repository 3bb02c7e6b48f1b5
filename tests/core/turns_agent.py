"""A test agent of multi-turn episodes: three calls per episode, a short pause between them.

The pause keeps episodes open across turns, as tool calls do, so a replica killed mid-run has open
episodes to lose. The reward (the reply's length) varies, so every group trains.
"""

from __future__ import annotations

import asyncio

TURNS = 3  # calls per episode: a trained episode with fewer was cut short
PAUSE_S = 0.2  # "tool time" between two calls


def tasks(split: str = "train"):
    for i in range(8):
        yield {"id": f"{split}-{i}", "prompt": f"count to {i}"}


async def rollout(task, llm) -> float:
    messages = [{"role": "user", "content": task["prompt"]}]
    total = 0
    for turn in range(TURNS):
        reply = await llm.chat.completions.create(model=llm.model, messages=messages, max_tokens=6)
        text = reply.choices[0].message.content or ""
        total += len(text)
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"turn {turn + 1}"}]
        await asyncio.sleep(PAUSE_S)
    return float(total % 7)
