"""A LangGraph ReAct agent as a swarm client on every route: unmodified agent code, episode-bound endpoint.

The same agent runs on Chat Completions and on Responses (LangChain's ChatOpenAI) and on Messages
(ChatAnthropic, with its default `max_tokens`, which a 2048-token model cannot fit and the Messages
route caps): the tool really runs with the model's arguments, every model call is recorded, and the
second call reuses the first one's exact ids whatever JSON LangChain echoes the call back in.
"""

from __future__ import annotations

import pytest
from langchain_anthropic import ChatAnthropic
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent

from core.clients.sdk import SwarmClient
from tests.support import USER_PROMPTS, tiny_policy


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def chat_model(route: str, ep):
    if route == "messages":  # the anthropic SDK appends /v1/messages and sends the key as x-api-key
        return ChatAnthropic(model="policy", base_url=ep.base_url.removesuffix("/").removesuffix("/v1"),
                             api_key=ep.api_key, temperature=0, max_retries=0)
    return ChatOpenAI(model="policy", base_url=ep.base_url, api_key=ep.api_key, temperature=0, max_tokens=80,
                      use_responses_api=route == "responses", max_retries=0)


@pytest.mark.slow
@pytest.mark.parametrize("route", ["chat", "responses", "messages"])
def test_react_agent_calls_the_tool_and_every_call_is_recorded(live_server, tool_model, route):
    model, tok = tool_model
    server = live_server({"policy": tiny_policy(model, tok)})
    with SwarmClient(server.url).episode(task_id=f"react-{route}") as ep:
        agent = create_react_agent(chat_model(route, ep), [add])
        result = agent.invoke({"messages": [("user", USER_PROMPTS[0])]}, {"recursion_limit": 8})
        kinds = [m.type for m in result["messages"]]
        assert kinds[:3] == ["human", "ai", "tool"]
        assert result["messages"][2].content == "5"  # the tool really ran with the model's arguments
        recorded = server.registry._open[ep.id].calls
        assert len(recorded) == kinds.count("ai")
        assert recorded[1].reused_prefix == len(recorded[0].prompt_ids) + len(recorded[0].completion_ids)
        ep.finish(1.0)
