"""A data-parallel trainer: one model's step spread over `models[].trainer.world_size` ranks.

`DistributedTrainer` is a `Trainer` (rank 0, in the run's own process, holding the module the loop
checkpoints and the engines sync from) plus M-1 rank processes, each with a full copy of the
weights and of the optimizer. A step goes:

1. rank 0 prepares as one trainer does: rewards, advantages, merged samples and the normaliser,
   the weighted token count of the WHOLE batch;
2. the samples that go through the model are split over the ranks, balanced by tokens
   (`balance`), and each rank accumulates the gradients of its share divided by that one global
   normaliser;
3. the gradients are summed over the ranks (one flat all-reduce per step), so every rank holds the
   gradient one rank would have computed on the whole batch (the sum of per-sample terms over one
   normaliser, not a mean of per-rank means), and the telemetry sums are summed likewise;
4. every rank clips and steps its optimizer on the same gradient: the weights stay identical, as
   under DDP, so rank 0 alone writes checkpoints, in the single-trainer format, and a run resumes
   at any world size (a new rank receives rank 0's weights and optimizer state when it starts or
   when a checkpoint is loaded).

Why not `torch.nn.parallel.DistributedDataParallel` itself: token-balanced shards hold different
numbers of micro-batches, and DDP all-reduces inside every backward that is not under `no_sync`,
so ranks would wait on each other's micro-batch counts; and DDP averages, while the loss here is
already normalised over the whole batch. The gradient all-reduce after the accumulation is what
DDP does, without its overlap of communication with backward.

Collectives run on a process group of their own (gloo on CPU, NCCL when the ranks are on GPUs),
built from a TCP store rather than the process-wide default group, so tests and runs can hold more
than one. Commands and samples travel to the ranks over a pipe each (`core.train.ranks`, which also
starts the rank processes and names a dead one).

`build_trainer` picks this trainer or the FSDP2 one (`core.train.sharded`) by
`models[].trainer.sharding`, and with `trainer.offload` keeps a replicated trainer's state in host
memory between steps on every rank (`core.train.offload`). Deliberately not here: sharding itself, a rank on another machine
(ranks are processes of this one; under Ray placement they live in the model's actor the same way),
and engines (rank 0's module is what engines read weights from).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from core import models
from core.config import ModelConfig, RunConfig, TrainerConfig
from core.engine.devices import local_device, model_devices
from core.engine.groups import process_group
from core.models import prepare_policy
from core.train.memory import sharding_of
from core.train.offload import HostOffload, around, install
from core.train.ranks import (RANK_TIMEOUT_S, RankError, RankProcesses, backend_of, balance, free_port, reduce_sums,
                              rank_seed, same_outcome, serve)
from core.train.sharded import ShardedTrainer
from core.train.timelines import Sample
from core.train.trainer import PreparedStep, Trainer, seed_everything

log = logging.getLogger(__name__)

__all__ = ["DistributedTrainer", "RankError", "balance", "build_trainer"]


class _Collectives:
    """What every rank does together: the gradient and sums all-reduce, rank 0's weights broadcast."""

    def __init__(self, trainer: Trainer, group: Any):
        self.trainer, self.group = trainer, group
        self.device = next(trainer.policy.parameters()).device

    def params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.trainer.policy.parameters() if p.requires_grad]

    def reduce(self, sums: dict[str, float]) -> dict[str, float]:
        """Sum every rank's gradients and telemetry sums; afterwards all ranks hold the same of both."""
        params = self.params()
        # Which parameters got a gradient on some rank: those only are summed (zeros where a rank had
        # none); one no rank touched keeps grad None, as on one rank, so AdamW leaves it be.
        flags = torch.tensor([float(p.grad is not None) for p in params], dtype=torch.float64, device=self.device)
        self._all_reduce(flags, dist.ReduceOp.SUM)
        touched = [p for p, flag in zip(params, flags.tolist()) if flag > 0]
        for p in touched:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if touched:
            flat = torch.cat([p.grad.reshape(-1) for p in touched])  # one all-reduce, not one per tensor
            self._all_reduce(flat, dist.ReduceOp.SUM)
            offset = 0
            for p in touched:
                n = p.grad.numel()
                p.grad.copy_(flat[offset: offset + n].view_as(p.grad))
                offset += n
        return reduce_sums(sums, self.device, self._all_reduce)

    def broadcast_weights(self) -> None:
        """Every rank takes rank 0's parameters (all of them: a LoRA base too, once at start)."""
        with torch.no_grad():
            for p in self.trainer.policy.parameters():
                self._broadcast(p.data)

    def broadcast_reference(self) -> None:
        """Every rank's frozen KL reference from rank 0's, once at start (as `core.train.sharded` does):
        each rank built its own from the model it loaded, which need not be the module rank 0 was
        handed (a resumed run's, or any other). LoRA's reference is the base with adapters off, whose
        weights `broadcast_weights` already sent."""
        if self.trainer.reference is not None:
            with torch.no_grad():
                for p in self.trainer.reference.parameters():
                    self._broadcast(p.data)

    def _all_reduce(self, t: torch.Tensor, op: Any) -> None:
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        self.group.allreduce([t], opts).wait()

    def _broadcast(self, t: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.group.broadcast([t], opts).wait()


def _build_policy(mc: ModelConfig, device: str) -> torch.nn.Module:
    model, _ = models.load(mc.model_copy(update={"device": device}))
    return prepare_policy(model, mc.lora) if mc.lora is not None else model


def _rank_main(conn: Any, rank: int, mc_data: dict, trainer_data: dict, world: int, port: int, backend: str,
               devices: list[str]) -> None:
    """A rank process: build the model and trainer, join the group, then obey rank 0 until it hangs up."""
    mc, cfg = ModelConfig.model_validate(mc_data), TrainerConfig.model_validate(trainer_data)
    seed_everything(rank_seed(cfg.seed, rank))  # its own dropout masks, not rank 0's
    device = local_device(devices[rank])  # this process sees its GPU alone (`core.engine.devices`)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    trainer = Trainer(_build_policy(mc, device), cfg, mc.name, lora=mc.lora is not None)
    ranks = _Collectives(trainer, process_group(backend, port, rank, world, RANK_TIMEOUT_S))
    ranks.broadcast_weights()
    ranks.broadcast_reference()

    def backward(share: list[Sample], normalizer: float) -> None:
        trainer.policy.train()
        ranks.reduce(trainer._accumulate(share, normalizer))

    def apply(loss: float) -> tuple[float, bool, bool]:  # rank 0's loss: a step with nothing to run had no backward here
        out = trainer._apply(loss)
        trainer.step_count += 1
        return out

    handlers = {"backward": backward, "apply": apply, "discard": trainer.discard,
                "load": trainer.load_state_dict,  # weights first ("weights"), then the optimizer over them
                "weights": ranks.broadcast_weights}
    if mc.trainer.offload and device.startswith("cuda"):  # this rank's GPU is shared with a replica too
        offload = HostOffload(trainer, device)
        handlers = {k: around(offload, h, then_host=k != "backward") for k, h in handlers.items()}
        offload.to_host()
    serve(conn, rank, handlers)


class DistributedTrainer(Trainer):
    """Rank 0 of a data-parallel trainer; starts and commands ranks 1..M-1 (see the module doc)."""

    def __init__(self, policy: torch.nn.Module, cfg: TrainerConfig, mc: ModelConfig, devices: list[str]):
        super().__init__(policy, cfg, mc.name, lora=mc.lora is not None)
        self.world = len(devices)
        if self.world < 2:
            raise ValueError(f"a data-parallel trainer needs world_size >= 2, got {self.world}")
        backend, port = backend_of(devices[0]), free_port()
        self.workers = RankProcesses(mc.name, devices, _rank_main,
                                     (mc.model_dump(), cfg.model_dump(), self.world, port, backend, devices))
        self.procs = self.workers.procs
        self.ranks = _Collectives(self, process_group(backend, port, 0, self.world, RANK_TIMEOUT_S))
        self.ranks.broadcast_weights()  # rank 0's weights are the run's: a resumed module's included
        self.ranks.broadcast_reference()
        self.workers.wait_ready()

    def backward(self, prepared: PreparedStep) -> None:
        """Each rank's token-balanced share through its model, then the gradients summed over ranks."""
        shares = balance(prepared.active, self.world) if prepared.normalizer > 0 else [[]] * self.world
        self.workers.send_all([("backward", share, prepared.normalizer) for share in shares[1:]])
        was_training = self.policy.training
        self.policy.train()
        try:
            prepared.sums = self.ranks.reduce(self._accumulate(shares[0], prepared.normalizer))
        finally:
            self.policy.train(was_training)
        self.workers.gather()

    def _apply(self, loss: float) -> tuple[float, bool, bool]:
        self.workers.send_all([("apply", loss)] * (self.world - 1))
        out = super()._apply(loss)
        answers = self.workers.gather()
        if not all(same_outcome(a, out) for a in answers):  # identical gradients must give identical steps
            raise RankError(f"ranks disagree on the step: rank 0 {out}, others {answers}")
        return out

    def discard(self) -> None:
        super().discard()
        self.workers.command("discard")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Rank 0 loads (the checkpoint code already put the weights in its module); the other ranks
        take its weights and the same optimizer state, so the checkpoint's world size does not matter."""
        super().load_state_dict(state)
        self.sync_ranks(state)

    def sync_ranks(self, state: dict[str, Any] | None = None) -> None:
        self.workers.send_all([("weights",)] * (self.world - 1))
        self.ranks.broadcast_weights()
        self.workers.gather()
        if state is not None:
            self.workers.command("load", state)

    def close(self) -> None:
        self.workers.close()


def build_trainer(policy: torch.nn.Module, cfg: RunConfig, name: str) -> Trainer:
    """The trainer `models[name]` asks for: one process, or `trainer.world_size` data-parallel ranks,
    replicated or FSDP2-sharded (`trainer.sharding`, auto decided by `core.train.memory.sharding_of`)."""
    mc = next(m for m in cfg.models if m.name == name)
    ranks, _ = model_devices(mc, torch.cuda.device_count())
    if mc.trainer.world_size == 1:
        trainer = Trainer(policy, cfg.trainer, name, lora=mc.lora is not None)
    elif sharding_of(cfg, mc, ranks) == "fsdp2":
        return ShardedTrainer(policy, cfg.trainer, mc, ranks)  # offload with fsdp2 is refused by the config
    else:
        trainer = DistributedTrainer(policy, cfg.trainer, mc, ranks)
    device = str(next(policy.parameters()).device)
    if mc.trainer.offload and device.startswith("cuda"):  # on CPU the state is in host memory already
        install(trainer, device)
    return trainer
