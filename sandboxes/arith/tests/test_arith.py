"""The arith sandbox's own tests: tasks, the shaped reward, and one rollout against a scripted model."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

FOLDER = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(FOLDER))
_spec = importlib.util.spec_from_file_location("arith_under_test", FOLDER / "agent.py")
agent = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(agent)
_spec = importlib.util.spec_from_file_location("arith_judge_under_test", FOLDER / "judge.py")
judge = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(judge)
sys.path.remove(str(FOLDER))


def test_tasks_are_deterministic_and_split_apart():
    assert list(agent.tasks("train"))[:3] == list(agent.tasks("train"))[:3]
    assert list(agent.tasks("train"))[0] != list(agent.tasks("eval"))[0]


def test_exact_sum_scores_one_and_close_answers_score_less():
    task = {"a": 3, "b": 4}
    assert agent.reward(task, "7") == 1.0
    assert 0.0 < agent.reward(task, "8") < 0.5 + 1e-9
    assert agent.reward(task, "no number") == 0.0


def test_rollout_scores_the_models_reply():
    async def create(**request):
        return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content="7"))])

    llm = SimpleNamespace(model="policy", chat=SimpleNamespace(completions=SimpleNamespace(create=create)))
    assert asyncio.run(agent.rollout({"id": "t", "a": 3, "b": 4}, llm)) == 1.0


def test_the_judge_owns_the_tasks_and_scores_the_reply_the_server_recorded():
    assert list(judge.tasks("eval")) == list(agent.tasks("eval"))
    assert judge.score({"a": 3, "b": 4}, SimpleNamespace(completion="7", answer=0.0)) == 1.0
    assert judge.score({"a": 3, "b": 4}, SimpleNamespace(completion="no number")) == judge.FAILURE == 0.0
