"""A LangGraph ReAct agent as a swarm client: unmodified agent code, episode-bound OpenAI endpoint."""

from __future__ import annotations

import pytest
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent

from core.clients.sdk import SwarmClient
from tests.support import USER_PROMPTS, tiny_policy


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@pytest.mark.slow
def test_react_agent_calls_the_tool_and_every_call_is_recorded(live_server, tool_model):
    model, tok = tool_model
    server = live_server({"policy": tiny_policy(model, tok)})
    with SwarmClient(server.url).episode(task_id="react") as ep:
        llm = ChatOpenAI(model="policy", base_url=ep.base_url, api_key=ep.api_key, temperature=0, max_tokens=80)
        agent = create_react_agent(llm, [add])
        result = agent.invoke({"messages": [("user", USER_PROMPTS[0])]}, {"recursion_limit": 8})
        kinds = [m.type for m in result["messages"]]
        assert kinds[:3] == ["human", "ai", "tool"]
        assert result["messages"][2].content == "5"  # the tool really ran with the model's arguments
        recorded = server.registry._open[ep.id].calls
        assert len(recorded) == kinds.count("ai")
        assert recorded[1].reused_prefix == len(recorded[0].prompt_ids) + len(recorded[0].completion_ids)
        ep.finish(1.0)
