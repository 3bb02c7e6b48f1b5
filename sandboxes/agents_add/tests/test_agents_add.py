"""The agents_add sandbox's own tests: tasks and the shaped reward (its episodes on a live server, and a
tiny training run, are in tests/core/test_agent_sandboxes.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

FOLDER = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(FOLDER))
_spec = importlib.util.spec_from_file_location("agents_add_under_test", FOLDER / "agent.py")
agent = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(agent)
sys.path.remove(str(FOLDER))


def test_tasks_are_deterministic_and_split_apart():
    assert list(agent.tasks("train"))[:3] == list(agent.tasks("train"))[:3]
    assert list(agent.tasks("train"))[0] != list(agent.tasks("eval"))[0]


def test_the_exact_sum_scores_one_whatever_the_tool_use():
    assert agent.reward({"a": 3, "b": 4}, " 7 ", []) == 1.0
    assert agent.reward({"a": 3, "b": 4}, "7", [(3, 4)]) == 1.0


def test_a_wrong_answer_earns_only_the_tool_call_the_digit_share_and_brevity():
    task = {"a": 3, "b": 4}
    brief = agent.BRIEF * (1 - 1 / agent.BRIEF_CHARS)  # a one-character answer
    assert agent.reward(task, "8", [(4, 3)]) == pytest.approx(agent.TOOL_CALLED + agent.DIGITS + brief)
    assert agent.reward(task, "8", [(1, 2)]) == pytest.approx(agent.DIGITS + brief)  # other numbers: no tool credit
    assert agent.reward(task, "ab12", []) == pytest.approx(agent.DIGITS / 2 + agent.BRIEF * (1 - 4 / agent.BRIEF_CHARS))
    assert agent.reward(task, "x" * agent.BRIEF_CHARS, []) == 0.0
    assert agent.reward(task, "", [(3, 4)]) == agent.TOOL_CALLED  # no answer earns no brevity
