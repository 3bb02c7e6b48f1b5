"""A toy task with a dense reward, so that the random `tiny` model has something to learn quickly.

The reward is the share of lowercase ASCII letters in the reply, at most 1. A random byte-level
model earns about 0.1 by chance, every group has reward variance, and a working trainer drives it up within a few
dozen steps. It checks the learning loop end to end; it says nothing about language ability.
The sandbox is judged (sandbox.toml `judge`): the server deals the tasks of `judge.py` and scores each
episode by it from what it recorded, so a study may edit this file but not how replies are scored,
nor which tasks count. The reward this file returns is logged as `agent_reward`, never decided on.
"""

from __future__ import annotations

from reward import reward, tasks  # noqa: F401 (a sibling file, the judge's; the folder is on sys.path when it loads)

MAX_TOKENS = 12
# Eval episodes (a client with `split: eval`) sample at this fixed temperature whatever the run's
# `engine.default_temperature`, so a study that varies the training temperature scores every arm
# the same way (studies/tiny-temperature.md). 1.0 is the policy's own distribution.
EVAL_TEMPERATURE = 1.0


async def rollout(task, llm) -> float:
    fixed = {"temperature": EVAL_TEMPERATURE} if task["id"].startswith("eval-") else {}
    reply = await llm.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": task["prompt"]}], max_tokens=MAX_TOKENS, **fixed
    )
    return reward(reply.choices[0].message.content or "")
