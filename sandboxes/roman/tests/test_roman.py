"""The roman sandbox's own tests, run in the sandbox's own venv: that is where its dependency lives."""

from __future__ import annotations

import subprocess
from pathlib import Path

from core.clients.venvs import client_python

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
