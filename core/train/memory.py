"""The memory arithmetic of one model's placement: what a trainer rank and a rollout replica hold.

`swarm run --dry-run` prints it and `core.run.plan` refuses a placement whose arithmetic exceeds a
GPU this machine has; `sharding_of` uses it to pick replicated or FSDP2 ranks for `trainer.sharding:
auto` (it lives in core.train so the trainer can ask it). Counted, per parameter: the weights in their dtype; for a full fine-tune
the gradients (same dtype), fp32 master copies of low-precision weights (`trainer.master_weights`),
AdamW's two fp32 moments and, with `kl_coef` > 0, a frozen reference copy; for LoRA only the
frozen weights (adapters are a rounding error at r <= 64). A replica holds the weights; a vLLM
replica also its share of the GPU (`engine.gpu_memory_utilization`: vLLM's weights, activations and
KV cache), which it frees asleep. A GPU is counted in both phases of a step (`device_use`): rollout
(replicas awake, the trainer's state resident unless `trainer.offload` moves it to the host) and
the step (colocated replicas asleep, the trainer's state on the GPU); its need is the larger.
Not counted: the trainer's activations (set by `micro_batch_tokens`), an hf replica's KV cache, and
CUDA contexts, so the figures are floors, not a guarantee. The parameter count comes from the
model's config on the meta device: nothing is loaded or allocated.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from core.config import ModelConfig, RunConfig
from core.models import build_tiny

GB = 1e9  # figures in decimal GB, as GPU makers state memory
# SmolLM2-135M's parameters (tied embeddings), so planning it never downloads or converts the model.
SMOLLM2_PARAMETERS = 134_515_008
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ADAM_BYTES = 8  # two fp32 moments a parameter
MASTER_BYTES = 4  # an fp32 master copy of a bf16/fp16 weight


@dataclass(frozen=True)
class Footprint:
    parameters: int
    weight_bytes: int  # bytes a parameter takes in the model's dtype
    rank_gb: float  # one data-parallel (DDP) trainer rank: everything replicated
    fsdp_rank_gb: float  # one FSDP2 rank (core.train.sharded): the same state / world_size, the KL reference whole
    replica_gb: float  # one rollout replica: the weights


def parameters(mc: ModelConfig) -> int:
    """The model's parameter count, from its config alone (instantiated on the meta device)."""
    if mc.source == "tiny":
        return sum(p.numel() for p in build_tiny(mc.seed)[0].parameters())
    if mc.source == "smollm2-135m":
        return SMOLLM2_PARAMETERS
    config = AutoConfig.from_pretrained(Path(mc.source).expanduser())
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def footprint(cfg: RunConfig, mc: ModelConfig, on_gpu: bool) -> Footprint:
    n = parameters(mc)
    dtype = mc.dtype or ("bfloat16" if on_gpu else "float32")
    w = BYTES[dtype]
    if mc.lora is not None:
        rank = n * w
    else:
        master = MASTER_BYTES if w < 4 and cfg.trainer.master_weights else 0
        optimizer = ADAM_BYTES if master or w == 4 else 2 * w  # moments in the dtype of what is stepped
        ref = w if cfg.trainer.kl_coef > 0 else 0
        rank = n * (w + w + master + optimizer + ref)
    reference = n * w if mc.lora is None and cfg.trainer.kl_coef > 0 else 0  # not sharded: each rank scores with it
    sharded = (rank - reference) / mc.trainer.world_size + reference
    return Footprint(n, w, rank / GB, sharded / GB, n * w / GB)


@dataclass(frozen=True)
class DeviceUse:
    """What one GPU holds in the two phases of a step, in GB. rollout: the replicas generate, the trainer
    waits between steps (its state in host memory with `trainer.offload`); step: the replicas that
    share a trainer rank's GPU sleep (`core.engine.replicas`), the trainer's state is on the GPU."""

    rollout_gb: float
    step_gb: float
    parts: tuple[str, ...]  # what was counted, for the refusal's message

    @property
    def peak_gb(self) -> float:
        return max(self.rollout_gb, self.step_gb)


def replica_use(fp: Footprint, engine: str, utilization: float, device_gb: float | None,
                module_copy: bool = False) -> tuple[float, float]:
    """(awake, asleep) GB of one rollout replica on a GPU of `device_gb`. A vLLM replica takes
    `utilization` of the GPU for its weights, activations and KV cache (vLLM's own budget; unknown
    device: its weights alone) and frees it asleep (its weights kept in host memory). A replica
    (a process, or a Ray actor) keeps no other copy: the sync loads into vLLM's model
    (`core.engine.replica_child`); `module_copy`: one that kept the module the sync fills would hold a second
    copy of the weights, awake or not. An hf replica holds its weights alone (its KV cache is not
    counted) and keeps them asleep."""
    if engine != "vllm":
        return fp.replica_gb, fp.replica_gb
    budget = utilization * device_gb if device_gb is not None else fp.replica_gb
    copy = fp.replica_gb if module_copy else 0.0
    return budget + copy, copy


def device_use(trainer_gb: float, offload: bool, replicas: list[tuple[float, float, bool]]) -> DeviceUse:
    """One GPU's phases from what it holds: `trainer_gb` of trainer state (0 without a rank), offloaded
    to the host during rollout or not, and for each replica on it (awake GB, asleep GB, sleeps during
    the step)."""
    awake = sum(a for a, _, _ in replicas)
    during_step = sum(s if sleeps else a for a, s, sleeps in replicas)
    resident = 0.0 if offload else trainer_gb
    parts = []
    if trainer_gb:
        parts.append(f"trainer {trainer_gb:.1f} GB" + (" (offloaded during rollout)" if offload else ""))
    if replicas:
        parts.append(f"{len(replicas)} replica(s) {awake:.1f} GB awake, {during_step:.1f} GB during the step")
    return DeviceUse(resident + awake, trainer_gb + during_step, tuple(parts))


def rank_gb(fp: Footprint, sharding: str) -> float:
    """What one trainer rank holds under `sharding` (replicate or fsdp2). An fsdp2 rank 0 also keeps
    the full weights the engines read (`core.train.sharded`); `core.run.plan` adds those to its device."""
    return fp.fsdp_rank_gb if sharding == "fsdp2" else fp.rank_gb


def sharding_of(cfg: RunConfig, mc: ModelConfig, devices: list[str]) -> str:
    """`mc.trainer.sharding` with `auto` decided for the rank devices of this machine (`choose_sharding`)."""
    if mc.trainer.sharding != "auto":
        return mc.trainer.sharding
    if mc.trainer.world_size < 2 or mc.lora is not None:
        return "replicate"  # nothing to shard over; LoRA trains small adapters (fsdp2 is full fine-tunes)
    need = footprint(cfg, mc, on_gpu=True).rank_gb if any(d.startswith("cuda") for d in devices) else 0.0
    return choose_sharding(need, [device_memory_gb(d) for d in devices])


def choose_sharding(rank_gb: float, device_gbs: list[float | None]) -> str:
    """fsdp2 when one replicated rank's state (`rank_gb`) exceeds the smallest rank device, else
    replicate; replicate too when a device's memory is unknown here (CPU, or a GPU of another machine)."""
    if not device_gbs or any(gb is None for gb in device_gbs):
        return "replicate"
    return "fsdp2" if rank_gb > min(gb for gb in device_gbs if gb is not None) else "replicate"


def device_memory_gb(device: str) -> float | None:
    """Total memory of a local CUDA device, or None when this machine does not have it (or it is cpu)."""
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return None
    index = int(device.split(":")[1]) if ":" in device else 0
    if index >= torch.cuda.device_count():
        return None
    return torch.cuda.get_device_properties(index).total_memory / GB
