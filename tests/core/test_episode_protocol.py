"""The episode protocol a judged sandbox declares (sandbox.toml `max_calls`, `[eval_sampling]`), enforced by a real
server over HTTP with the tiny model: a call beyond `max_calls` is refused and fails the episode, a request's own
seed is refused in train and eval episodes, an eval call samples as the sandbox says whatever the agent asks,
the judge sees every call in order, a reply to a prompt that does not carry the dealt task scores FAILURE, and
an A/B cell is the weights an episode opened on, an episode that never finished counted there with FAILURE."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from core.clients.runner import run_agent
from core.clients.sandbox import load_agent
from core.clients.retries import SwarmError
from core.clients.sdk import SwarmClient
from core.config import ab_metric
from core.sandbox.judge import load_judge

ROOT = Path(__file__).resolve().parents[2]
FAILURE = -1.0
# Every call in order must have been asked "<the task's prompt> turn <i>"; the score is the number of calls
# plus a thousandth per completion token, so a judge that saw fewer calls, or some out of order, says so.
JUDGE = '''
FAILURE = -1.0

def tasks(split):
    for i in range(4):
        yield {"id": f"{split}-{i}", "prompt": f"question {i}"}

def score(task, episode):
    asked = [call.last_user() for call in episode.calls]
    if not asked or asked != [f"{task['prompt']} turn {i}" for i in range(len(asked))]:
        return FAILURE
    return len(episode.calls) + sum(call.completion_tokens for call in episode.calls) / 1000
'''
AGENT = '''
def tasks(split):
    yield {{"id": "mine"}}  # unused: a judged sandbox's tasks are dealt by the server

async def rollout(task, llm):
    for turn in range({calls}):
        await llm.chat.completions.create(model=llm.model, max_tokens=2,
                                          messages=[{{"role": "user", "content": f"{{task['prompt']}} turn {{turn}}"}}])
    return 0.5
'''
TOML = '''name = "{name}"
judge = "judge.py"
max_calls = {max_calls}

[eval_sampling]
temperature = 0.5
max_tokens = 3
'''


def _sandbox(tmp_path: Path, name: str = "proto", max_calls: int = 1, calls: int = 1) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "sandbox.toml").write_text(TOML.format(name=name, max_calls=max_calls))
    (folder / "judge.py").write_text(JUDGE)
    (folder / "agent.py").write_text(AGENT.format(calls=calls))
    return folder


def _serve(live_server, *folders: Path):
    return live_server(clients=[{"agent": str(f)} for f in folders], trainer__group_size=1)


def _ended(server) -> list:
    """Every finished train episode the server holds (no trainer takes them here)."""
    return [e for g in server.registry.buffered() for e in g]


def _ask(ep, prompt: str, **fields):
    return httpx.post(f"{ep.base_url}/chat/completions", timeout=60, json={
        "model": "policy", "messages": [{"role": "user", "content": prompt}], "max_tokens": 2, **fields})


def test_an_agent_that_calls_again_until_it_likes_a_reply_is_refused_and_scores_failure(live_server, tmp_path):
    honest, greedy = _sandbox(tmp_path, "honest"), _sandbox(tmp_path, "greedy", calls=4)  # both: max_calls = 1
    server = _serve(live_server, honest, greedy)
    for folder in (honest, greedy):
        asyncio.run(run_agent(load_agent(str(folder)), server.url, concurrency=2, group_size=1, max_tasks=4,
                              max_consecutive_failures=0))
    by_sandbox: dict[str, list] = {}
    for ep in _ended(server):
        by_sandbox.setdefault(ep.sandbox, []).append(ep)
    assert len(by_sandbox["honest"]) == len(by_sandbox["greedy"]) == 4  # none dropped
    assert all(ep.score > 1 for ep in by_sandbox["honest"])
    for ep in by_sandbox["greedy"]:  # its second call was refused before generating: one call, and FAILURE
        assert ep.score == FAILURE and len(ep.calls) == 1 and "max_calls = 1" in ep.abort_reason


def test_a_refused_call_names_the_limit_ends_the_episode_and_counts_every_choice(live_server, tmp_path):
    server = _serve(live_server, _sandbox(tmp_path))
    client = SwarmClient(server.url)
    ep = client.episode(None, sandbox="proto")
    prompt = f"{ep.task['prompt']} turn 0"
    assert _ask(ep, prompt).status_code == 200
    again = _ask(ep, prompt)
    assert again.status_code == 400 and again.json()["error"]["code"] == "max_calls_exceeded"
    assert "sandbox.toml max_calls = 1" in again.json()["error"]["message"]
    with pytest.raises(SwarmError) as late:  # the episode is over: its finish cannot buy the score back
        ep.finish(1.0)
    assert late.value.status == 409
    (failed,) = _ended(server)
    assert failed.score == FAILURE and failed.metrics == {"judge/failed": 1.0}
    # Two choices of one request are two calls: n = 2 in a max_calls = 1 episode is refused before generating.
    two = client.episode(None, sandbox="proto")
    refused = _ask(two, f"{two.task['prompt']} turn 0", n=2)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "n"
    assert {e.id: (e.score, len(e.calls)) for e in _ended(server)}[two.id] == (FAILURE, 0)


def test_concurrent_calls_cannot_both_slip_under_max_calls(live_server, tmp_path):
    server = _serve(live_server, _sandbox(tmp_path))
    ep = SwarmClient(server.url).episode(None, sandbox="proto")

    async def race() -> list[int]:
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"model": "policy", "messages": [{"role": "user", "content": f"{ep.task['prompt']} turn 0"}],
                    "max_tokens": 2}
            answers = await asyncio.gather(*[client.post(f"{ep.base_url}/chat/completions", json=body)
                                             for _ in range(4)])
        return sorted(r.status_code for r in answers)

    codes = asyncio.run(race())
    # One call was admitted; the first beyond max_calls is refused (400) and ends the episode, so a later one is
    # refused as max_calls_exceeded or, reaching the episode after it ended, as an ended episode's (409); the
    # admitted call's reply is refused too (409) unless it was recorded before: no reply to pick from either way.
    assert codes.count(400) >= 1 and codes.count(200) <= 1 and set(codes) <= {200, 400, 409}, codes
    (failed,) = _ended(server)
    assert failed.score == FAILURE and len(failed.calls) <= 1


def test_a_call_cut_off_mid_stream_still_counts(live_server, tmp_path):
    server = _serve(live_server, _sandbox(tmp_path))
    ep = SwarmClient(server.url).episode(None, sandbox="proto")
    body = {"model": "policy", "messages": [{"role": "user", "content": "x"}], "max_tokens": 40, "stream": True}
    with httpx.stream("POST", f"{ep.base_url}/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # one line read, then the agent leaves to sample again
    again = _ask(ep, f"{ep.task['prompt']} turn 0")
    assert again.status_code == 400 and again.json()["error"]["code"] == "max_calls_exceeded"


@pytest.mark.parametrize("kind, sandbox, allowed", [("train", "proto", False), ("eval", "proto", False),
                                                    ("train", "unjudged", False), ("debug", "proto", True)])
def test_a_request_seed_is_refused_in_train_and_eval_episodes_and_kept_in_debug_ones(live_server, tmp_path, kind,
                                                                                      sandbox, allowed):
    server = _serve(live_server, _sandbox(tmp_path, max_calls=3))
    client = SwarmClient(server.url)
    ep = client.episode("t" if sandbox == "unjudged" else None, sandbox=sandbox, kind=kind,
                        split="eval" if kind == "eval" else None)
    seeded = _ask(ep, "question 0 turn 0", seed=7)
    if allowed:
        assert seeded.status_code == 200
    else:
        assert seeded.status_code == 400, seeded.text
        assert seeded.json()["error"]["code"] == "seed_not_allowed" and seeded.json()["error"]["param"] == "seed"
        assert _ask(ep, "question 0 turn 0").status_code == 200  # the refusal cost no call: the same without seed


def test_an_eval_call_samples_as_the_sandbox_says_whatever_the_agent_sends(live_server, tmp_path):
    server = _serve(live_server, _sandbox(tmp_path, max_calls=3))
    client = SwarmClient(server.url)
    ev = client.episode(None, sandbox="proto", kind="eval", split="eval")
    for fields in ({"temperature": 0.0, "max_tokens": 40}, {"temperature": 1.7, "top_p": 0.2, "max_tokens": 40},
                   {"max_tokens": 1}):
        assert _ask(ev, "question 0 turn 0", **fields).status_code == 200
    calls = server.registry.get_open(ev.id).calls
    assert [(c.temperature, c.top_p) for c in calls] == [(0.5, 1.0)] * 3  # sandbox.toml [eval_sampling]
    assert all(len(c.completion_ids) <= 3 for c in calls) and len(calls[2].completion_ids) > 1  # its max_tokens
    train = client.episode(None, sandbox="proto")  # a train episode samples as asked: only eval is fixed
    assert _ask(train, "question 0 turn 0", temperature=0.3, max_tokens=6).status_code == 200
    assert server.registry.get_open(train.id).calls[0].temperature == 0.3


def test_the_judge_sees_every_call_in_order(live_server, tmp_path):
    server = _serve(live_server, _sandbox(tmp_path, max_calls=3, calls=3))
    asyncio.run(run_agent(load_agent(str(tmp_path / "proto")), server.url, concurrency=1, group_size=1, max_tasks=2,
                          max_consecutive_failures=0))
    for ep in _ended(server):
        assert ep.score == pytest.approx(3 + sum(len(c.completion_ids) for c in ep.calls) / 1000)


def test_a_reply_to_a_prompt_that_does_not_carry_the_dealt_task_scores_failure(live_server, tmp_path):
    # The shipped letters judge: a reply scores its share of lowercase letters only when the dealt prompt was asked.
    hostile = tmp_path / "letters"
    shutil.copytree(ROOT / "sandboxes" / "letters", hostile, ignore=shutil.ignore_patterns("__pycache__", "tests"))
    agent = (hostile / "agent.py").read_text()
    (hostile / "agent.py").write_text(agent.replace('"content": task["prompt"]', '"content": "zz"'))
    server = _serve(live_server, hostile)
    # Four of each: with no trainer taking batches, admission holds the buffer to a few groups.
    asyncio.run(run_agent(load_agent(str(hostile)), server.url, concurrency=2, group_size=1, max_tasks=4,
                          max_consecutive_failures=0))
    asyncio.run(run_agent(load_agent(str(ROOT / "sandboxes" / "letters")), server.url, concurrency=2, group_size=1,
                          max_tasks=4, max_consecutive_failures=0))
    asked = {ep.id: ep.calls[0].messages[-1]["content"] for ep in _ended(server)}
    told, honest = [e for e in _ended(server) if asked[e.id] == "zz"], [e for e in _ended(server) if asked[e.id] != "zz"]
    assert len(told) == len(honest) == 4
    assert {e.score for e in told} == {0.0}  # the judge's FAILURE, whatever the reply
    assert sum(e.score for e in honest) > 0  # the same model's replies to the dealt prompts do score


def _bump(server) -> None:
    engine = server.policies["policy"].engine
    engine.pause_blocking()
    engine.resume(new_version=engine.version + 1)


def test_an_episode_whose_calls_span_a_weight_change_is_paired_in_the_cell_it_opened_in(live_server, tmp_path):
    server = _serve(live_server, _sandbox(tmp_path, max_calls=3))
    old, new = SwarmClient(server.url, client_version="v1"), SwarmClient(server.url, client_version="v2")
    waits, plain = old.episode(None, sandbox="proto", group_size=2), new.episode(None, sandbox="proto", group_size=2)
    assert waits.task_id == plain.task_id  # a task is dealt group_size times in a row: both get the first
    assert _ask(waits, f"{waits.task['prompt']} turn 0").status_code == 200
    _bump(server)  # v1's agent waits for the new weights after a bad reply, then calls again
    assert _ask(waits, f"{waits.task['prompt']} turn 1").status_code == 200
    assert _ask(plain, f"{plain.task['prompt']} turn 0").status_code == 200
    waits.finish(0.0)
    plain.finish(0.0)
    spans = {e.client_version: e.weights for e in _ended(server)}
    assert spans == {"v1": (("policy", 0, 1),), "v2": (("policy", 1, 1),)}  # no common span, yet one cell
    metrics = server.registry.pairs.take()
    assert metrics["ab/proto/pairs"] == 1.0 and server.registry.pairs.status()[-1]["weights"] == [["policy", 0]]


def test_an_expired_judged_episode_scores_failure_in_its_cell_which_waits_for_it(live_server, tmp_path):
    server = _serve(live_server, _sandbox(tmp_path, max_calls=3))
    new = SwarmClient(server.url, client_version="v2")
    # Opened bare, so nothing heartbeats it: its agent hangs on a bad reply until the lease runs out.
    opened = httpx.post(f"{server.url}/swarm/v1/episodes", json={"sandbox": "proto", "group_size": 2, "lease_s": 1.0,
                                                                  "client_version": "v1"}).json()
    hangs = SimpleNamespace(base_url=opened["base_url"], task=opened["task"], task_id=opened["task_id"])
    plain = new.episode(None, sandbox="proto", group_size=2)
    assert hangs.task_id == plain.task_id
    assert _ask(hangs, f"{hangs.task['prompt']} turn 0").status_code == 200
    assert _ask(plain, f"{plain.task['prompt']} turn 0").status_code == 200
    plain.finish(0.0)
    assert server.registry.pairs.take() == {}  # v1's episode still runs: its cell is not compared without it
    time.sleep(1.5)
    server.registry.expire_due()
    metrics = server.registry.pairs.take()
    assert metrics[ab_metric("proto", "v1")] == FAILURE and metrics["ab/proto/pairs"] == 1.0
    assert metrics[ab_metric("proto", "v2")] > 1


@pytest.mark.parametrize("protocol, named", [
    ("max_calls = 0", "max_calls = 0"), ("max_calls = 1.5", "max_calls = 1.5"), ('max_calls = "1"', "max_calls = '1'"),
    ("max_calls = true", "max_calls = True"), ("eval_sampling = 3", "eval_sampling must be a table"),
    ("[eval_sampling]\ntemperature = 1.0", "eval_sampling.max_tokens: Field required"),
    ("[eval_sampling]\nmax_tokens = 8\ntemperature = 9.0", "eval_sampling.temperature"),
    ("[eval_sampling]\nmax_tokens = 0", "eval_sampling.max_tokens"),
    ("[eval_sampling]\nmax_tokens = 8\nstop = [\"\"]", "eval_sampling.stop.0"),
    ("[eval_sampling]\nmax_tokens = 8\nstop = [\"a\", \"b\", \"c\", \"d\", \"e\"]", "eval_sampling.stop"),
    ("[eval_sampling]\nmax_tokens = 8\nseed = 3", "eval_sampling.seed: Extra inputs are not permitted"),
])
def test_a_malformed_episode_protocol_is_refused_at_load_naming_sandbox_toml_and_the_key(tmp_path, protocol, named):
    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / "sandbox.toml").write_text(f'name = "bad"\njudge = "judge.py"\n{protocol}\n')
    (folder / "judge.py").write_text(JUDGE)
    (folder / "agent.py").write_text(AGENT.format(calls=1))
    for load in (load_judge, load_agent):  # the server's judge and the client's agent both refuse it
        with pytest.raises(ValueError) as refused:
            load(folder if load is load_judge else str(folder))
        assert "sandbox.toml" in str(refused.value) and named in str(refused.value), str(refused.value)


def test_the_finish_fails_an_episode_with_more_recorded_calls_than_max_calls_whatever_path_recorded_them(
        live_server, tmp_path):
    server = _serve(live_server, _sandbox(tmp_path))
    ep = SwarmClient(server.url).episode(None, sandbox="proto")
    assert _ask(ep, f"{ep.task['prompt']} turn 0").status_code == 200
    open_ep = server.registry.get_open(ep.id)
    second = open_ep.calls[0].model_copy(update={"messages": [{"role": "user", "content": f"{ep.task['prompt']} turn 1"}]})
    server.registry.record(open_ep, second)  # a second call no gateway route admitted: the judge alone would score 2+
    assert ep.finish(0.0)["reward"] == {"policy": FAILURE}
    (failed,) = _ended(server)
    assert failed.score == FAILURE and failed.metrics["judge/failed"] == 1.0
