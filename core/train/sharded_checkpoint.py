"""An FSDP2 trainer's checkpoint state (`core.train.sharded`), in two forms.

The single-trainer format: every DTensor made whole on rank 0's host (`full`, a collective, one
tensor at a time) and, to load, rank 0's full tensors scattered to each rank's shard (`_scatter`),
the other ranks knowing them by `Shape` alone (`skeleton`). It resumes at any world size and under
either sharding, but gathers the optimizer state whole into rank 0's host memory: about 84 GB for a
7B model.

Sharded (`save` / `load`): torch.distributed.checkpoint (DCP), every rank writing and reading its
own shards of the weights, fp32 master copies (a bf16 trainer's) and AdamW's state, keyed by
parameter name ({"model", "master", "optim"} -> name), so no rank ever holds the whole; DCP reads
each shard into whatever layout the reader has, so a checkpoint written at one world size loads at
another, or into one unsharded trainer (no process group: it reads every shard itself). The run's
checkpoints of an fsdp2 trainer are this (`save_run` / `resolve`, called by `core.run.checkpoint`):
trainer.pt then holds only the step, RNG state and the DCP folder's name; an fsdp2 trainer reads
its shards at any world size, and a one-rank or replicated trainer the state whole (what it holds
anyway). The full weights are also in the checkpoint's model.safetensors, written from rank 0's
full module (`core.train.sharded`). Deliberately not here: when a run writes a checkpoint, and
optimizers other than AdamW (`_moments` allocates AdamW's state to read into).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, distribute_tensor

from core.train.rng import rng_state

# The key of a run checkpoint's trainer.pt naming its DCP folder (`save_run`), and that folder's name.
DCP = "sharded"
RUN_DIR = "sharded"
# AdamW's state of one parameter, as `_moments` allocates it.
MOMENTS = ("step", "exp_avg", "exp_avg_sq")


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


def save(trainer: Any, path: str) -> None:
    """Write `trainer`'s weights, fp32 master copies and AdamW state (this rank's shards of them) to the
    DCP folder `path`; every rank of a sharded trainer calls it together."""
    targets = _targets(trainer, None)
    with _quiet():
        dcp.save(targets, checkpoint_id=path, no_dist=_alone(targets))


def load(trainer: Any, path: str) -> None:
    """Read the DCP folder `path` into `trainer` in place, resharded to its own layout (any world size;
    no process group: this process reads every shard). Every rank of a sharded trainer calls it; it
    raises ValueError, before anything is read, when a saved tensor does not fit."""
    saved = _saved(path)
    targets = _targets(trainer, saved)
    with _quiet():
        dcp.load(targets, checkpoint_id=path, no_dist=_alone(targets))
    if trainer.master.pairs and not targets["master"]:  # saved without fp32 copies (an fp32 run's)
        trainer.master.read_model()


def save_run(trainer: Any, folder: Path) -> dict[str, Any]:
    """A run checkpoint's state of an fsdp2 trainer (`core.run.checkpoint` writes it as trainer.pt): the
    step and RNG, and the name of the DCP folder beside it that every rank just wrote its shards to."""
    trainer.save_sharded(str(folder / RUN_DIR))
    return {"step": trainer.step_count, "rng": rng_state(), DCP: RUN_DIR}


def resolve(state: dict[str, Any], folder: Path, trainer: Any) -> dict[str, Any]:
    """A run checkpoint's trainer.pt `state` as `trainer` loads it: unchanged in the single-trainer
    format; for a DCP one, an fsdp2 trainer gets the folder's path (each rank reads its own shards,
    `ShardedTrainer.load_state_dict`), and any other trainer (one rank, or replicated ranks) the
    single-trainer state read whole from the shards into this process's host memory, as it would
    hold it anyway. Raises ValueError when the DCP folder or a tensor in it does not fit."""
    if DCP not in state:
        return state
    if state[DCP] != RUN_DIR:  # only ever written so: anything else is tampering, not a path to follow
        raise ValueError(f"trainer state names the sharded folder {state[DCP]!r}, not {RUN_DIR!r}")
    path = str(folder / RUN_DIR)
    if hasattr(trainer, "load_sharded"):  # checked by its `check_state`
        return {**state, DCP: path}
    return {**_whole(trainer, path), "step": state["step"], "rng": state["rng"]}


def check(trainer: Any, path: str) -> None:
    """Raise ValueError unless every tensor the DCP folder `path` holds for `trainer` fits it."""
    _targets(trainer, _saved(path), allocate=False)


def _saved(path: str) -> dict[str, Any]:
    """The DCP folder's tensors, flattened key -> metadata (its `size` the full shape)."""
    try:
        return dict(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
    except OSError as e:
        raise ValueError(f"cannot read the sharded checkpoint {path}: {e}") from e


def _pairs(trainer: Any) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, model parameter, the tensor the optimizer steps for it): the same one, or its fp32 copy."""
    module = _module(trainer)
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    return [(n, p, m) for (n, p), m in zip(named, trainer.master.params)]


def _targets(trainer: Any, saved: dict[str, Any] | None, allocate: bool = True) -> dict[str, Any]:
    """What DCP writes (`saved` None: every tensor the trainer has) or reads (those of `saved` the
    trainer has, each checked against its saved shape first; AdamW's state allocated where a fresh
    optimizer has none yet): {"model": name -> weight, "master": name -> fp32 copy, "optim": name ->
    AdamW's state}, keyed by parameter name (DCP flattens them to model.<name>, optim.<name>.exp_avg)."""
    out: dict[str, Any] = {"model": {}, "master": {}, "optim": {}}
    for name, p, m in _pairs(trainer):
        entries = {"model": (p, f"model.{name}"), "master": (m, f"master.{name}")} if m is not p else {
            "model": (p, f"model.{name}")}
        for part, (t, key) in entries.items():
            if saved is None or _fits(saved, key, t):
                out[part][name] = t.detach()
        state = trainer.optimizer.state.get(m)
        if saved is None:
            if state:
                out["optim"][name] = state
            continue
        moments = {k: f"optim.{name}.{k}" for k in MOMENTS}
        if all(key in saved for key in moments.values()):
            for k, key in moments.items():
                _fits(saved, key, m if k != "step" else torch.zeros(()))
            if allocate:
                out["optim"][name] = _moments(trainer.optimizer, m)
    if saved is not None and len(out["model"]) != len(_pairs(trainer)):
        missing = [n for n, _, _ in _pairs(trainer) if n not in out["model"]]
        raise ValueError(f"the sharded checkpoint lacks the weights {missing[:5]} (model changed?)")
    return out


def _fits(saved: dict[str, Any], key: str, like: torch.Tensor) -> bool:
    """Whether `saved` holds `key`; raises ValueError when it does in another shape."""
    meta = saved.get(key)
    if meta is None:
        return False
    size = tuple(getattr(meta, "size", ()))
    if size != tuple(like.shape):
        raise ValueError(f"{key}: saved shape {size} does not fit the trainer's {tuple(like.shape)} (model changed?)")
    return True


def _moments(optimizer: torch.optim.Optimizer, m: torch.Tensor) -> dict[str, torch.Tensor]:
    """AdamW's state for `m`, allocated (zeros, as AdamW's first step makes it) where it has none yet:
    DCP reads into it in place."""
    state = optimizer.state[m]
    if not state:
        state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(m, memory_format=torch.preserve_format),
                     exp_avg_sq=torch.zeros_like(m, memory_format=torch.preserve_format))
    return state


def _whole(trainer: Any, path: str) -> dict[str, Any]:
    """The single-trainer state (`Trainer.state_dict`'s optimizer and master copies) of an unsharded
    `trainer`, read whole from the DCP folder into host tensors, without touching the trainer."""
    saved = _saved(path)
    _targets(trainer, saved, allocate=False)  # every saved shape checked before anything is read
    per_param: dict[int, dict[str, torch.Tensor]] = {}
    optim: dict[str, Any] = {}
    master: dict[str, torch.Tensor] = {}
    for index, (name, p, m) in enumerate(_pairs(trainer)):
        if f"optim.{name}.exp_avg" in saved:
            per_param[index] = {"step": torch.tensor(0.0), "exp_avg": _empty(m), "exp_avg_sq": _empty(m)}
            optim[name] = per_param[index]
        if m is not p and f"master.{name}" in saved:
            master[name] = _empty(m)
    with _quiet():
        dcp.load({"optim": optim, "master": master}, checkpoint_id=path, no_dist=True)
    groups = trainer.optimizer.state_dict()["param_groups"]
    copies = [master[n] for n, p, m in _pairs(trainer) if m is not p and n in master]
    return {"optimizer": {"state": per_param, "param_groups": groups},
            "master": copies if len(copies) == len(trainer.master.pairs) else []}


def _alone(targets: dict[str, Any]) -> bool:
    """Whether this process reads or writes the checkpoint by itself (an unsharded trainer: no group)."""
    return not any(isinstance(t, DTensor) for t in targets["model"].values())


@contextmanager
def _quiet() -> Iterator[None]:
    """Without DCP's warning that it reads or writes in one process: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _empty(like: torch.Tensor) -> torch.Tensor:
    return torch.empty(like.shape, dtype=like.dtype)


def _module(trainer: Any) -> torch.nn.Module:
    """The module whose parameter names key the checkpoint: the causal LM, sharded or not."""
    model = getattr(trainer, "model", None)  # a `_Shard`'s causal LM; a plain trainer's is its policy
    return trainer.policy if model is None else model
