"""`trainer.seed` means something: it seeds the engine's sampling and the order clients draw tasks, and a
checkpoint carries the sampler's state so a resumed run continues its stream instead of replaying it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from core.config import EngineConfig
from core.engine import SamplingParams
from core.engine.factory import make_engine
from core.engine.hf import HFEngine
from core.sandbox.folder import TASK_WINDOW, task_order
from core.config import RunConfig
from core.episodes.registry import Registry
from core.episodes.wire import OpenEpisode
from core.models import build_tiny, load
from core.serve.gateway import draw_key
from core.run import checkpoint

UNSEEDED = SamplingParams(max_tokens=12, temperature=1.0)  # the request gives no seed: the run's stream decides


@pytest.fixture(scope="module")
def tiny():
    return build_tiny()


@pytest.fixture
def engine(tiny):
    made: list[HFEngine] = []

    def make(seed: int, repeatable: bool = False) -> HFEngine:
        model, tok = tiny
        eng = make_engine("hf", model, tok, EngineConfig(repeatable_sampling=repeatable), 2048, seed=seed)
        made.append(eng)
        return eng

    yield make
    for eng in made:
        eng.close()


def completions(eng: HFEngine, n: int = 3) -> list[list[int]]:
    ids = eng.tokenizer("the same request every time", add_special_tokens=False)["input_ids"]

    async def go():
        return [(await eng.generate(ids, UNSEEDED)).token_ids for _ in range(n)]

    return asyncio.run(go())


def test_two_seeds_sample_different_completions_for_the_same_request(engine):
    assert completions(engine(0)) != completions(engine(1))


def test_the_same_seed_samples_the_same_completions(engine):
    assert completions(engine(5)) == completions(engine(5))


def test_a_request_that_names_its_seed_keeps_it_whatever_the_run_seed(engine):
    a, b = engine(0), engine(1)
    own = SamplingParams(max_tokens=12, temperature=1.0, seed=42)
    ids = a.tokenizer("hello there", add_special_tokens=False)["input_ids"]
    assert asyncio.run(a.generate(ids, own)).token_ids == asyncio.run(b.generate(ids, own)).token_ids


def test_without_repeatable_sampling_only_a_request_that_names_a_seed_gets_one(engine):
    # vLLM's fast path: an unseeded request stays on its batched sampler (seed None).
    eng = engine(3)
    assert [eng.request_seed(UNSEEDED), eng.request_seed(SamplingParams(max_tokens=4, key="t/0/0/0"))] == [None, None]
    assert eng.request_seed(SamplingParams(max_tokens=4, seed=9)) == 9


def test_repeatable_sampling_derives_a_requests_seed_from_the_run_seed_and_its_key(engine):
    a, again, other = engine(3, repeatable=True), engine(3, repeatable=True), engine(4, repeatable=True)
    keys = [f"letters/task-{t}/{k}/0/0" for t in range(2) for k in range(2)]
    seeds = [a.request_seed(SamplingParams(max_tokens=4, key=k)) for k in keys]
    assert seeds == [again.request_seed(SamplingParams(max_tokens=4, key=k)) for k in reversed(keys)][::-1]
    assert len(set(seeds)) == len(keys)  # each draw its own seed
    assert set(seeds).isdisjoint(other.request_seed(SamplingParams(max_tokens=4, key=k)) for k in keys)
    assert all(0 <= s < 2**63 for s in seeds)
    assert a.request_seed(SamplingParams(max_tokens=4, key="x", seed=9)) == 9  # a request's own seed wins
    keyless = [a.request_seed(UNSEEDED) for _ in range(3)]  # no episode: the run's stream, still seeded
    assert keyless == [again.request_seed(UNSEEDED) for _ in range(3)] and len(set(keyless)) == 3


def _concurrently(eng: HFEngine, keys: list[str]) -> dict[str, list[int]]:
    prompt = eng.tokenizer("the same request every time", add_special_tokens=False)["input_ids"]

    async def go():
        gens = await asyncio.gather(*(eng.generate(prompt, SamplingParams(max_tokens=12, temperature=1.0, key=k))
                                      for k in keys))
        return {k: g.token_ids for k, g in zip(keys, gens)}

    return asyncio.run(go())


def test_repeatable_sampling_gives_each_keyed_request_its_tokens_whatever_the_arrival_order(engine):
    keys = [f"letters/t{i}/0/0/0" for i in range(6)]
    eng = engine(0, repeatable=True)
    forward, backward = _concurrently(eng, keys), _concurrently(eng, keys[::-1])
    assert forward == backward
    assert len({tuple(v) for v in forward.values()}) == len(keys)  # different keys, different completions
    assert _concurrently(engine(0, repeatable=True), keys[:1]) == {keys[0]: forward[keys[0]]}  # alone, the same
    # Without it, rows share the run's stream in arrival order: two engines of one seed, the order decides.
    assert _concurrently(engine(0), keys) != _concurrently(engine(0), keys[::-1])


def test_a_checkpoint_round_trip_continues_the_sampler_stream(engine, tmp_path: Path):
    first = engine(7)
    completions(first, 1)  # the stream has moved on
    checkpoint.save(tmp_path, 1, {}, [], {}, {}, samplers=checkpoint.samplers_of({"policy": first}))
    after_save = completions(first, 2)

    resumed = engine(7)
    ckpt = checkpoint.load_latest(tmp_path)
    assert ckpt is not None and set(ckpt.samplers) == {"policy"}
    checkpoint.restore_samplers(ckpt, {"policy": resumed})
    assert completions(resumed, 2) == after_save  # continues, not replayed from the start
    assert completions(engine(7), 2)[0] != after_save[0]


def test_a_damaged_sampler_file_is_reported_by_path(tmp_path: Path):
    path = checkpoint.save(tmp_path, 1, {}, [], {}, {}, samplers={"policy": torch.Generator().get_state()})
    (path / checkpoint.SAMPLERS).write_bytes(b"not a torch file")
    with pytest.raises(checkpoint.CheckpointError, match="samplers.pt"):
        checkpoint.load(path)


def test_a_checkpoint_without_sampler_states_leaves_the_engines_as_seeded(engine, tmp_path: Path):
    checkpoint.save(tmp_path, 1, {}, [], {}, {})
    eng = engine(2)
    checkpoint.restore_samplers(checkpoint.load_latest(tmp_path), {"policy": eng})
    assert completions(eng, 1) == completions(engine(2), 1)


def test_the_server_seeds_its_engines_from_trainer_seed(tiny):
    from core.serve.server import load_policies

    def first_tokens(seed: int) -> list[list[int]]:
        cfg = RunConfig.model_validate({"models": [{"name": "policy", "source": "tiny"}], "trainer": {"seed": seed}})
        policies = load_policies(cfg)
        try:
            return completions(policies["policy"].engine, 2)
        finally:
            for p in policies.values():
                p.engine.close()

    assert first_tokens(0) != first_tokens(1)


def test_clients_draw_train_tasks_in_an_order_set_by_the_seed():
    tasks = [{"id": i} for i in range(50)]
    as_yielded = list(task_order(tasks, None))
    assert as_yielded == list(enumerate(tasks))
    a, b = list(task_order(tasks, "0/0")), list(task_order(tasks, "1/0"))
    assert a == list(task_order(tasks, "0/0"))
    assert a != b and sorted(a, key=lambda p: p[0]) == as_yielded  # same tasks, each once, with its position


def test_an_endless_task_stream_is_shuffled_through_a_window():
    def endless():
        i = 0
        while True:
            yield {"id": i}
            i += 1

    order = task_order(endless(), "0/0")
    head = [next(order)[0] for _ in range(TASK_WINDOW)]
    assert sorted(head) == list(range(TASK_WINDOW)) and head != sorted(head)


def test_a_random_initialised_model_takes_its_weights_seed_from_the_run_unless_pinned():
    def weights(trainer_seed: int, pinned: int | None = None) -> torch.Tensor:
        model = {"name": "policy", "source": "tiny", **({"seed": pinned} if pinned is not None else {})}
        cfg = RunConfig.model_validate({"models": [model], "trainer": {"seed": trainer_seed}})
        assert cfg.models[0].seed == (trainer_seed if pinned is None else pinned)
        return load(cfg.models[0].model_copy(update={"device": "cpu"}))[0].model.embed_tokens.weight

    assert not torch.equal(weights(1), weights(2))  # replicates start from different weights
    assert torch.equal(weights(1), weights(1))
    assert torch.equal(weights(1, pinned=7), weights(2, pinned=7))  # models[].seed pins them


def test_each_episode_of_a_task_gets_the_next_ordinal_its_name_across_runs():
    registry = Registry(lease_s=60, default_group_size=3, batch_groups=1)
    opened = [registry.open(OpenEpisode(sandbox="letters", task_id=t), {})[0] for t in ("a", "b", "a", "a", "b")]
    assert [(e.task_id, e.ordinal) for e in opened] == [("a", 0), ("b", 0), ("a", 1), ("a", 2), ("b", 1)]
    assert [draw_key(opened[2], 0, c) for c in (0, 1)] == ["letters/a/1/0/0", "letters/a/1/0/1"]
    assert draw_key(None, 0, 0) is None  # anonymous calls have no name across runs
    # a request's calls are reserved before they are sampled: the next request's index follows its choices
    assert (registry.reserve_calls(opened[2], 2), registry.reserve_calls(opened[2], 1)) == (0, 2)
