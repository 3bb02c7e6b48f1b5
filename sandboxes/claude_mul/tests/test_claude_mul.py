"""The claude_mul sandbox's own tests: tasks, the tool and the shaped reward (its episodes on a live server,
and a tiny training run, are in tests/core/test_agent_sandboxes.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

FOLDER = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(FOLDER))
_spec = importlib.util.spec_from_file_location("claude_mul_under_test", FOLDER / "agent.py")
agent = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(agent)
sys.path.remove(str(FOLDER))


def test_tasks_are_deterministic_and_split_apart():
    assert list(agent.tasks("train"))[:3] == list(agent.tasks("train"))[:3]
    assert list(agent.tasks("train"))[0] != list(agent.tasks("eval"))[0]


def test_the_tool_multiplies_integers_and_explains_a_bad_call():
    assert agent.run_tool(SimpleNamespace(name="multiply", input={"x": 3, "y": 4})) == "12"
    assert agent.run_tool(SimpleNamespace(name="multiply", input={"x": "3", "y": 4})).startswith("error")
    assert agent.run_tool(SimpleNamespace(name="divide", input={"x": 3, "y": 4})).startswith("error")


def test_the_exact_product_scores_one_and_a_wrong_one_only_its_shaping():
    task = {"x": 3, "y": 4}
    assert agent.score(task, "12", set()) == 1.0
    assert agent.score(task, "13", {(4, 3)}) == agent.TOOL_USED + agent.DIGIT_SHARE
    assert agent.score(task, "x1", set()) == agent.DIGIT_SHARE / 2
    assert agent.score(task, "", {(1, 1)}) == 0.0
