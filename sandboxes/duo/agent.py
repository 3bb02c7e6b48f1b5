"""Two trainable policies act in one episode, and each gets its own reward: a drafter and a reviewer.

The drafter answers the prompt; the reviewer reads the draft and answers it. The episode finishes
with `{"drafter": r_d, "reviewer": r_r}`, so each model's trainer learns from its own signal on its
own tokens (the reviewer's prompt holds the draft, but the draft's tokens are the drafter's: they
never enter the reviewer's loss mask). The rewards are dense toys that the random `tiny` models can
learn, chosen to pull in different directions so a mix-up shows: the drafter is scored on the share
of lowercase letters in its draft, the reviewer on the share of UPPERCASE letters in its review.
It checks multi-model training end to end; it says nothing about reviewing ability.

The models are named by role, so a run config serves them under these names (`configs/tiny-duo.yaml`,
`configs/smollm2-tiny-duo.yaml`); a server that lacks one answers 404 naming the models it serves.
"""

from __future__ import annotations

import string

DRAFTER, REVIEWER = "drafter", "reviewer"  # the served model names this sandbox calls
MAX_TOKENS = 12
# Replies shorter than this count as this long, so a one-letter reply cannot score 1 (as in letters).
MIN_LENGTH = 12
PROMPTS = ["say something", "write a word", "hello", "type letters", "go on", "more please", "again", "next"]


def tasks(split: str = "train"):
    for i, prompt in enumerate(PROMPTS):
        yield {"id": f"{split}-{i}", "prompt": prompt}


def share(text: str, alphabet: str) -> float:
    """The share of the reply's characters drawn from `alphabet`, over at least MIN_LENGTH characters."""
    return sum(ch in alphabet for ch in text) / max(len(text), MIN_LENGTH)


def rewards(draft: str, review: str) -> dict[str, float]:
    return {DRAFTER: share(draft, string.ascii_lowercase), REVIEWER: share(review, string.ascii_uppercase)}


async def rollout(task, llm) -> dict[str, float]:
    first = await llm.chat.completions.create(
        model=DRAFTER, messages=[{"role": "user", "content": task["prompt"]}], max_tokens=MAX_TOKENS)
    draft = first.choices[0].message.content or ""
    second = await llm.chat.completions.create(
        model=REVIEWER, max_tokens=MAX_TOKENS,
        messages=[{"role": "user", "content": f"Review this reply to {task['prompt']!r}: {draft}"}])
    return rewards(draft, second.choices[0].message.content or "")
