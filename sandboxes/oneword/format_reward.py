"""The oneword sandbox's reward, in a file of its own so a study may edit the agent but not the score.

Named `format_reward` rather than `reward`: sandboxes import sibling modules by plain name, and
two sandboxes loaded into one process must not share a module (letters has `reward.py`).
"""

from __future__ import annotations

import re

LOWER_WORD = re.compile(r"^[a-z]+\.?$")
ANY_WORD = re.compile(r"^[A-Za-z]+\.?$")


def reward(text: str) -> float:
    text = text.strip()
    if LOWER_WORD.match(text):
        return 1.0
    if ANY_WORD.match(text):
        return 0.5
    return 0.25 * max(0.0, (6 - len(text.split())) / 4) if len(text.split()) > 1 else 0.0
