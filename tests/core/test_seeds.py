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
from core.clients.sandbox import TASK_WINDOW, task_order
from core.models import build_tiny
from core.run import checkpoint

UNSEEDED = SamplingParams(max_tokens=12, temperature=1.0)  # the request gives no seed: the run's stream decides


@pytest.fixture(scope="module")
def tiny():
    return build_tiny()


@pytest.fixture
def engine(tiny):
    made: list[HFEngine] = []

    def make(seed: int) -> HFEngine:
        model, tok = tiny
        eng = make_engine("hf", model, tok, EngineConfig(), 2048, seed=seed)
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


def test_per_request_seeds_for_vllm_come_from_the_run_seed(engine):
    # vLLM samples with a per-request seed; a request without one gets the next of the run's stream.
    a, again, other = engine(3), engine(3), engine(4)
    drawn = [a.request_seed(UNSEEDED) for _ in range(4)]
    assert drawn == [again.request_seed(UNSEEDED) for _ in range(4)]
    assert drawn != [other.request_seed(UNSEEDED) for _ in range(4)]
    assert len(set(drawn)) == 4  # a stream, not one seed reused
    assert a.request_seed(SamplingParams(max_tokens=4, seed=9)) == 9


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
    from core.config import RunConfig
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
