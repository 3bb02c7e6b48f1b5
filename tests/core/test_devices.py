"""One device per process (core/engine/devices.py): what a replica or rank process starts with.

A process for cuda:k sees GPU k alone and calls it cuda:0; under a run that itself sees a subset of
the GPUs, k counts among those; a cpu process sees none; every process gets the same NCCL settings
as the run process takes before its own NCCL groups. The spawned-process check is in
tests/core/test_rank_processes.py (a rank process's environment) and below (a replica's spec).
"""

from __future__ import annotations

import os

import pytest

from core.engine.devices import NCCL_ENV, child_env, local_device, nccl_env
from core.engine.process import pinned_spec
from core.engine.replica_child import ReplicaSpec


def test_a_gpu_process_sees_its_gpu_alone_and_the_run_s_nccl_settings():
    assert child_env("cuda:1", {}) == {"CUDA_VISIBLE_DEVICES": "1", **NCCL_ENV}
    assert child_env("cuda", {})["CUDA_VISIBLE_DEVICES"] == "0"
    assert local_device("cuda:1") == "cuda:0" and local_device("cpu") == "cpu"


def test_a_gpu_index_counts_among_the_gpus_the_run_itself_sees():
    assert child_env("cuda:1", {"CUDA_VISIBLE_DEVICES": "4,6"})["CUDA_VISIBLE_DEVICES"] == "6"
    with pytest.raises(ValueError, match="sees only"):
        child_env("cuda:2", {"CUDA_VISIBLE_DEVICES": "4,6"})


def test_a_cpu_process_sees_no_gpu():
    assert child_env("cpu", {"CUDA_VISIBLE_DEVICES": "0,1"})["CUDA_VISIBLE_DEVICES"] == ""


def test_the_run_process_takes_the_same_nccl_settings_as_its_children(monkeypatch):
    for key in NCCL_ENV:
        monkeypatch.setenv(key, "something else")
    nccl_env()
    assert {k: os.environ[k] for k in NCCL_ENV} == NCCL_ENV
    assert NCCL_ENV["NCCL_CUMEM_ENABLE"] == "0"  # what vLLM sets in its own process


def test_a_replica_on_cuda_1_is_told_to_build_on_cuda_0_of_its_own_process():
    spec = ReplicaSpec(index=1, model={"device": "cuda:1", "name": "m"}, engine={}, max_context=64, seed=1)
    assert pinned_spec(spec).model == {"device": "cuda:0", "name": "m"}
    assert spec.model["device"] == "cuda:1"  # the parent keeps the run's name (its weights group's backend)
