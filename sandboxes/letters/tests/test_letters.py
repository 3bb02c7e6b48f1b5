"""The letters sandbox's own tests: its tasks, its reward, and one rollout against a scripted model.

A study's validation runs these on every edit of the sandbox (researcher/code/validation.py), so they
check the contract an edit must keep, not the exact prompt wording an edit may change.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

from core.sandbox.judge import JudgeEpisode, JudgedCall

FOLDER = Path(__file__).resolve().parents[1]


def _load(name: str):
    """The sandbox's module `name`, imported by path with its folder on sys.path, as the runner does."""
    sys.path.insert(0, str(FOLDER))
    try:
        spec = importlib.util.spec_from_file_location(f"letters_under_test_{name}", FOLDER / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(FOLDER))
    return module


agent, scoring, judge = _load("agent"), _load("reward"), _load("judge")


def test_tasks_have_distinct_ids_per_split():
    train = list(agent.tasks("train"))
    assert train and len({t["id"] for t in train}) == len(train)
    assert all(t["id"].startswith("train-") for t in train)
    assert {t["id"] for t in agent.tasks("eval")}.isdisjoint({t["id"] for t in train})


def test_reward_is_the_share_of_lowercase_letters_with_a_length_floor():
    assert scoring.reward("abcdefghijkl") == 1.0
    assert scoring.reward("ABCDEFGHIJKL") == 0.0
    assert scoring.reward("ab") == 2 / scoring.MIN_LENGTH  # short replies cannot score 1 by being one letter
    assert scoring.reward("") == 0.0


def test_rollout_scores_the_models_reply():
    sent = []

    async def create(**request):
        sent.append(request)
        return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content="hello world!"))])

    llm = SimpleNamespace(model="policy", chat=SimpleNamespace(completions=SimpleNamespace(create=create)))
    task = next(iter(agent.tasks("train")))
    reward = asyncio.run(agent.rollout(task, llm))
    assert reward == scoring.reward("hello world!")
    assert sent[0]["model"] == "policy" and sent[0]["messages"][-1]["role"] == "user"


def _recorded(*calls: tuple[str, str], answer=None) -> JudgeEpisode:
    """A server record of an episode: per call, the question its last user message asked and the reply."""
    return JudgeEpisode(task_id="t", kind="train", calls=[
        JudgedCall(model="policy", messages=[{"role": "user", "content": q}], reply={"role": "assistant", "content": r},
                   text=r, tool_calls=[], prompt_tokens=len(q), completion_tokens=len(r), finish_reason="stop")
        for q, r in calls], completion=calls[-1][1] if calls else "", completions=[r for _, r in calls], tool_calls=[],
        messages=[], answer=answer)


def test_the_judge_owns_the_tasks_and_scores_the_reply_the_server_recorded():
    assert list(judge.tasks("train")) == list(agent.tasks("train")) and list(judge.tasks("eval"))
    task = next(iter(judge.tasks("train")))
    recorded = _recorded((task["prompt"], "hello world!"), answer=1.0)  # what rollout claims plays no part
    assert judge.score(task, recorded) == scoring.reward("hello world!")
    assert judge.FAILURE <= min(judge.score(task, _recorded((task["prompt"], t))) for t in ("", "ABC", "abc"))
    assert judge.score(task, _recorded()) == judge.FAILURE  # no call: nothing answered


def test_a_reply_to_a_prompt_that_does_not_carry_the_dealt_task_scores_failure():
    task, other = list(judge.tasks("train"))[:2]
    assert task["prompt"] not in other["prompt"]
    assert judge.score(task, _recorded((other["prompt"], "abcdefghijklmnop"))) == judge.FAILURE
    # Extra instructions around the task's prompt are the agent's to write: the task is still asked.
    assert judge.score(task, _recorded((f"Be brief. {task['prompt']}", "hello"))) == scoring.reward("hello")
