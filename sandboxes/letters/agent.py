"""A toy task with a dense reward, so that the random `tiny` model has something to learn quickly.

The reward is the share of lowercase ASCII letters in the reply, at most 1. A random byte-level
model earns about 0.1 by chance, every group has reward variance, and a working trainer drives it up within a few
dozen steps. It checks the learning loop end to end; it says nothing about language ability.
"""

from __future__ import annotations

import string

MODEL = "policy"
MAX_TOKENS = 12
PROMPTS = ["say something", "write a word", "hello", "type letters", "go on", "more please", "again", "next"]


def tasks(split: str = "train"):
    for i, prompt in enumerate(PROMPTS):
        yield {"id": f"{split}-{i}", "prompt": prompt}


def reward(text: str) -> float:
    # Normalised by the reply's own length (at least MAX_TOKENS): special tokens such as <tool_call>
    # decode to several letters each, and a per-token count let a policy farm them (seen in a demo run).
    return sum(ch in string.ascii_lowercase for ch in text) / max(len(text), MAX_TOKENS)


async def rollout(task, llm) -> float:
    reply = await llm.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": task["prompt"]}], max_tokens=MAX_TOKENS
    )
    return reward(reply.choices[0].message.content or "")
