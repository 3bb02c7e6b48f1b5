"""The roman sandbox's own tests, run in the sandbox's own venv: that is where its dependency lives."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from core.contain.venvs import client_python
from core.sandbox.judge import JudgeEpisode, JudgedCall

FOLDER = Path(__file__).resolve().parents[1]

CHECK = """
import asyncio, importlib.util, sys
from types import SimpleNamespace
sys.path.insert(0, {folder!r})
spec = importlib.util.spec_from_file_location("roman_agent", {folder!r} + "/agent.py")
agent = importlib.util.module_from_spec(spec); spec.loader.exec_module(agent)
tasks = list(agent.tasks("train"))
assert len(tasks) == 100 and all(1 <= t["n"] <= agent.HIGHEST for t in tasks)
assert agent.reward("XIV", 14) == 1.0 and agent.reward("xiv.", 14) == 1.0
assert agent.reward("XV", 14) == 0.25 and agent.reward("fourteen", 14) == 0.0 and agent.reward("", 14) == 0.0

async def create(**request):
    return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content="XLII"))])

llm = SimpleNamespace(model="policy", chat=SimpleNamespace(completions=SimpleNamespace(create=create)))
print(asyncio.run(agent.rollout({{"n": 42, "prompt": "p"}}, llm)))
"""


def test_tasks_reward_and_rollout_in_the_sandbox_venv():
    out = subprocess.run([client_python(str(FOLDER)), "-c", CHECK.format(folder=str(FOLDER))],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1.0"


def _recorded(*calls: tuple[str, str]) -> JudgeEpisode:
    """A server record of an episode: per call, the question its last user message asked and the reply."""
    return JudgeEpisode(task_id="t", kind="train", calls=[
        JudgedCall(model="policy", messages=[{"role": "user", "content": q}], reply={"role": "assistant", "content": r},
                   text=r, tool_calls=[], prompt_tokens=len(q), completion_tokens=len(r), finish_reason="stop")
        for q, r in calls], completion=calls[-1][1] if calls else "", completions=[r for _, r in calls], tool_calls=[],
        messages=[], answer=0.0)


def _judge():
    sys.path.insert(0, str(FOLDER))
    try:
        spec = importlib.util.spec_from_file_location("roman_judge_under_test", FOLDER / "judge.py")
        judge = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(judge)
    finally:
        sys.path.remove(str(FOLDER))
    return judge


def test_the_judge_scores_like_the_roman_package_without_it():
    """The judge runs in the server (no `roman` package): its pure-Python numerals agree with the package's."""
    judge = _judge()
    task = next(t for t in judge.tasks("train") if t["n"] == 14)
    for reply, score in (("XIV", 1.0), ("xiv.", 1.0), ("XV", 0.25), ("IIII", 0.0), ("fourteen", 0.0), ("", 0.0)):
        assert judge.score(task, _recorded((task["prompt"], reply))) == score, reply
    assert len(list(judge.tasks("train"))) == 100 and list(judge.tasks("eval")) and judge.FAILURE == 0.0


def test_a_numeral_for_a_prompt_that_does_not_carry_the_dealt_number_scores_failure():
    judge = _judge()
    task = next(t for t in judge.tasks("train") if t["n"] == 14)
    assert judge.score(task, _recorded(("Write 15 in Roman numerals. Answer with the numeral only.", "XIV"))) == judge.FAILURE
    assert judge.score(task, _recorded(("Reply XIV.", "XIV"))) == judge.FAILURE
    assert judge.score(task, _recorded()) == judge.FAILURE
