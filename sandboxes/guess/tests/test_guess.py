"""The guess sandbox: its reward and feedback rules, the conversation it holds, and real episodes.

The rules are checked on hand-written replies. The conversation is checked twice: against a scripted
stand-in for the remote model (so the exact messages between turns are known), and on the real path,
a live swarm server with the `tiny` model, where every episode must record at least three calls that
merge into one training sample.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from core.config_io import load_config
from core.sandbox.judge import JudgeEpisode, JudgedCall
from core.clients.runner import run_agent
from core.clients.sandbox import load_agent
from core.serve.server import Server
from core.train.timelines import merge_calls, merge_stats

FOLDER = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(FOLDER))
import agent as guess  # noqa: E402  (the sandbox's own module, imported by path as the runner does)
import game  # noqa: E402  (its tasks and score, the judge's)
import judge  # noqa: E402

sys.path.remove(str(FOLDER))


def test_a_bare_guess_inside_the_hinted_interval_scores_a_full_turn():
    # secret 31: 25 -> "Higher" leaves 26..50, 37 -> "Lower" leaves 26..36, 31 is inside both
    assert game.score_game(["25", "37", "31"], 31) == pytest.approx(1 + game.CLOSENESS)


def test_a_guess_that_ignores_the_hint_scores_less_than_one_that_follows_it():
    following = game.score_game(["25", "40", "30"], 31)
    ignoring = game.score_game(["25", "10", "30"], 31)  # 10 after "Higher" on 25 contradicts the hint
    assert ignoring < following
    assert game.turn_score("10", 26, 50) == game.BARE


def test_chatter_and_missing_numbers_score_below_bare_numbers():
    assert game.turn_score("I'm guessing the number", 1, 50) == 0.0
    assert game.turn_score("My first guess: 45", 1, 50) == game.MENTION
    assert game.turn_score("450", 1, 50) == game.MENTION  # bare, but outside 1..50
    assert game.turn_score(" 45. ", 1, 50) == 1.0
    assert game.score_game(["hello", "no", "what"], 7) == 0.0
    assert game.score_game([], 7) == 0.0


def test_feedback_points_towards_the_secret_and_asks_for_a_number_when_there_is_none():
    assert guess.feedback(10, 20).startswith("Higher")
    assert guess.feedback(30, 20).startswith("Lower")
    assert guess.feedback(20, 20).startswith("Correct")
    assert "not a number" in guess.feedback(None, 20)
    assert game.narrow(None, 20, 5, 9) == (5, 9)
    assert game.narrow(20, 20, 1, 50) == (20, 20)


def test_tasks_are_reproducible_and_in_range():
    first = list(game.tasks("train"))
    assert first == list(game.tasks("train"))
    assert len(first) == game.TRAIN_TASKS and len(list(game.tasks("eval"))) == game.EVAL_TASKS
    assert all(game.LOW <= t["secret"] <= game.HIGH for t in first)


class ScriptedModel:
    """A stand-in for the remote LLM: answers from a script and keeps every request it saw."""

    def __init__(self, replies: list[str]):
        self.replies, self.requests = list(replies), []
        self.model = "scripted"  # the runner's client carries the model to call as `llm.model`
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self._create))

    async def _create(self, **request):
        self.requests.append({**request, "messages": [dict(m) for m in request["messages"]]})
        text = self.replies.pop(0)
        return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content=text))])


def test_rollout_holds_three_turns_with_the_environments_hint_between_them():
    llm = ScriptedModel(["25", "I think 40", "31"])
    reward = asyncio.run(guess.rollout({"id": "t", "secret": 31}, llm))
    assert len(llm.requests) == guess.TURNS == 3
    assert {r["model"] for r in llm.requests} == {"scripted"}
    second, third = llm.requests[1]["messages"], llm.requests[2]["messages"]
    assert second[-2:] == [{"role": "assistant", "content": "25"}, {"role": "user", "content": "Higher. Your next guess?"}]
    assert third[-1] == {"role": "user", "content": "Lower. Your next guess?"}
    assert third[: len(second)] == second  # each call extends the previous one: what timeline merging needs
    assert reward == pytest.approx(game.score_game(["25", "I think 40", "31"], 31))


def test_a_reply_without_content_counts_as_no_number():
    llm = ScriptedModel(["", "", ""])
    llm.chat.completions.create = _none_content(llm)
    assert asyncio.run(guess.rollout({"id": "t", "secret": 3}, llm)) == 0.0


def _none_content(llm: ScriptedModel):
    async def create(**request):
        llm.requests.append(request)
        return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content=None))])
    return create


@pytest.fixture
def tiny_server():
    """A real swarm server with the `tiny` model and no trainer: finished groups wait in its registry."""
    server = Server(load_config(overrides=["server.port=0", "trainer.batch_groups=2"]))
    server.start()
    yield server
    server.stop()


@pytest.mark.slow
def test_real_episodes_record_three_calls_that_merge_into_one_sample(tiny_server):
    server = tiny_server
    agent = load_agent(str(FOLDER))
    stats = asyncio.run(run_agent(agent, server.url, concurrency=4, group_size=2, max_tasks=2))
    assert stats.finished == 4 and stats.failed == 0
    batch = server.registry.take_batch(server.versions(), max_staleness=0)
    episodes = batch.episodes
    assert len(episodes) == 4
    for episode in episodes:
        assert len(episode.calls) >= 3
        samples = merge_calls(episode.calls, "linear")
        assert len(samples) == 1  # the three turns are one straight line of tokens
        counts = merge_stats(episode.calls)
        assert counts["linear_tokens"] == counts["tree_tokens"] < counts["unmerged_tokens"]


def _game(replies: list[str], hints: list[str] | None = None) -> JudgeEpisode:
    """A server record of a game: call i was asked with the conversation so far (hint i before reply i)."""
    hints = hints or [guess.SYSTEM] + ["Your guess?"] * len(replies)
    messages, calls = [{"role": "system", "content": hints[0]}], []
    for hint, reply in zip(hints[1:], replies):
        messages = messages + [{"role": "user", "content": hint}]
        calls.append(JudgedCall(model="policy", messages=messages, reply={"role": "assistant", "content": reply},
                                text=reply, tool_calls=[], prompt_tokens=1, completion_tokens=1, finish_reason="stop"))
        messages = messages + [{"role": "assistant", "content": reply}]
    return JudgeEpisode(task_id="t", kind="train", calls=calls, completion=replies[-1] if replies else "",
                        completions=list(replies), tool_calls=[], messages=[], answer=None)


def test_the_judge_scores_the_replies_the_server_recorded_against_the_true_secret():
    assert judge.score({"id": "t", "secret": 31}, _game(["25", "37", "31"])) == game.score_game(["25", "37", "31"], 31)
    assert judge.score({"id": "t", "secret": 31}, _game([])) == judge.FAILURE == 0.0
    assert list(judge.tasks("train"))[:3] == list(guess.tasks("train"))[:3]


def test_a_game_stopped_after_a_lucky_guess_scores_its_missing_turns_as_nothing():
    full = judge.score({"id": "t", "secret": 31}, _game(["31", "31", "31"]))
    stopped = judge.score({"id": "t", "secret": 31}, _game(["31"]))
    assert stopped == pytest.approx(1 / 3) and stopped < full  # one full turn of three, no closeness at the end


def test_a_game_whose_environment_names_the_secret_scores_failure():
    secret = 31
    told = _game(["31", "31", "31"], [guess.SYSTEM, "Hint: it is 31. Your guess?", "Again?", "Again?"])
    assert judge.score({"id": "t", "secret": secret}, told) == judge.FAILURE
    # Naming the model's own earlier guess is fair ("You said 31: correct."), and so are the range's bounds.
    echoed = _game(["31", "31", "31"], [guess.SYSTEM, "Your guess?", "You said 31: correct.", "Again?"])
    assert judge.score({"id": "t", "secret": secret}, echoed) == game.score_game(["31"] * 3, secret)
    assert judge.score({"id": "t", "secret": game.HIGH}, _game(["50"] * 3)) == game.score_game(["50"] * 3, game.HIGH)