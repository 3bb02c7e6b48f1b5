"""Format following for SmolLM2-135M: name one thing of a category, as a single lowercase word.

The base model usually answers in a sentence or capitalises ("Apple"), yet sometimes gives exactly
what was asked (about 4% of replies, measured). Reward: 1 for one lowercase word (an optional final
period allowed), 0.5 for one word with capitals, and for longer replies a small brevity credit
(0.25 for two words falling to 0 at six), so that nearly every group has reward variance.
The behaviour is easy to verify and quick to learn on CPU, which makes it the core's learning check.
The sandbox is judged (sandbox.toml `judge`): the server deals `judge.py`'s tasks and scores the reply it
recorded; the reward returned here is logged as `agent_reward`, never decided on.
"""

from __future__ import annotations

from format_reward import reward, tasks  # noqa: F401 (a sibling file, the judge's: kept apart so no study may edit it)

MAX_TOKENS = 8


async def rollout(task, llm) -> float:
    reply = await llm.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": task["prompt"]}],
                                              max_tokens=MAX_TOKENS)
    return reward(reply.choices[0].message.content or "")
