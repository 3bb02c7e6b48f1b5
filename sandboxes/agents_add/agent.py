"""An agent written with the OpenAI Agents SDK (`openai-agents`), unchanged, on the swarm's Responses API.

The agent has one function tool, `add`. An episode is two runs of the SDK's own `Runner`: the first
asks "What is a + b?" (the model may call `add`, the SDK runs it and sends the result back as a
`function_call_output` item, until the model answers in text), the second continues that
conversation by `previous_response_id` and asks for the bare number. The SDK talks to the server
through the episode's bound `AsyncOpenAI` (`llm`), so every model call is recorded on the episode at
the token level, exactly as a Chat Completions call would be.

Reward, in [0, 1]: 0 when a reply is cut at `MAX_TOKENS` (the SDK raises on an incomplete response)
or the model calls tools past `MAX_TURNS`; 1 when the second answer is exactly the sum; otherwise 0.25 when the model called
`add` with the task's numbers, plus up to 0.25 for the share of digits in the second answer's head
and up to 0.25 for its brevity (a random policy still gets reward variance from these, so a group
can learn the format first).
Needs the `openai-agents` package (the project's `dev` extra).
"""

from __future__ import annotations

import random
import re

from agents import Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner, function_tool
from agents.exceptions import AgentsException

# Far more than a tool call in the Hermes format (~50 tokens) or a short answer needs: a reply cut
# here is an `incomplete` response, which the SDK raises (ModelBehaviorError) and the episode scores
# 0, so the budget is generous enough that an untrained policy still ends some replies itself.
MAX_TOKENS = 256
MAX_TURNS = 4  # model calls per Runner.run: a tool call, its answer, and room for one retry
TRAIN_TASKS, EVAL_TASKS = 256, 32
LOW, HIGH = 1, 9
TOOL_CALLED, DIGITS, BRIEF = 0.25, 0.25, 0.25  # shaping weights (see the module docstring)
BRIEF_CHARS = 64  # an answer this long or longer earns no brevity: "the number only" is a few characters
INSTRUCTIONS = "You add numbers. Use the add tool, then answer with the number only."
NUMBER = re.compile(r"-?\d+")


def tasks(split: str = "train"):
    rng = random.Random(0 if split == "train" else 1)
    for i in range(TRAIN_TASKS if split == "train" else EVAL_TASKS):
        yield {"id": f"{split}-{i}", "a": rng.randint(LOW, HIGH), "b": rng.randint(LOW, HIGH)}


def reward(task, answer: str, tool_args: list[tuple[int, int]]) -> float:
    """The episode's reward from its final answer and the (a, b) of every `add` call the SDK ran."""
    answer = answer.strip()
    found = NUMBER.fullmatch(answer)
    if found and int(found.group()) == task["a"] + task["b"]:
        return 1.0
    called = TOOL_CALLED if (task["a"], task["b"]) in tool_args or (task["b"], task["a"]) in tool_args else 0.0
    if not answer:
        return called
    head = answer[:8]
    brief = BRIEF * max(0.0, 1 - len(answer) / BRIEF_CHARS)
    return called + DIGITS * sum(c.isdigit() for c in head) / len(head) + brief


def make_agent(llm, tool_args: list[tuple[int, int]]) -> Agent:
    """The agent, its model the Responses API of the episode's server, its tool noting each call."""

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        tool_args.append((a, b))
        return a + b

    return Agent(name="adder", instructions=INSTRUCTIONS, tools=[add],
                 model=OpenAIResponsesModel(model=llm.model, openai_client=llm),
                 model_settings=ModelSettings(max_tokens=MAX_TOKENS))


async def rollout(task, llm) -> float:
    tool_args: list[tuple[int, int]] = []
    agent = make_agent(llm, tool_args)
    config = RunConfig(tracing_disabled=True)  # no trace upload: the server records everything
    try:
        first = await Runner.run(agent, f"What is {task['a']} + {task['b']}?", max_turns=MAX_TURNS, run_config=config)
        second = await Runner.run(agent, "Say just the number.", previous_response_id=first.last_response_id,
                                  max_turns=MAX_TURNS, run_config=config)
    except AgentsException:  # cut at MAX_TOKENS (an incomplete response) or tools past MAX_TURNS: a failed game
        return 0.0
    return reward(task, str(second.final_output or ""), tool_args)
