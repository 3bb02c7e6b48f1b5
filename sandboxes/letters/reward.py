"""The letters sandbox's reward and tasks, in a file of their own that its judge imports.

A study that edits the sandbox's prompt or agent loop must not be able to win by changing how it
is scored or which tasks it is scored on (as MLGym keeps its evaluator read-only). The judge
(`judge.py`, named in sandbox.toml) imports this file, so no proposal may change it; the agent
imports it too, for its own (logged, never decided on) reward.
"""

from __future__ import annotations

import string

PROMPTS = ["say something", "write a word", "hello", "type letters", "go on", "more please", "again", "next"]
# Replies shorter than this count as this long: short replies cannot reach 1 just by being one letter.
MIN_LENGTH = 12


def reward(text: str) -> float:
    """The share of lowercase ASCII letters in the reply, at most 1."""
    # Normalised by the reply's own length (at least MIN_LENGTH): special tokens such as <tool_call>
    # decode to several letters each, and a per-token count let a policy farm them (seen in a demo run).
    return sum(ch in string.ascii_lowercase for ch in text) / max(len(text), MIN_LENGTH)


def tasks(split: str = "train"):
    for i, prompt in enumerate(PROMPTS):
        yield {"id": f"{split}-{i}", "prompt": prompt}
