"""A Claude-style tool loop written with the `anthropic` SDK, unchanged, on the swarm's Messages API.

The loop is the one Anthropic documents: send the conversation with the `multiply` tool; while the
reply stops on `tool_use`, run each tool and answer with `tool_result` blocks in a user turn; then ask
for the bare number. The SDK reaches the server at the episode's base URL with the episode key as
its `x-api-key`, so every model call is recorded on the episode at the token level, exactly as a
Chat Completions call would be.

Reward, in [0, 1]: 1 when the last answer is exactly the product; otherwise 0.25 when the model used
`multiply` on the task's numbers, plus up to 0.25 for how much of the answer's head is digits (reward
variance for a random policy, so a group can learn the format first).
Needs the `anthropic` package (the project's `dev` extra).
"""

from __future__ import annotations

import random
import re

import anthropic

MAX_TOKENS = 24  # a tool call of the tiny tool format fits; chatter past it is cut (and costs CPU time)
MAX_TOOL_ROUNDS = 3  # tool_use replies answered before the loop gives up on the model
TRAIN_TASKS, EVAL_TASKS = 256, 32
LOW, HIGH = 2, 9
TOOL_USED, DIGIT_SHARE = 0.25, 0.25  # shaping weights (see the module docstring)
SYSTEM = "You multiply numbers. Use the multiply tool, then answer with the number only."
MULTIPLY = {"name": "multiply", "description": "Multiply two integers.",
            "input_schema": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                             "required": ["x", "y"]}}
INTEGER = re.compile(r"-?\d+")


def tasks(split: str = "train"):
    rng = random.Random(0 if split == "train" else 1)
    for i in range(TRAIN_TASKS if split == "train" else EVAL_TASKS):
        yield {"id": f"{split}-{i}", "x": rng.randint(LOW, HIGH), "y": rng.randint(LOW, HIGH)}


def run_tool(block) -> str:
    """The tool_result content for one tool_use block: the product, or what was wrong with the call."""
    args = block.input if isinstance(block.input, dict) else {}
    if block.name != "multiply" or not all(isinstance(args.get(k), int) for k in ("x", "y")):
        return f"error: multiply takes integers x and y, got {block.name} {args}"
    return str(args["x"] * args["y"])


def score(task, answer: str, used: set[tuple[int, int]]) -> float:
    """The episode's reward from its last answer and the (x, y) pairs it multiplied with the tool."""
    exact = INTEGER.fullmatch(answer.strip())
    if exact and int(exact.group()) == task["x"] * task["y"]:
        return 1.0
    pair = {(task["x"], task["y"]), (task["y"], task["x"])}
    head = answer.strip()[:8]
    return (TOOL_USED if used & pair else 0.0) + DIGIT_SHARE * (sum(map(str.isdigit, head)) / max(len(head), 1))


def client_for(llm) -> anthropic.AsyncAnthropic:
    """An anthropic client on the episode: the server's root (the SDK appends /v1/messages), its key."""
    root = str(llm.base_url).rstrip("/").removesuffix("/v1")
    return anthropic.AsyncAnthropic(base_url=root, api_key=llm.api_key, max_retries=2)


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


async def rollout(task, llm) -> float:
    client = client_for(llm)
    messages = [{"role": "user", "content": f"What is {task['x']} times {task['y']}?"}]
    used: set[tuple[int, int]] = set()
    ask = {"model": llm.model, "max_tokens": MAX_TOKENS, "system": SYSTEM, "tools": [MULTIPLY]}
    async with client:
        reply = await client.messages.create(messages=messages, **ask)
        for _ in range(MAX_TOOL_ROUNDS):
            if reply.stop_reason != "tool_use":
                break
            messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
            results = []
            for block in (b for b in reply.content if b.type == "tool_use"):
                content = run_tool(block)
                if not content.startswith("error"):
                    used.add((block.input["x"], block.input["y"]))
                results.append({"type": "tool_result", "tool_use_id": block.id, "content": content})
            messages.append({"role": "user", "content": results})
            reply = await client.messages.create(messages=messages, **ask)
        if reply.stop_reason == "tool_use":  # still calling tools after MAX_TOOL_ROUNDS: no answer
            return score(task, "", used)
        # The reply exactly as the model gave it, so the server reuses its ids (token-in-token-out).
        messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]},
                     {"role": "user", "content": "Say just the number."}]
        final = await client.messages.create(messages=messages, **ask)
    return score(task, text_of(final), used)
