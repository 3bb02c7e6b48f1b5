"""The letters sandbox's reward, kept in a file of its own so studies can mark it read-only.

A study that edits the sandbox's prompt or agent loop must not be able to win by changing how it
is scored (as MLGym keeps its evaluator read-only); `studies/tiny-code.md` lists this file under
`code.readonly`.
"""

from __future__ import annotations

import string

# Replies shorter than this count as this long: short replies cannot reach 1 just by being one letter.
MIN_LENGTH = 12


def reward(text: str) -> float:
    """The share of lowercase ASCII letters in the reply, at most 1."""
    # Normalised by the reply's own length (at least MIN_LENGTH): special tokens such as <tool_call>
    # decode to several letters each, and a per-token count let a policy farm them (seen in a demo run).
    return sum(ch in string.ascii_lowercase for ch in text) / max(len(text), MIN_LENGTH)
