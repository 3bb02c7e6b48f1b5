"""The oneword sandbox's own tests: tasks, the format reward, and one rollout against a scripted model."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

from core.sandbox.judge import JudgeEpisode, JudgedCall

FOLDER = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(FOLDER))
_spec = importlib.util.spec_from_file_location("oneword_under_test", FOLDER / "agent.py")
agent = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(agent)
_spec = importlib.util.spec_from_file_location("oneword_reward_under_test", FOLDER / "format_reward.py")
scoring = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scoring)
_spec = importlib.util.spec_from_file_location("oneword_judge_under_test", FOLDER / "judge.py")
judge = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(judge)
sys.path.remove(str(FOLDER))


def test_tasks_ask_for_one_lowercase_word():
    tasks = list(agent.tasks("train"))
    assert tasks and all("word" in t["prompt"] for t in tasks)


def test_one_lowercase_word_beats_capitals_beats_a_sentence():
    assert scoring.reward("apple") == 1.0
    assert scoring.reward("Apple") == 0.5
    assert scoring.reward("I like apples") < 0.5
    assert scoring.reward("") == 0.0


def test_rollout_scores_the_models_reply():
    async def create(**request):
        return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content="pear"))])

    llm = SimpleNamespace(model="policy", chat=SimpleNamespace(completions=SimpleNamespace(create=create)))
    assert asyncio.run(agent.rollout(next(iter(agent.tasks("train"))), llm)) == 1.0


def _recorded(*calls: tuple[str, str]) -> JudgeEpisode:
    """A server record of an episode: per call, the question its last user message asked and the reply."""
    return JudgeEpisode(task_id="t", kind="train", calls=[
        JudgedCall(model="policy", messages=[{"role": "user", "content": q}], reply={"role": "assistant", "content": r},
                   text=r, tool_calls=[], prompt_tokens=len(q), completion_tokens=len(r), finish_reason="stop")
        for q, r in calls], completion=calls[-1][1] if calls else "", completions=[r for _, r in calls], tool_calls=[],
        messages=[], answer=0.0)


def test_the_judge_owns_the_tasks_and_scores_the_reply_the_server_recorded():
    assert list(judge.tasks("train")) == list(agent.tasks("train")) and len(list(judge.tasks("eval"))) == 40
    task = next(iter(judge.tasks("train")))
    assert judge.score(task, _recorded((task["prompt"], "apple"))) == 1.0
    assert judge.score(task, _recorded((task["prompt"], "I like apples a lot"))) == scoring.reward("I like apples a lot")
    assert judge.FAILURE == 0.0 and judge.score(task, _recorded()) == judge.FAILURE


def test_a_reply_to_a_prompt_that_does_not_carry_the_dealt_task_scores_failure():
    task = next(iter(judge.tasks("train")))
    other = next(t for t in judge.tasks("train") if t["prompt"] != task["prompt"])
    assert judge.score(task, _recorded((other["prompt"], "apple"))) == judge.FAILURE
    assert judge.score(task, _recorded(("Say apple.", "apple"))) == judge.FAILURE
