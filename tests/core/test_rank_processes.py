"""The rank processes both multi-rank trainers use (core/train/ranks.py), with a trivial rank body.

Commands reach a rank by value: a tensor the rank changes in place stays as it was in rank 0 (torch's
own pickling for multiprocessing would have shared its storage between the two processes, so a
resumed checkpoint's AdamW step counters were incremented by both ranks). A handler's error and a
dead rank both come back as a RankError naming the rank.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from core.engine.devices import NCCL_ENV
from core.train.ranks import RankError, RankProcesses, rank_seed, serve


def _rank(conn, rank: int) -> None:
    def bump(t: torch.Tensor) -> float:
        t += 1  # in place, as AdamW increments its step counters
        return float(t.sum())

    def fail() -> None:
        raise ValueError("bad input")

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    serve(conn, rank, {"bump": bump, "fail": fail, "die": die})


@pytest.fixture
def ranks():
    procs = RankProcesses("policy", ["cpu", "cpu"], _rank, ())
    procs.wait_ready()
    yield procs
    procs.close()


def test_a_tensor_sent_to_a_rank_is_a_copy_not_shared_memory(ranks):
    step = torch.zeros(3)
    assert ranks.command("bump", step) == [3.0]
    assert ranks.command("bump", step) == [3.0]  # the rank got a fresh copy again
    assert torch.equal(step, torch.zeros(3))


def test_a_rank_error_and_a_dead_rank_fail_loudly_with_the_rank(ranks):
    with pytest.raises(RankError, match="rank 1: ValueError: bad input"):
        ranks.command("fail")
    with pytest.raises(RankError, match="rank 1 of 'policy' (died|hung up)"):
        ranks.command("die")


def _environment(conn, rank: int) -> None:
    serve(conn, rank, {"env": lambda: {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", *NCCL_ENV)}})


def test_a_rank_process_starts_seeing_its_own_gpu_alone_with_the_runs_nccl_settings(monkeypatch):
    """Its environment is pinned before it runs anything (no CUDA is touched here: the check runs on CPU)."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    procs = RankProcesses("policy", ["cuda:0", "cuda:3"], _environment, ())
    try:
        procs.wait_ready()
        assert procs.command("env") == [{"CUDA_VISIBLE_DEVICES": "3", **NCCL_ENV}]
    finally:
        procs.close()


def test_each_rank_draws_its_own_dropout_masks():
    """Seeded as rank 1 and rank 2 are, two LoRA-style dropouts on the same input keep different units."""
    masks = []
    for rank in (1, 2):
        torch.manual_seed(rank_seed(0, rank))
        masks.append(torch.nn.functional.dropout(torch.ones(256), p=0.5) > 0)
    assert rank_seed(0, 0) == 0  # rank 0 keeps the run's seed
    assert not torch.equal(masks[0], masks[1])
