"""The sealed yardstick (DESIGN §3.7): a judged sandbox is scored in the server by its judge, from the server's
record, on the judge's tasks; an episode that raises or times out counts with the failure value; nothing the
agent does in its own process reaches the judge."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import httpx
import pytest

from core.sandbox.dealer import Dealer
from core.sandbox.judge import JudgeError, load_judge
from core.clients.runner import run_agent
from core.clients.sandbox import load_agent
from core.episodes.books import unbalanced
from core.episodes.errors import Refusal
from core.episodes.registry import Registry
from core.episodes.wire import OpenEpisode
from core.run import checkpoint
from core.run.scores import judged_metrics

JUDGE = '''
from scoring import points

FAILURE = -1.0

def tasks(split):
    for i in range(3):
        yield {"id": f"{split}-hard-{i}", "hard": True}
    yield {"id": f"{split}-easy", "hard": False}

def score(task, episode):
    return points(episode, task)
'''
# The judge's sibling: the number of calls the server recorded, plus 0.5 when rollout's answer names the task.
SCORING = '''
def points(episode, task):
    return float(len(episode.completions)) + (0.5 if episode.answer == task["id"] else 0.0)
'''
AGENT = '''
import asyncio
from core.clients.sandbox import Outcome

def tasks(split):
    yield {{"id": "easy", "hard": False}}  # what a patch that drops the hard tasks would leave

async def rollout(task, llm):
{body}
    for _ in range(2):
        await llm.chat.completions.create(model=llm.model, messages=[{{"role": "user", "content": "hi"}}], max_tokens=2)
    return Outcome(reward=0.9, answer=task["id"])
'''
TOML = 'name = "{name}"\njudge = "judge.py"\n'


def _judged(tmp_path: Path, name: str = "judged", body: str = "    pass", judge: str = JUDGE) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "sandbox.toml").write_text(TOML.format(name=name))
    (folder / "judge.py").write_text(judge)
    (folder / "scoring.py").write_text(SCORING)
    (folder / "agent.py").write_text(AGENT.format(body=body))
    return folder


def _serve(live_server, folder: Path):
    return live_server(clients=[{"agent": str(folder)}], trainer__group_size=1)


def _episodes(server) -> list:
    """Every finished train episode the server holds (no trainer takes them here), by task id."""
    return sorted((e for g in server.registry.buffered() for e in g), key=lambda e: e.task_id)


def _run(agent, server, tasks: int, **kw) -> None:
    asyncio.run(run_agent(agent, server.url, concurrency=2, group_size=1, max_tasks=tasks,
                          max_consecutive_failures=0, **kw))


def test_the_judge_scores_from_the_servers_record_and_the_agents_reward_is_only_logged(live_server, tmp_path):
    folder = _judged(tmp_path)
    server = _serve(live_server, folder)
    _run(load_agent(str(folder)), server, tasks=4)
    episodes = _episodes(server)
    assert len(episodes) == 4
    for ep in episodes:
        assert len(ep.calls) == 2
        assert ep.score == 2.5 and ep.reward == {"policy": 2.5}  # two recorded calls + the answer; never 0.9
        assert ep.metrics["agent_reward"] == pytest.approx(0.9)
    metrics = judged_metrics(episodes)
    assert metrics["reward/judged/mean"] == metrics["reward/mean"] == 2.5
    assert metrics["agent_reward/judged/mean"] == pytest.approx(0.9) and metrics["judge/judged/failed"] == 0
    # What the score cost, per episode: a harness that buys its score with more calls or tokens shows it.
    assert metrics["calls/judged/mean"] == 2.0
    assert metrics["completion_tokens/judged/mean"] == sum(len(c.completion_ids) for e in episodes for c in e.calls) / 4
    unjudged = [ep.model_copy(update={"score": None, "sandbox": "other"}) for ep in episodes]
    assert judged_metrics(unjudged) == {}  # unjudged batches keep the trainer's own means
    assert judged_metrics(episodes + unjudged)["reward/mean"] == 2.5  # a mixed batch: every episode counted once


def test_the_judges_tasks_are_dealt_whatever_the_agents_tasks_say(live_server, tmp_path):
    folder = _judged(tmp_path)
    server = _serve(live_server, folder)
    _run(load_agent(str(folder)), server, tasks=8)  # two passes of the judge's four tasks
    ids = [e.task_id for e in _episodes(server)]
    assert sorted(set(ids)) == ["train-easy", "train-hard-0", "train-hard-1", "train-hard-2"]
    assert all(ids.count(t) == 2 for t in set(ids))  # every task dealt, the hard ones too, pass after pass
    # A client cannot choose a judged sandbox's task, and an unjudged one must name its own.
    opened = httpx.post(f"{server.url}/swarm/v1/episodes", json={"sandbox": "judged", "task_id": "train-easy"})
    assert opened.status_code == 409 and opened.json()["error"]["code"] == "judged_sandbox"
    opened = httpx.post(f"{server.url}/swarm/v1/episodes", json={"sandbox": "other"})
    assert opened.status_code == 400 and opened.json()["error"]["code"] == "missing_task_id"
    # Backwards compatible: an unjudged sandbox's client still opens with its own task id.
    opened = httpx.post(f"{server.url}/swarm/v1/episodes", json={"sandbox": "other", "task_id": "t1", "kind": "eval"})
    assert opened.status_code == 200 and opened.json()["task_id"] == "t1" and opened.json()["task"] is None


def test_an_episode_that_raises_or_times_out_counts_with_the_failure_value(live_server, tmp_path):
    body = ('    if task["id"].endswith("hard-0"):\n        raise RuntimeError("a low score coming: hide it")\n'
            '    if task["id"].endswith("hard-1"):\n        await asyncio.sleep(3600)')
    folder = _judged(tmp_path, body=body)
    server = _serve(live_server, folder)
    _run(load_agent(str(folder)), server, tasks=4, episode_timeout_s=1.0)
    episodes = {e.task_id: e for e in _episodes(server)}
    assert sorted(episodes) == ["train-easy", "train-hard-0", "train-hard-1", "train-hard-2"]  # none dropped
    for failed in ("train-hard-0", "train-hard-1"):
        assert episodes[failed].state == "finished" and episodes[failed].score == -1.0
        assert episodes[failed].metrics == {"judge/failed": 1.0}
    assert "RuntimeError" in episodes["train-hard-0"].abort_reason
    metrics = judged_metrics(list(episodes.values()))
    assert metrics["reward/judged/mean"] == pytest.approx((2.5 + 2.5 - 1.0 - 1.0) / 4)
    assert metrics["judge/judged/failed"] == 2


# What the hostile agent below rebinds in every module it can reach.
REBOUND = ("score", "points", "FAILURE")


@pytest.fixture
def rebinds_undone():
    """The hostile agent rebinds `score`, `points` and `FAILURE` in every module of this process, pytest's
    and the researcher's too (tests/researcher then scored every run 99.0): put back what each module had,
    and drop the modules first imported meanwhile that it reached, so a later import gets a fresh copy."""
    before = {name: (m, {n: m.__dict__[n] for n in REBOUND if n in m.__dict__})
              for name, m in list(sys.modules.items()) if isinstance(getattr(m, "__dict__", None), dict)}
    yield
    for name, m in list(sys.modules.items()):
        found = getattr(m, "__dict__", None)
        if not isinstance(found, dict) or not any(n in found for n in REBOUND):
            continue
        if name not in before or before[name][0] is not m:
            sys.modules.pop(name, None)
            continue
        for n in REBOUND:
            if n in before[name][1]:
                found[n] = before[name][1][n]
            else:
                found.pop(n, None)


def test_an_agent_that_rebinds_the_judge_in_its_own_process_does_not_change_the_score(live_server, tmp_path,
                                                                                       rebinds_undone):
    # It imports the judge and its sibling by name and rebinds them at import time, and in every rollout
    # rebinds whatever judge-like module it can find; it runs in the server's process (an in-process client).
    body = ('    import sys\n'
            '    for m in list(sys.modules.values()):\n'
            '        found = getattr(m, "__dict__", {})\n'
            '        if callable(found.get("score")) or callable(found.get("points")):\n'
            '            m.score = m.points = lambda *a: 99.0\n'
            '            m.FAILURE = 99.0')
    folder = _judged(tmp_path, body=body)
    (folder / "agent.py").write_text(
        "import judge, scoring\njudge.score = scoring.points = lambda *a: 99.0\n" + (folder / "agent.py").read_text())
    agent = load_agent(str(folder))  # imported before the server loads its judge: the judge gets fresh copies
    server = _serve(live_server, folder)
    _run(agent, server, tasks=4)
    assert {e.score for e in _episodes(server)} == {2.5}


def test_a_judge_that_raises_or_returns_no_number_scores_the_failure_value(live_server, tmp_path):
    judge = JUDGE.replace("return points(episode, task)",
                          'return "high" if task["id"].endswith("easy") else 1 / 0 if task["hard"] else 0.0')
    folder = _judged(tmp_path, judge=judge)
    server = _serve(live_server, folder)
    _run(load_agent(str(folder)), server, tasks=4)
    episodes = _episodes(server)
    assert {e.score for e in episodes} == {-1.0}
    assert all(e.metrics["judge/failed"] == 1.0 for e in episodes)


@pytest.mark.parametrize("judge, error", [
    ("def tasks(split):\n    yield {}\ndef score(t, e):\n    return 0.0\n", "must define FAILURE"),
    ("FAILURE = 0.0\ndef tasks(split):\n    yield {}\n", r"must define score\(\)"),
    ("FAILURE = 0.0\ndef tasks(split):\n    if split == 'train':\n        yield {}\ndef score(t, e):\n    return 0.0\n",
     r"tasks\('eval'\) yields no task"),
    ("FAILURE = 0.0\ndef tasks(split):\n    yield object()\ndef score(t, e):\n    return 0.0\n", "must be a dict"),
    ("import nothing_here\n", "failed to import"),
])
def test_a_bad_judge_is_refused_when_the_server_loads_it_naming_the_file(tmp_path, judge, error):
    folder = _judged(tmp_path, judge=judge)
    with pytest.raises(JudgeError, match=error):
        load_judge(folder)


@pytest.mark.parametrize("declared", ["../judge.py", "sub/judge.py", "judge.txt", "missing.py"])
def test_a_judge_outside_the_folder_or_not_a_python_file_is_refused(tmp_path, declared):
    folder = _judged(tmp_path)
    (folder / "sandbox.toml").write_text(f'name = "judged"\njudge = "{declared}"\n')
    with pytest.raises(JudgeError, match="judge"):
        load_judge(folder)


def test_a_judged_episode_whose_lease_runs_out_is_finished_with_the_failure_value_and_trains():
    now = [1000.0]
    registry = Registry(lease_s=5, default_group_size=2, batch_groups=1, clock=lambda: now[0])
    registry.failure_scores = {"judged": -1.0}
    first, _ = registry.open(OpenEpisode(sandbox="judged", task_id="t"), {"policy": 0})
    registry.finish(first.id, {"policy": 0.5}, {"reward": 0.5}, score=0.5)
    hung, _ = registry.open(OpenEpisode(sandbox="judged", task_id="t"), {"policy": 0})
    debug, _ = registry.open(OpenEpisode(sandbox="judged", task_id="t", kind="debug"), {"policy": 0})
    now[0] += 10  # both leases lapse: the agent hung, or killed itself to dodge a low score
    registry.expire_due()
    batch = registry.take_batch({"policy": 0}, max_staleness=1)
    assert batch is not None and [e.id for e in batch.episodes] == [first.id, hung.id]  # its group filled
    assert hung.state == "finished" and hung.score == -1.0 and "expired" in hung.abort_reason
    assert debug.state == "expired"  # debug episodes count nowhere: they end as before
    with pytest.raises(Refusal, match="scored its judge's failure value"):  # a late finish changes nothing
        registry.finish(hung.id, {"policy": 1.0}, {"reward": 1.0})
    assert registry.abort(hung.id, "again").score == -1.0  # an abort after the fact is idempotent
    assert not unbalanced(registry.counters, 0, 0)


def test_the_dealer_deals_each_task_a_group_in_a_seeded_order_and_takes_back_a_refused_deal(tmp_path):
    judge = load_judge(_judged(tmp_path))
    dealer = Dealer({"judged": judge}, seed=0)
    ids = [dealer.deal("judged", "train", "train", 2).task_id for _ in range(8)]
    assert ids[0::2] == ids[1::2]  # each task twice in a row: a group shares its task
    assert sorted(ids[0::2]) == ["train-easy", "train-hard-0", "train-hard-1", "train-hard-2"]
    taken = dealer.deal("judged", "train", "train", 2).task_id
    dealer.undo()  # its open was refused: the next open gets the same slot, and its group's second one follows
    assert [dealer.deal("judged", "train", "train", 2).task_id for _ in range(3)][:2] == [taken, taken]
    again = Dealer({"judged": judge}, seed=0)
    assert [again.deal("judged", "train", "train", 2).task_id for _ in range(8)] == ids  # same seed, same order
    orders = {tuple(Dealer({"judged": judge}, seed=s).deal("judged", "train", "train", 1).task_id for _ in range(4))
              for s in range(6)}
    assert len(orders) > 1  # seeds shuffle the train split
    evals = [dealer.deal("judged", "eval", "eval", 1).task_id for _ in range(4)]
    assert evals == ["eval-hard-0", "eval-hard-1", "eval-hard-2", "eval-easy"]  # other splits as the judge yields


@pytest.mark.parametrize("slots", [5, 11])  # inside the first pass, and into the second
def test_a_resumed_dealer_deals_on_from_its_checkpointed_place(tmp_path, slots):
    judge = load_judge(_judged(tmp_path))
    dealer = Dealer({"judged": judge}, seed=3)
    dealt = [dealer.deal("judged", "train", "train", 2).task_id for _ in range(slots)]
    ckpt = checkpoint.load(checkpoint.save(tmp_path / "ckpt", 1, {}, [], {}, {}, dealer=dealer.state()))
    resumed = Dealer({"judged": judge}, seed=3)
    resumed.restore(ckpt.dealer)
    after = [dealer.deal("judged", "train", "train", 2).task_id for _ in range(8)]
    again = [resumed.deal("judged", "train", "train", 2).task_id for _ in range(9)]
    # The task that was being dealt starts over at its first slot (its open episodes died with the run),
    # then the deck goes on as the uninterrupted one does, not from the first task of the first pass.
    assert again[0] == dealt[-1] and again[1:] == after
    assert again != [Dealer({"judged": judge}, seed=3).deal("judged", "train", "train", 2).task_id for _ in range(9)]
    unjudged = Dealer({}, seed=3)
    unjudged.restore(ckpt.dealer)  # a sandbox this run no longer judges is skipped, not an error
    assert unjudged.state() == {}
