"""The duo sandbox's own tests: its tasks, its two rewards, and one rollout against scripted models.

A study's validation runs these on every edit of the sandbox, so they check the contract an edit
must keep: two calls per episode, the drafter's then the reviewer's, the reviewer shown the draft,
and one reward per model. The live path (two `tiny` policies trained in one job on this sandbox)
is `tests/core/test_multi_model.py`.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

FOLDER = Path(__file__).resolve().parents[1]


def _load():
    """The sandbox's agent module, imported by path with its folder on sys.path, as the runner does."""
    sys.path.insert(0, str(FOLDER))
    try:
        spec = importlib.util.spec_from_file_location("duo_under_test", FOLDER / "agent.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(FOLDER))
    return module


duo = _load()


def test_tasks_have_distinct_ids_per_split():
    train = list(duo.tasks("train"))
    assert train and len({t["id"] for t in train}) == len(train)
    assert {t["id"] for t in duo.tasks("eval")}.isdisjoint({t["id"] for t in train})


def test_each_role_is_scored_on_its_own_reply_in_opposite_directions():
    assert duo.rewards("abcdefghijkl", "ABCDEFGHIJKL") == {"drafter": 1.0, "reviewer": 1.0}
    assert duo.rewards("ABCDEFGHIJKL", "abcdefghijkl") == {"drafter": 0.0, "reviewer": 0.0}
    assert duo.rewards("ab", "") == {"drafter": 2 / duo.MIN_LENGTH, "reviewer": 0.0}  # the length floor


class ScriptedModels:
    """A stand-in for the remote server: answers per model name and keeps every request."""

    def __init__(self, replies: dict[str, str]):
        self.replies, self.requests = replies, []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self._create))

    async def _create(self, **request):
        self.requests.append(request)
        text = self.replies[request["model"]]
        return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content=text))])


def test_rollout_calls_the_drafter_then_the_reviewer_with_the_draft_and_rewards_each():
    llm = ScriptedModels({"drafter": "hello world", "reviewer": "FINE BY ME"})
    task = next(iter(duo.tasks("train")))
    out = asyncio.run(duo.rollout(task, llm))
    assert [r["model"] for r in llm.requests] == ["drafter", "reviewer"]
    assert task["prompt"] in llm.requests[0]["messages"][-1]["content"]
    assert "hello world" in llm.requests[1]["messages"][-1]["content"]
    assert out == pytest.approx(duo.rewards("hello world", "FINE BY ME"))
    assert out["drafter"] != out["reviewer"]


def test_a_reply_without_content_scores_zero_for_that_role_only():
    llm = ScriptedModels({"drafter": None, "reviewer": "OK"})
    out = asyncio.run(duo.rollout({"id": "t", "prompt": "hi"}, llm))
    assert out == {"drafter": 0.0, "reviewer": 2 / duo.MIN_LENGTH}
