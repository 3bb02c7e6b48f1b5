"""One rank of an FSDP2 trainer (`core.train.sharded`): `_Shard`, the trainer over that rank's shard
(the same loss and step as `Trainer`, on DTensor parameters), `_join` of the default process group
and its device mesh, and `_rank_main`, the loop of a rank process (ranks 1..M-1) obeying rank 0's
commands. Rank 0 runs a `_Shard` in the run's process, driven by `ShardedTrainer`.

Deliberately not here: rank 0's side (the commands, the run's module, checkpoints' formats:
`core.train.sharded`), sharding itself (`core.train.meta`) and moving weights between the run's
module and the shards (`core.train.shard_weights`).
"""

from __future__ import annotations

import copy
import datetime
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from core import models
from core.config import ModelConfig, TrainerConfig
from core.engine.devices import local_device, nccl_env
from core.train import sharded_checkpoint
from core.train.meta import meta_model, shard, shard_frozen
from core.train.packing import pack
from core.train.sharded_checkpoint import _scatter, _sharded, full
from core.train.shard_weights import fill
from core.train.ranks import RANK_TIMEOUT_S, rank_seed, reduce_sums, serve, tcp_store
from core.train.timelines import Sample
from core.train.trainer import Trainer, seed_everything

class _Shard(Trainer):
    """One rank's trainer over its shard: the same loss and step as `Trainer`, on DTensor parameters."""

    def __init__(self, model: torch.nn.Module, cfg: TrainerConfig, name: str, mesh: DeviceMesh, device: str,
                 checkpointing: bool = False):
        """`model` on the meta device (`core.train.meta`): sharded, then only its shards (and the KL
        reference's, sharded the same way) allocated on `device`; their values come with
        `take_weights` / `take_reference`."""
        self.model = model  # the causal LM, sharded in place below
        frozen = copy.deepcopy(model) if cfg.kl_coef > 0 else None  # still on meta: a copy costs nothing
        self.scorer = shard(model, mesh, checkpointing)
        model.to_empty(device=device)
        self.frozen = shard_frozen(frozen, mesh) if frozen is not None else None
        if self.frozen is not None:
            self.frozen.to_empty(device=device)
        super().__init__(self.scorer, cfg, name, lora=False)

    def _make_reference(self, policy: torch.nn.Module) -> torch.nn.Module:
        assert self.frozen is not None  # made whenever kl_coef > 0
        return self.frozen.model  # its causal LM, whose parameters are DTensor shards

    def _reference_logprobs(self, mb: Any) -> torch.Tensor:
        """A collective, as the policy's pass: every rank scores the reference as often as the policy."""
        assert self.frozen is not None
        with torch.no_grad():
            return self.frozen(mb, mb.loss_mask)[0]

    def _logprobs(self, mb: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.scorer(mb, mb.loss_mask)

    def _clip(self, params: list[torch.nn.Parameter]) -> float:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], 2.0)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm  # every rank's shards in one norm
        torch.nn.utils.clip_grads_with_norm_(params, self.cfg.grad_clip, norm)
        return float(norm)

    def accumulate(self, share: list[Sample], normalizer: float, passes: int, pad: Sample | None) -> dict[str, float]:
        """This rank's share through `passes` forward/backward passes, the last ones zero-weighted on `pad`."""
        sums: dict[str, float] = defaultdict(float)
        if passes == 0:
            return sums
        device = next(self.scorer.parameters()).device
        batches = pack(share, self.cfg.micro_batch_tokens) if share else []
        self.scorer.train()
        for mb in batches:  # no early stop on a non-finite loss: the other ranks wait in each pass
            self._micro_batch(mb.to(device), normalizer, sums).backward()
        for _ in range(passes - len(batches)):
            assert pad is not None  # rank 0 sends one whenever a rank runs fewer micro-batches than passes
            padded = pack([pad], self.cfg.micro_batch_tokens)[0].to(device)
            logp, _ = self._logprobs(padded)
            if self.frozen is not None:  # the reference's gathers too, as in a real micro-batch's pass
                self._reference_logprobs(padded)
            (torch.where(torch.isfinite(logp), logp, 0.0).sum() * 0.0).backward()
        return sums

    def step_and_gather(self, loss: float, into: torch.nn.Module | None,
                        gather: bool = True) -> tuple[float, bool, bool]:
        """Clip and step the shard; when the weights changed and rank 0 keeps a whole module (`gather`),
        every rank gathers them and rank 0 (`into`) keeps them."""
        out = self._apply(loss)
        self.step_count += 1
        if out[2] and gather:
            self.gather_weights(into)
        return out

    @torch.no_grad()
    def gather_weights(self, into: torch.nn.Module | None) -> None:
        targets = list(into.parameters()) if into is not None else None
        for i, p in enumerate(self.model.parameters()):
            whole = p.full_tensor() if isinstance(p, DTensor) else p
            if targets is not None:
                targets[i].copy_(whole)

    @torch.no_grad()
    def take_reference(self, source: torch.nn.Module | None) -> None:
        """Every rank's shard of the KL reference from rank 0's full module (`source`; None on the other
        ranks): a collective."""
        if self.frozen is not None:
            fill(self.frozen.model, source)

    @torch.no_grad()
    def take_weights(self, source: torch.nn.Module | None) -> None:
        """Every rank's shard from rank 0's full module (`source`; None on the other ranks)."""
        fill(self.model, source)
        self.master.read_model()  # the fp32 copies start from the weights taken, not from the empty ones

    def full_state(self, keep: bool = True) -> dict[str, Any]:
        """The single-trainer checkpoint state, gathered on the CPU (every rank calls it; see `full`)."""
        return full(self.state_dict(), keep)

    def check_fits(self, state: dict[str, Any]) -> list[tuple[tuple[Any, Any], Any, torch.Tensor]]:
        """Raise ValueError unless `state` (or its skeleton) fits this trainer; no communication. Returns
        ((where, key), value, parameter) for each tensor a parameter's shard takes, in order."""
        self.check_state(state)
        params = self.master.params
        slots = []
        for index, values in state["optimizer"]["state"].items():
            if not 0 <= int(index) < len(params):
                raise ValueError(f"optimizer state for parameter {index}, but the policy has {len(params)}")
            slots += [((index, k), v, params[int(index)]) for k, v in values.items()]
        copies = [m for _, m in self.master.pairs]
        master = state.get("master") or []
        if len(master) == len(copies):  # otherwise master.check passed a state this policy ignores
            slots += [(("master", i), v, m) for i, (v, m) in enumerate(zip(master, copies))]
        for (where, key), value, like in slots:
            if _sharded(value, like) and tuple(value.shape) != tuple(like.shape):
                raise ValueError(f"{where}.{key}: saved shape {tuple(value.shape)} does not fit the parameter's "
                                 f"{tuple(like.shape)} (model changed?)")
        return slots

    def scatter_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """This rank's shard of a single-trainer state: rank 0 passes the state, the others its
        `skeleton`; every rank scatters in the same order (`_scatter`)."""
        per_param = {i: dict(values) for i, values in state["optimizer"]["state"].items()}
        master = list(state.get("master") or [])
        for (where, key), value, like in self.check_fits(state):
            if where == "master":
                master[key] = _scatter(value, like)
            else:
                per_param[where][key] = _scatter(value, like)
        return {**state, "optimizer": {**state["optimizer"], "state": per_param}, "master": master}


def _join(backend: str, port: int, rank: int, world: int, device: str) -> DeviceMesh:
    """Join the trainer's default process group and its 1-D device mesh."""
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
        nccl_env()  # rank 0 is the run process; the others got the same settings in their start environment
    dist.init_process_group(backend, store=tcp_store(port, rank, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=RANK_TIMEOUT_S))
    return init_device_mesh("cuda" if device.startswith("cuda") else "cpu", (world,))


def _rank_main(conn: Any, rank: int, mc_data: dict, trainer_data: dict, world: int, port: int, backend: str,
               devices: list[str]) -> None:
    """A rank process: join the group, build and shard the model, take rank 0's weights, obey rank 0."""
    mc, cfg = ModelConfig.model_validate(mc_data), TrainerConfig.model_validate(trainer_data)
    seed_everything(rank_seed(cfg.seed, rank))  # its own dropout masks, not rank 0's
    device = local_device(devices[rank])  # this process sees its GPU alone (`core.engine.devices`)
    mesh = _join(backend, port, rank, world, device)
    dtype = models.resolve_dtype(mc, torch.device(device))
    trainer = _Shard(meta_model(mc, dtype), cfg, mc.name, mesh, device, mc.trainer.activation_checkpointing)
    trainer.take_weights(None)
    trainer.take_reference(None)

    def backward(share: list[Sample], normalizer: float, passes: int, pad: Sample | None) -> None:
        reduce_sums(trainer.accumulate(share, normalizer, passes, pad), _device(trainer), _all_reduce)

    def load(shapes: dict[str, Any]) -> None:
        trainer.take_weights(None)
        trainer.load_state_dict(trainer.scatter_state(shapes))

    def state() -> None:
        trainer.full_state(keep=False)  # this rank's part of the gathers; rank 0 keeps the result

    def gradients() -> None:
        full([p.grad for p in trainer.model.parameters() if p.grad is not None], keep=False)

    try:
        serve(conn, rank, {"backward": backward,
                           "apply": lambda loss, gather: trainer.step_and_gather(loss, None, gather),
                           "discard": trainer.discard, "load": load, "state": state,
                           "gradients": gradients,
                           "gather": lambda: trainer.gather_weights(None),
                           "save_sharded": lambda path: sharded_checkpoint.save(trainer, path),
                           "load_sharded": lambda path: sharded_checkpoint.load(trainer, path)})
    finally:
        dist.destroy_process_group()


def _device(trainer: _Shard) -> torch.device:
    return next(trainer.scorer.parameters()).device


def _all_reduce(t: torch.Tensor, op: Any) -> None:
    dist.all_reduce(t, op=op)
