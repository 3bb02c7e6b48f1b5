"""Short arithmetic for SmolLM2-135M: "What is a + b?" with two worked examples in the context.

Measured on the base model (bench notes in docs/benchmarks.md): asked plainly, it restates the
question and rarely ends on the right number; with two examples before the question it answers with
a bare number about 80% of the time but is right only about 2% of the time. An exact-match reward
would leave nearly every group without variance, so the reward is shaped: 1 for the exact sum, else
up to 0.5 for being close (0.5 * (1 - |answer - sum| / sum)), 0 without a number. Every group then
has reward variance, and getting closer to the sum is what earns more.
"""

from __future__ import annotations

from sums import reward, tasks  # noqa: F401 (a sibling file, the judge's; the folder is on sys.path when it loads)

MAX_TOKENS = 8
EXAMPLES = [
    {"role": "user", "content": "What is 3 + 4?"},
    {"role": "assistant", "content": "7"},
    {"role": "user", "content": "What is 12 + 5?"},
    {"role": "assistant", "content": "17"},
]


def messages(task) -> list[dict]:
    return EXAMPLES + [{"role": "user", "content": f"What is {task['a']} + {task['b']}?"}]


async def rollout(task, llm) -> float:
    # No temperature here: the server's engine.default_temperature applies, so studies can vary it.
    reply = await llm.chat.completions.create(model=llm.model, messages=messages(task), max_tokens=MAX_TOKENS)
    return reward(task, reply.choices[0].message.content or "")
