"""An FSDP2 trainer's checkpoint state (`core.train.sharded`), in two forms.

The single-trainer format: every DTensor made whole on rank 0's host (`full`, a collective, one
tensor at a time) and, to load, rank 0's full tensors scattered to each rank's shard (`_scatter`),
the other ranks knowing them by `Shape` alone (`skeleton`). It resumes at any world size and under
either sharding, but gathers the optimizer state whole into rank 0's host memory: about 84 GB for a
7B model.

Sharded (`save` / `load`): torch.distributed.checkpoint (DCP), every rank writing and reading its
own shards of the weights and AdamW moments, keyed by parameter name (`get_state_dict` /
`set_state_dict`), so no rank ever holds the whole; DCP reshards on load, so a checkpoint written
at one world size loads at another, or into one unsharded trainer (no process group: DCP then
reads every shard itself). Covered: weights and optimizer state of a trainer that steps its
parameters in place (fp32, or `trainer.master_weights` off); a bf16 trainer's fp32 master copies
are not parameters of the module, and are refused here (the single-trainer format keeps them).
Deliberately not here: when a run writes which (`core.run.checkpoint`), and the RNG and step
count (small: the single-trainer state carries them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor


@dataclass(frozen=True)
class Shape:
    """A full tensor's shape and dtype, standing in for it in the state rank 0 sends the other ranks
    (`skeleton`): the values follow over the group, each rank receiving its shard alone."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def full(x: Any, keep: bool = True) -> Any:
    """`x` with every DTensor in it made whole, on the CPU. A collective: every rank calls it on the same
    structure, one tensor at a time; `keep=False` (ranks 1..M-1) drops each one once gathered."""
    if isinstance(x, DTensor):
        whole = x.full_tensor()
        return whole.cpu() if keep else None
    if isinstance(x, dict):
        return {k: full(v, keep) for k, v in x.items()}
    if isinstance(x, list):
        return [full(v, keep) for v in x]
    return x


def skeleton(state: dict[str, Any]) -> dict[str, Any]:
    """A single-trainer state with each tensor a shard is cut from replaced by its `Shape` (what goes
    over the pipes: a 7B model's moments to every rank would be 60 GB each)."""
    def shape(v: Any) -> Any:
        return Shape(tuple(v.shape), v.dtype) if torch.is_tensor(v) and v.dim() > 0 else v

    opt = state["optimizer"]
    return {**state, "optimizer": {**opt, "state": {i: {k: shape(v) for k, v in values.items()}
                                                    for i, values in opt["state"].items()}},
            "master": [shape(m) for m in state.get("master") or []]}


def _sharded(value: Any, like: torch.Tensor) -> bool:
    """Whether `like`'s shard is cut from `value` (a moment or master copy), not taken whole (a step count)."""
    return isinstance(like, DTensor) and (isinstance(value, Shape) or torch.is_tensor(value) and value.dim() > 0)


def _scatter(value: Any, like: torch.Tensor) -> Any:
    """`like`'s shard of a full tensor that rank 0 holds (`value`) and the others know by `Shape`: a collective."""
    if not _sharded(value, like):
        return value
    whole = (torch.empty(value.shape, dtype=value.dtype, device=like.device) if isinstance(value, Shape)
             else value.to(like.device))
    return distribute_tensor(whole, like.device_mesh, like.placements, src_data_rank=0)


def _check_in_place(trainer: Any) -> None:
    if trainer.master.pairs:
        raise ValueError("a sharded checkpoint covers a trainer that steps its parameters in place; this one "
                         "steps fp32 master copies (bf16 with trainer.master_weights): use the single-trainer format")


def _state(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(module, optimizer)
    return {"model": model_sd, "optimizer": optim_sd}


def save(trainer: Any, path: str) -> None:
    """Write `trainer`'s weights and optimizer state (this rank's shards of them) to the DCP folder
    `path`; every rank of a sharded trainer calls it together. `trainer.model`: the causal LM whose
    parameters the optimizer steps (a `_Shard`'s, or a plain trainer's policy)."""
    _check_in_place(trainer)
    dcp.save(_state(_module(trainer), trainer.optimizer), checkpoint_id=path)


def load(trainer: Any, path: str) -> None:
    """Read the DCP folder `path` into `trainer`, resharded to its own layout (any world size)."""
    _check_in_place(trainer)
    module = _module(trainer)
    state = _state(module, trainer.optimizer)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(module, trainer.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def _module(trainer: Any) -> torch.nn.Module:
    """The module whose parameter names key the checkpoint: the causal LM, sharded or not."""
    model = getattr(trainer, "model", None)  # a `_Shard`'s causal LM; a plain trainer's is its policy
    return trainer.policy if model is None else model
