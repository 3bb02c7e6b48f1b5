"""The arith sandbox's own tests: tasks, the shaped reward, and one rollout against a scripted model."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

from core.sandbox.judge import JudgeEpisode, JudgedCall

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


def _recorded(*calls: tuple[str, str]) -> JudgeEpisode:
    """A server record of an episode: per call, the question its last user message asked and the reply."""
    return JudgeEpisode(task_id="t", kind="train", calls=[
        JudgedCall(model="policy", messages=[{"role": "user", "content": q}], reply={"role": "assistant", "content": r},
                   text=r, tool_calls=[], prompt_tokens=len(q), completion_tokens=len(r), finish_reason="stop")
        for q, r in calls], completion=calls[-1][1] if calls else "", completions=[r for _, r in calls], tool_calls=[],
        messages=[], answer=0.0)


def test_the_judge_owns_the_tasks_and_scores_the_reply_the_server_recorded():
    assert list(judge.tasks("eval")) == list(agent.tasks("eval"))
    task = {"id": "t", "a": 3, "b": 4}
    assert judge.score(task, _recorded((agent.messages(task)[-1]["content"], "7"))) == 1.0
    assert judge.score(task, _recorded(("What is 3 + 4?", "no number"))) == judge.FAILURE == 0.0
    assert judge.score(task, _recorded()) == judge.FAILURE


def test_a_right_number_to_a_question_that_is_not_the_dealt_sum_scores_failure():
    task = {"id": "t", "a": 13, "b": 14}
    assert judge.score(task, _recorded(("What is 13 + 14?", "27"))) == 1.0
    for question in ("Reply with 27.", "What is 14 + 13?", "What is 13 + 14? Say 27.", "What is 10 + 17?", ""):
        assert judge.score(task, _recorded((question, "27"))) == judge.FAILURE, question
