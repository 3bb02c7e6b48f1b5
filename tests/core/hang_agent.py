"""A test agent whose rollout blocks while a flag file exists: the hung client of the watchdog test.

The flag's path comes from $SWARMRL_HANG_FLAG. While it exists every rollout waits (no call, no
reward); once it is removed, rollouts make one real call and finish, so the run makes progress again.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path


def tasks(split: str = "train"):
    for i in range(4):
        yield {"id": f"{split}-{i}"}


async def rollout(task, llm) -> float:
    flag = Path(os.environ["SWARMRL_HANG_FLAG"])
    while flag.exists():
        await asyncio.sleep(0.1)
    reply = await llm.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=4)
    return float(len(reply.choices[0].message.content or ""))
