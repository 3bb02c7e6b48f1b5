"""An FSDP2 rank's model (`core.train.sharded`): built on the meta device from its config alone, then
cut into FSDP2 units (`shard`: one a decoder layer, a root for the rest, gradients reduced in fp32
and summed over the ranks).

Every FSDP2 rank builds its model here, shards it (`fully_shard`) and only then allocates storage
(`to_empty`): its shard of each parameter, never the whole model; the frozen KL reference the same
way (`shard_frozen`). The values come from rank 0's
module over the group (`_Shard.take_weights`, buffers included: `to_empty` leaves them unset). So
a rank never loads the checkpoint from disk or holds a full copy; rank 0 holds the run's full module,
which the engines and checkpoints need anyway, unless none does (`to_meta` frees it in place).
Deliberately not here: loading weights (`core.models.load`), and LoRA (fsdp2 trains full
fine-tunes only).
"""

from __future__ import annotations

from pathlib import Path

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from transformers import AutoConfig, AutoModelForCausalLM

from core.config import ModelConfig
from core.models import build_tiny, smollm2_folder
from core.train.packing import token_logprobs

META = torch.device("meta")


def meta_model(mc: ModelConfig, dtype: torch.dtype) -> torch.nn.Module:
    """`mc`'s causal LM on the meta device in `dtype`: shapes and structure, no storage."""
    with META:
        if mc.source == "tiny":
            model = build_tiny(0 if mc.seed is None else mc.seed)[0]
        else:
            folder = smollm2_folder() if mc.source == "smollm2-135m" else Path(mc.source).expanduser()
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    return model.to(dtype=dtype).eval()


class _Scorer(torch.nn.Module):
    """The causal LM behind a module whose forward is the trainer's scoring pass (FSDP2's root hooks it)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, mb: Any, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return token_logprobs(self.model, mb, positions=positions)


# Gradients reduce in fp32 whatever the weights' dtype: a bf16 reduce-scatter rounds each rank's
# share before the sum (issue 41 measured a 1.5e-2 relative gap between 1 and 2 ranks). The weights
# stay in their own dtype (param_dtype None); the reduced gradient is cast back to it.
REDUCE_IN_FP32 = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)


def shard(model: torch.nn.Module, mesh: DeviceMesh, checkpointing: bool = False) -> _Scorer:
    """`model` sharded in place over `mesh`, one unit a decoder layer, gradients summed over ranks in
    fp32; `checkpointing`: each decoder layer's activations recomputed in the backward instead of kept
    (transformers' gradient checkpointing, non-reentrant, which FSDP2's hooks work with)."""
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    scorer = _Scorer(model)
    for layer in getattr(model.get_decoder(), "layers", []):
        fully_shard(layer, mesh=mesh, mp_policy=REDUCE_IN_FP32)
    fully_shard(scorer, mesh=mesh, mp_policy=REDUCE_IN_FP32)
    for module in scorer.modules():
        if isinstance(module, FSDPModule):  # each unit's reduction is its own: set on every one
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return scorer


def shard_frozen(model: torch.nn.Module, mesh: DeviceMesh) -> _Scorer:
    """A frozen copy (the KL reference) sharded like `shard`'s units: no gradients, so no reduction
    settings; scored under no_grad, each unit all-gathered for its forward and freed after it."""
    scorer = _Scorer(model.eval().requires_grad_(False))
    for layer in getattr(model.get_decoder(), "layers", []):
        fully_shard(layer, mesh=mesh)
    fully_shard(scorer, mesh=mesh)
    return scorer


@torch.no_grad()
def to_meta(module: torch.nn.Module) -> None:
    """Free `module`'s weights in place: every parameter and buffer on the meta device, names, shapes,
    dtypes and ties kept (`Module.to("meta")` unties a tied head: one parameter, two meta copies)."""
    metas: dict[int, torch.nn.Parameter] = {}
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is not None:
                m._parameters[name] = metas.setdefault(id(p), torch.nn.Parameter(p.to(META), p.requires_grad))
        for name, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[name] = b.to(META)
