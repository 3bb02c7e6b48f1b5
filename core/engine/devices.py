"""One device per process: the environment a replica or trainer-rank process starts with.

Every process this run spawns onto a GPU (a rollout replica, `core.engine.process`; a trainer rank,
`core.train.ranks`) sees that GPU alone: `CUDA_VISIBLE_DEVICES` names it, and inside the process it
is `cuda:0` (`local_device`). Why: vLLM's single-process executor takes local rank 0, so a vLLM
replica meant for `cuda:1` that could see every GPU put its weights and KV cache on `cuda:0`,
beside trainer rank 0; and NCCL, CUDA's caching allocator and torch's default device then all agree
on one device without being told. The run process itself keeps every GPU (rank 0 of each group).

Also here, `NCCL_ENV`: the NCCL settings every process of the run holds, so both ends of every
group agree (`nccl_env` in the run process before it builds an NCCL group; a child gets them in its
start environment). vLLM sets `NCCL_CUMEM_ENABLE=0` in its own process; a peer that used cuMem
buffers while the other did not would fail or hang at the first collective.

The environment is applied by the child itself, first thing (`run_pinned`), not by changing the
parent's `os.environ` around `Process.start`: the run process has threads (NCCL's, CUDA's, the
server's) that read the environment, and `setenv` beside a concurrent `getenv` may crash. Nothing
touches CUDA before it: importing torch or transformers does not initialise it.

Which device each process gets is here too (`model_devices`, and `sleeping_replicas`: the replicas
that share a trainer rank's GPU), pure functions of a model's config and a GPU count, so `--dry-run`
plans for a machine it is not on. Deliberately not here: Ray's actors (Ray sets the variable for the
GPUs it reserves), and the memory plan (`core.run.plan`).
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from typing import Any

from core.config import ModelConfig

NCCL_ENV = {
    # cuMem-backed NCCL buffers off on both ends: vLLM turns them off in its own process (they broke
    # its sleep mode), and a group whose ends disagree does not work.
    "NCCL_CUMEM_ENABLE": "0",
    # A failed or timed-out collective aborts its communicator and raises in the waiting call (2).
    # torch's default (3) tears the whole process down: a replica that hung mid-sync would end the
    # run, where the run kills and restarts that replica (`core.engine.process`).
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
}


def local_device(device: str) -> str:
    """What `device` (as the run names it) is called inside its own pinned process: cuda:0 for a GPU."""
    return "cuda:0" if device.startswith("cuda") else device


def child_env(device: str, parent: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a process for `device` starts with: its GPU alone visible (none for a cpu
    process, so it cannot take memory on one by accident), and `NCCL_ENV`. `parent`: the run's own
    environment (os.environ by default); a GPU index counts among the GPUs it shows, as torch's do."""
    parent = os.environ if parent is None else parent
    env = dict(NCCL_ENV)
    if not device.startswith("cuda"):
        env["CUDA_VISIBLE_DEVICES"] = ""
        return env
    index = int(device.split(":")[1]) if ":" in device else 0
    shown = [d for d in parent.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if "CUDA_VISIBLE_DEVICES" in parent and index >= len(shown):
        raise ValueError(f"{device}: the run sees only CUDA_VISIBLE_DEVICES={parent['CUDA_VISIBLE_DEVICES']!r}")
    env["CUDA_VISIBLE_DEVICES"] = shown[index].strip() if "CUDA_VISIBLE_DEVICES" in parent else str(index)
    return env


def nccl_env() -> None:
    """`NCCL_ENV` in this process (before it builds an NCCL group); written only where it differs."""
    for key, value in NCCL_ENV.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


def run_pinned(env: dict[str, str], target: Callable[..., Any], *args: Any) -> Any:
    """A pinned child's entry point: take `env`, then run `target(*args)` (see the module doc)."""
    os.environ.update(env)
    return target(*args)


def spawn_pinned(device: str, target: Callable[..., Any], args: tuple, name: str) -> Any:
    """A started spawn process running `target(*args)` with `device`'s environment (`child_env`)."""
    proc = multiprocessing.get_context("spawn").Process(
        target=run_pinned, args=(child_env(device), target, *args), name=name, daemon=True)
    proc.start()
    return proc


def model_devices(mc: ModelConfig, gpus: int) -> tuple[list[str], list[str]]:
    """(trainer rank devices, replica devices) of a model on a machine with `gpus` GPUs.

    A cpu model (or `auto` without a GPU) puts everything on cpu. On GPUs the defaults follow
    `layout`: ranks on cuda:0..M-1; replicas colocated on cuda:0..N-1 (sharing the ranks' GPUs) or
    split onto cuda:M..M+N-1. Explicit `trainer.devices` / `replica_devices` win. Pure: the caller
    says how many GPUs there are, so `--dry-run` can plan for a machine it is not on."""
    on_cpu = mc.device == "cpu" or (mc.device == "auto" and gpus == 0)
    m, n = mc.trainer.world_size, mc.replicas
    if on_cpu:
        return mc.trainer.devices or ["cpu"] * m, mc.replica_devices or ["cpu"] * n
    ranks = mc.trainer.devices or ([mc.device] if m == 1 else [f"cuda:{i}" for i in range(m)])
    first = 0 if mc.layout == "colocated" else m
    return ranks, mc.replica_devices or [f"cuda:{first + i}" for i in range(n)]


def sleeping_replicas(mc: ModelConfig, gpus: int) -> list[int]:
    """The replicas that sleep during the trainer's step: `layout: colocated` put them on a GPU that
    also holds a trainer rank, which needs the memory for its gradients and optimizer state. None on
    CPU (host memory is not what a step runs short of) or when split."""
    if mc.layout != "colocated" or mc.replicas < 2:
        return []
    ranks, replicas = model_devices(mc, gpus)

    def gpu(d: str) -> str | None:  # the same GPU however it is named ("auto" and "cuda" are cuda:0 here)
        if d == "auto":
            return "cuda:0" if gpus else None
        return (d if ":" in d else d + ":0") if d.startswith("cuda") else None

    trained = {gpu(d) for d in ranks} - {None}
    return [i for i, d in enumerate(replicas) if gpu(d) in trained]
