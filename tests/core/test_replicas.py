"""Rollout replicas (core/engine/replicas.py) as 2 real engine processes of the tiny model.

Sticky least-loaded routing, weight sync reaching both replicas (checked on the weights they
generate with and on a digest of the weights they hold, not only on the version they report), for
full weights and for LoRA adapters; a sync a replica cannot take (a name or a shape its model lacks)
failing loudly, naming the parameter; a SIGKILLed replica: its episodes handed over for abort, its
waiting call failed, the replica restarted at the current version and routed to again; and a replica
killed just before or in the middle of a sync: the sync neither hangs nor fails, the replica comes
back with the new weights; and a replica that hangs once it has the weights (alive, never answering):
killed at the sync's deadline and restarted like a dead one, the run going on.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time

import pytest
import torch

from core import models
from core.config_io import load_config
from core.engine import SamplingParams
from core.engine import process
from core.engine.process import ReplicaLost
from core.engine.replicas import ReplicaBehind, ReplicaEngine, make_model_engine
from core.engine.routing import EPISODE
from core.engine.weight_sync import weights_digest, weights_of

RESTART_WAIT_S = 180.0  # a restart spawns a process that imports torch: ~5 s quiet, far more on a loaded 2-core box
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
# How long a sync may take to return once its stopped replica is killed: the kill fails the transfer
# at once; this bound (far below the 300 s sync timeout) only keeps a hang from passing unnoticed.
SYNC_RETURN_S = 120.0
# A sync's deadline in the hang test: far above a sync of the tiny model (milliseconds, seconds on a
# loaded box), far below the 300 s default, so the test waits seconds for the hung replica.
HUNG_SYNC_S = 20.0
SYNC_UNDER_WAY_S = 1.0  # time for the router to send the sync to a stopped replica and wait on it


class Episodes:
    """The run's side of the replicas' callbacks: the lost episodes it was handed, and which are open."""

    def __init__(self):
        self.lost: list[list[str]] = []
        self.open_prefix = ""  # episodes whose id starts with it are open; "" (at first): every one

    def is_open(self, episode: str) -> bool:
        return episode.startswith(self.open_prefix)


@pytest.fixture(scope="module")
def replicas():
    cfg = load_config({"models": [{"device": "cpu", "replicas": 2}], "trainer": {"max_staleness": 0}})
    model, tok = models.load(cfg.models[0])
    episodes = Episodes()
    engine = make_model_engine(cfg, cfg.models[0], model, tok, 256, on_lost=episodes.lost.append,
                               is_open=episodes.is_open)
    assert isinstance(engine, ReplicaEngine)
    yield engine, model, tok, episodes
    engine.close()


async def _episode(engine, name: str, prompt: list[int], calls: int) -> list[float]:
    EPISODE.set(name)  # what the registry sets when a request's key resolves (core.engine.routing)
    return [(await engine.generate(prompt, GREEDY)).timings["replica"] for _ in range(calls)]


def test_an_episodes_calls_stay_on_one_replica_and_new_episodes_go_to_the_least_loaded(replicas):
    engine, _, tok, _ = replicas
    prompt = tok.encode("hello", add_special_tokens=False)

    async def main():
        return await asyncio.gather(*(_episode(engine, f"sticky-{i}", prompt, 3) for i in range(6)))

    served = asyncio.run(main())
    assert all(len(set(calls)) == 1 for calls in served), served
    per_replica = [sum(1 for calls in served if calls[0] == r) for r in (0.0, 1.0)]
    assert per_replica == [3, 3]  # six new episodes, each to the replica with fewer pinned
    assert {engine.replica_of(f"sticky-{i}") for i in range(6)} == {0, 1}


def _perturb(model) -> None:
    """What a trainer step does to the trainer's module: its trainable weights change in place."""
    with torch.no_grad():
        for t in weights_of(model).values():
            t.add_(torch.randn_like(t) * 0.05)


def _digests_match(engine, model) -> bool:
    """Every replica holds, bit for bit, the trainer's trainable weights."""
    return [r.weights_digest() for r in engine.replicas] == [weights_digest(weights_of(model).items())] * 2


def _all_up(engine) -> bool:
    return all(r is not None for r in engine.replicas) and all(s["healthy"] for s in engine.status())


def _wait_all_healthy(engine) -> None:
    """Every replica slot filled (no restart under way) and healthy, within RESTART_WAIT_S."""
    deadline = time.monotonic() + RESTART_WAIT_S
    while time.monotonic() < deadline and not _all_up(engine):
        time.sleep(0.5)
    assert _all_up(engine), f"the replicas were not all up within {RESTART_WAIT_S:g} s: {engine.status()}"


def _logprobs_under(model, prompt: list[int], gen) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + gen.token_ids])).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    return [logp[len(prompt) + i - 1, t].item() for i, t in enumerate(gen.token_ids)]


def test_after_a_sync_both_replicas_serve_the_new_version_with_the_new_weights(replicas):
    engine, model, tok, _ = replicas
    prompt = tok.encode("weights", add_special_tokens=False)
    _perturb(model)
    target = engine.version + 1
    engine.resume(target)
    assert [s["version"] for s in engine.status()] == [target, target]
    assert _digests_match(engine, model)

    async def main():
        return await asyncio.gather(*(_episode(engine, f"synced-{i}", prompt, 1) for i in range(2)))

    asyncio.run(main())
    for i in range(2):
        EPISODE.set(f"synced-{i}")
        gen = asyncio.run(engine.generate(prompt, GREEDY))
        assert gen.version == target
        # The replica's recorded logprobs are those of the trainer's new weights: the weights arrived.
        assert gen.logprobs == pytest.approx(_logprobs_under(model, prompt, gen), abs=1e-4)


def test_a_sync_a_replica_cannot_take_fails_loudly_and_keeps_the_version(replicas):
    engine, model, _, _ = replicas
    before = engine.version
    model.register_parameter("not_in_replicas", torch.nn.Parameter(torch.zeros(2)))
    try:
        with pytest.raises(ReplicaBehind, match="did not reach every replica.*parameter 'not_in_replicas' of the "
                           "trainer's weights is not a parameter of this replica's model"):
            engine.resume(before + 1)
    finally:
        del model.not_in_replicas
    assert engine.version == before
    engine.resume(before + 1)  # the cause gone, the next sync goes through
    assert [s["version"] for s in engine.status()] == [before + 1] * 2


def test_a_sync_whose_shapes_do_not_match_the_replicas_model_fails_naming_the_parameter(replicas):
    engine, model, _, _ = replicas
    before = engine.version
    name, original = next((n, p) for n, p in model.named_parameters() if p.dim() == 1)
    owner, attr = model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
    setattr(owner, attr, torch.nn.Parameter(torch.zeros(original.numel() + 1)))
    try:
        with pytest.raises(ReplicaBehind, match=rf"parameter '{re.escape(name)}' has shape \[{original.numel() + 1}\] "
                           rf"in the trainer's weights but \[{original.numel()}\] in this replica's model"):
            engine.resume(before + 1)
    finally:
        setattr(owner, attr, original)
    assert engine.version == before and all(s["healthy"] for s in engine.status())  # refused, not lost
    _perturb(model)
    engine.resume(before + 1)
    assert _digests_match(engine, model)


def test_a_killed_replica_aborts_its_episodes_fails_its_calls_and_comes_back_synced(replicas):
    engine, _, tok, episodes = replicas
    lost = episodes.lost
    prompt = tok.encode("chaos", add_special_tokens=False)
    asyncio.run(_episode(engine, "doomed", prompt, 1))
    victim = engine.replica_of("doomed")
    pid = engine.status()[victim]["pid"]
    os.kill(pid, signal.SIGKILL)

    async def next_call():
        EPISODE.set("doomed")
        return await engine.generate(prompt, GREEDY)

    with pytest.raises(ReplicaLost):
        asyncio.run(next_call())  # its replica is gone: the call fails, the episode never completes there
    deadline = time.monotonic() + 30
    while not any("doomed" in batch for batch in lost) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert any("doomed" in batch for batch in lost)
    assert engine.replica_of("doomed") is None
    deadline = time.monotonic() + RESTART_WAIT_S
    while time.monotonic() < deadline and not all(s["healthy"] for s in engine.status()):
        time.sleep(0.5)
    rows = engine.status()
    assert all(s["healthy"] for s in rows) and rows[victim]["pid"] != pid
    assert rows[victim]["version"] == engine.version and rows[victim]["restarts"] == 1

    async def spread():
        return await asyncio.gather(*(_episode(engine, f"after-{i}", prompt, 1) for i in range(4)))

    episodes.open_prefix = "after-"  # the earlier episodes have ended
    assert {calls[0] for calls in asyncio.run(spread())} == {0.0, 1.0}  # the restarted one is routed to again


def test_an_overlapped_step_swaps_the_new_weights_into_both_replicas_between_decode_steps(replicas):
    engine, model, tok, _ = replicas
    prompt = tok.encode("overlap", add_special_tokens=False)
    before = engine.version

    def step() -> bool:  # what `trainer.apply` does inside the loop's swap: change the module in place
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.98)
        return True

    assert engine.swap_weights(step) is True
    assert engine.version == before + 1
    assert [s["version"] for s in engine.status()] == [before + 1] * 2
    EPISODE.set("overlap-check")
    gen = asyncio.run(engine.generate(prompt, GREEDY))
    assert gen.version == before + 1
    assert gen.logprobs == pytest.approx(_logprobs_under(model, prompt, gen), abs=1e-4)
    assert engine.swap_weights(lambda: False) is False and engine.version == before + 1  # no change, no version


@pytest.mark.parametrize("when", ["before", "during"])
def test_a_replica_killed_before_or_during_a_sync_neither_hangs_nor_fails_it_and_comes_back_synced(replicas, when):
    engine, model, _, _ = replicas
    _wait_all_healthy(engine)
    victim = 1
    pid = engine.status()[victim]["pid"]
    _perturb(model)
    target = engine.version + 1
    os.kill(pid, signal.SIGKILL if when == "before" else signal.SIGSTOP)  # stopped: it cannot take the sync
    outcome: list[BaseException | None] = []

    def sync() -> None:
        try:
            engine.resume(target)
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - the assertion below shows it
            outcome.append(e)
    syncing = threading.Thread(target=sync, daemon=True)
    syncing.start()
    if when == "during":
        syncing.join(SYNC_UNDER_WAY_S)
        assert syncing.is_alive()  # the sync waits on the stopped replica...
        os.kill(pid, signal.SIGKILL)  # ...which dies in the middle of it
    syncing.join(SYNC_RETURN_S)
    assert not syncing.is_alive(), "the sync hung on a killed replica"
    assert outcome == [None]  # not ReplicaBehind: a lost replica is restarted, not behind
    assert engine.version == target
    _wait_all_healthy(engine)
    rows = engine.status()
    assert all(s["healthy"] for s in rows) and rows[victim]["pid"] != pid
    assert [s["version"] for s in rows] == [target, target]
    assert _digests_match(engine, model)  # the restarted replica got the new weights, not its initial ones


def test_a_replica_that_hangs_after_taking_the_weights_is_restarted_and_the_run_goes_on(replicas, monkeypatch):
    """Stopped once it has taken the weights (SIGSTOP: alive, its heartbeat still recent), it never answers
    the sync: at the sync's deadline it is killed like a dead one and restarted at the new version,
    never left "healthy" and behind (ReplicaBehind would fail the run)."""
    engine, model, _, _ = replicas
    _wait_all_healthy(engine)
    monkeypatch.setattr(process, "SYNC_S", HUNG_SYNC_S)
    victim = engine.replicas[0]
    pid = victim.pid
    transfer = victim._transfer
    hang: dict[str, int] = {}

    class StopAtTheAnswer(dict):
        """The parent's table of requests awaiting an answer. The sync's answer, which the child sends
        once it has received and loaded the weights, is where the child "hangs": it is stopped there
        and its answer never reaches the parent. (Stopping it after the parent's broadcast returned
        raced the child's answer on a loaded host: the answer could be in before the SIGSTOP.)"""

        def get(self, seq, default=None):
            if seq == hang.get("seq"):
                os.kill(pid, signal.SIGSTOP)
                return default  # to the reader: nobody waits on this answer, as if it never came
            return super().get(seq, default)

    def transfer_then_hang(*args):
        hang["seq"] = max(victim._acks)  # the sync's request, sent just before its transfer
        transfer(*args)
    victim._acks = StopAtTheAnswer(victim._acks)
    victim._transfer = transfer_then_hang
    _perturb(model)
    target = engine.version + 1
    try:
        engine.resume(target)  # raises ReplicaBehind if the hung replica is taken for a live one behind
        assert engine.version == target and victim.lost
        # killed at the sync's deadline (not found silent by the heartbeat's 60 s, not refused)
        assert re.search(r"did not answer sync within|by the sync's deadline", victim.lost), victim.lost
    finally:
        if not victim.lost:  # a failed check must not leave a stopped replica to the tests after it
            victim.kill("the hang test ended with it still in service")
    _wait_all_healthy(engine)
    rows = engine.status()
    assert all(s["healthy"] for s in rows) and rows[0]["pid"] != pid
    assert [s["version"] for s in rows] == [target, target]
    assert _digests_match(engine, model)


def test_a_heartbeat_sent_before_a_sync_never_reports_the_replica_one_version_back(replicas):
    engine, model, _, _ = replicas
    _wait_all_healthy(engine)
    target = engine.version + 1
    _perturb(model)
    engine.resume(target)
    replica = engine.replicas[0]
    assert replica is not None, f"replica 0 was lost during the sync: {engine.status()}"
    replica._on_beat(target - 1, replica.load())  # the beat the child sent just before it took the sync
    assert replica.version == target and engine.status()[0]["version"] == target


@pytest.fixture(scope="module")
def lora_replicas():
    cfg = load_config({"models": [{"device": "cpu", "replicas": 2, "lora": {"r": 4, "alpha": 8}}],
                       "trainer": {"max_staleness": 0}})
    model, tok = models.load(cfg.models[0])
    policy = models.prepare_policy(model, cfg.models[0].lora).eval()
    engine = make_model_engine(cfg, cfg.models[0], policy, tok, 256)
    yield engine, policy, tok
    engine.close()


def test_lora_adapters_alone_reach_both_replicas_bit_for_bit_after_every_sync(lora_replicas):
    engine, policy, tok = lora_replicas
    assert _digests_match(engine, policy)  # the start's sync: the trainer's adapters, not each replica's own init
    adapters = weights_of(policy)
    assert adapters and all("lora_" in n for n in adapters)  # only the adapters travel
    for _ in range(2):  # two steps: the layout went once, the second sync reuses it
        _perturb(policy)
        target = engine.version + 1
        engine.resume(target)
        assert [s["version"] for s in engine.status()] == [target, target]
        assert _digests_match(engine, policy)
    prompt = tok.encode("adapters", add_special_tokens=False)
    EPISODE.set("lora-check")
    gen = asyncio.run(engine.generate(prompt, GREEDY))
    assert gen.version == engine.version
    assert gen.logprobs == pytest.approx(_logprobs_under(policy, prompt, gen), abs=1e-4)
