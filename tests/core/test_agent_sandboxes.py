"""The two agent-harness sandboxes: the OpenAI Agents SDK one (`agents_add`, Responses API) and the anthropic
SDK one (`claude_mul`, Messages API), unchanged agent code against a real swarm server.

With a scripted policy (a test double of the LLM: fixed replies, so the tool path is certain) each
rollout runs its whole tool loop, and its episode records every call with the later turns reusing
the earlier ones' exact ids. With the tiny model each sandbox trains in a tiny `swarm run`-style run:
a step happens and its reward is logged.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from core.clients.sandbox import load_agent
from core.clients.sdk import SwarmClient
from core.config_io import load_config
from core.engine import Generation, scoring_temperature
from core.engine.null import NullEngine
from core.models import build_tiny
from core.run.loop import CoreRun
from core.serve.chat import ChatRenderer
from core.serve.state import Policy
from tests.support import train_in_process

ROOT = Path(__file__).resolve().parents[2]


class ScriptedEngine(NullEngine):
    """A scripted LLM: each generation is the next of `replies` (text, then the end token)."""

    def __init__(self, tokenizer, replies: list[str]):
        super().__init__(tokenizer, 2048)
        self.replies = [tokenizer.encode(r, add_special_tokens=False) + [tokenizer.eos_token_id] for r in replies]

    async def generate(self, prompt_ids, params, on_token=None) -> Generation:
        ids = self.replies.pop(0)
        for t in ids if on_token is not None else ():
            on_token(t)
        return Generation(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop", version=self.version,
                          temperature=scoring_temperature(params.temperature), top_p=params.top_p)


def tool_call(name: str, **args) -> str:
    """A tool call as the policies' template writes it (Hermes)."""
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


@pytest.mark.parametrize("sandbox,task,replies", [
    ("agents_add", {"id": "t", "a": 3, "b": 4}, [tool_call("add", a=3, b=4), "7", "7"]),
    ("claude_mul", {"id": "t", "x": 3, "y": 4}, [tool_call("multiply", x=3, y=4), "12", "12"]),
])
def test_a_rollout_runs_its_tool_loop_over_three_recorded_calls(live_server, sandbox, task, replies):
    model, tok = build_tiny()
    engine = ScriptedEngine(tok, replies)
    server = live_server({"policy": Policy("policy", model, tok, ChatRenderer(tok), engine)})
    agent = load_agent(str(ROOT / "sandboxes" / sandbox))

    async def episode():
        async with SwarmClient(server.url).aepisode(task_id="t", sandbox=sandbox) as ep:
            reward = (await agent.rollout(task, ep.openai)).reward  # the loader's Outcome
            calls = list(server.registry._open[ep.id].calls)
            await ep.finish(reward)
        return reward, calls

    reward, calls = asyncio.run(episode())
    assert reward == 1.0 and engine.replies == []
    assert len(calls) == 3 and calls[0].reply["tool_calls"][0]["function"]["name"] == ("add" if sandbox == "agents_add"
                                                                                        else "multiply")
    for prev, call in zip(calls, calls[1:]):  # each turn extends the last: token-in-token-out, one timeline
        assert call.reused_prefix == len(prev.prompt_ids) + len(prev.completion_ids)
    # the tool ran in the agent's process and its result went back as a tool turn
    assert [m["content"] for m in calls[1].messages if m["role"] == "tool"] == [replies[1]]


@pytest.mark.slow
@pytest.mark.parametrize("sandbox", ["agents_add", "claude_mul"])
def test_the_sandbox_trains_in_a_tiny_run(tmp_path, sandbox):
    # The untrained tiny model rarely ends a reply within the sandbox's token budget, so a group whose
    # rewards all tie (no PPO term) is common, and three of them in a row happened under load in CI
    # (train/tokens 0). A KL term runs every sample through the model whatever its advantage.
    cfg = load_config(ROOT / "configs" / "tiny.yaml", [
        f"trainer.checkpoint_dir={tmp_path / 'ckpt'}", "trainer.steps=1", "trainer.batch_groups=3",
        "trainer.group_size=4", "trainer.kl_coef=0.01", f"clients=[{{agent: 'sandbox:{sandbox}', concurrency: 4}}]"])
    core = CoreRun(cfg)
    steps: list[tuple[int, dict]] = []
    train_in_process(core, on_step=lambda step, m: steps.append((step, m)))
    assert [s for s, _ in steps] == [1]
    metrics = steps[0][1]
    assert 0.0 <= metrics[f"reward/{sandbox}/mean"] <= 1.0
    assert metrics["train/tokens"] > 0  # the policy's own tokens were trained on
