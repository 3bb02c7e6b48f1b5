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
than one. Commands and samples travel to the ranks over a pipe each.

Deliberately not here: FSDP2 sharding (not built: docs/scaling.md says where it stands), a rank
on another machine (ranks are processes of this one; under Ray placement they live in the model's
actor the same way), and engines (rank 0's module is what engines read weights from).
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing
import os
import socket
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

from core import models
from core.config import ModelConfig, RunConfig, TrainerConfig, model_devices
from core.models import prepare_policy
from core.train.timelines import Sample
from core.train.trainer import PreparedStep, Trainer, seed_everything

log = logging.getLogger(__name__)

# How long a collective (and rank 0 waiting for a rank's answer) may take before it fails: far
# beyond a step of the models run here, short enough that a dead rank fails the run within minutes.
RANK_TIMEOUT_S = 600.0
# How long a rank process may take to start: importing torch and transformers and loading the
# model, on a loaded 2-core machine about 20 s for the tiny model.
RANK_START_S = 300.0
# The sums `Trainer._accumulate` returns that add over ranks; behaviour_diff_max is maxed instead.
SUMMED = ("loss", "kl", "clipped", "masked", "tokens", "entropy", "behaviour_diff")


class RankError(RuntimeError):
    """A trainer rank failed or died; the step it was in fails (its error is in the message)."""


def balance(samples: list[Sample], world: int) -> list[list[Sample]]:
    """Split samples over `world` ranks so each gets about the same number of tokens (longest first,
    each to the rank with the fewest tokens so far); every rank gets a list, perhaps empty."""
    shares: list[list[Sample]] = [[] for _ in range(world)]
    loads = [0] * world
    for s in sorted(samples, key=lambda s: len(s.input_ids), reverse=True):
        rank = loads.index(min(loads))
        shares[rank].append(s)
        loads[rank] += len(s.input_ids)
    return shares


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _group(backend: str, port: int, rank: int, world: int) -> Any:
    """A process group of its own over a TCP store on this machine (rank 0 hosts the store)."""
    timeout = datetime.timedelta(seconds=RANK_TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timeout)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, world)
    return dist.ProcessGroupGloo(store, rank, world, timeout)


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
        head = torch.tensor([float(p.grad is not None) for p in params] + [sums.get(k, 0.0) for k in SUMMED],
                            dtype=torch.float64, device=self.device)
        self._all_reduce(head, dist.ReduceOp.SUM)
        most = torch.tensor([sums.get("behaviour_diff_max", 0.0)], dtype=torch.float64, device=self.device)
        self._all_reduce(most, dist.ReduceOp.MAX)
        touched = [p for p, flag in zip(params, head[: len(params)].tolist()) if flag > 0]
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
        totals = head[len(params):].tolist()
        out: dict[str, float] = defaultdict(float, zip(SUMMED, totals))
        out["behaviour_diff_max"] = float(most.item())
        return out

    def broadcast_weights(self) -> None:
        """Every rank takes rank 0's parameters (all of them: a LoRA base too, once at start)."""
        with torch.no_grad():
            for p in self.trainer.policy.parameters():
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


def _rank_main(conn: Any, mc_data: dict, trainer_data: dict, rank: int, world: int, port: int, backend: str,
               device: str) -> None:
    """A rank process: build the model and trainer, join the group, then obey rank 0 until it hangs up."""
    mc, cfg = ModelConfig.model_validate(mc_data), TrainerConfig.model_validate(trainer_data)
    seed_everything(cfg.seed)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    trainer = Trainer(_build_policy(mc, device), cfg, mc.name, lora=mc.lora is not None)
    ranks = _Collectives(trainer, _group(backend, port, rank, world))
    ranks.broadcast_weights()
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # rank 0 is gone: nothing left to train for
        kind = msg[0]
        try:
            if kind == "backward":
                _, share, normalizer = msg
                trainer.policy.train()
                ranks.reduce(trainer._accumulate(share, normalizer))
                conn.send(("ok", None))
            elif kind == "apply":  # with rank 0's loss: a step with nothing to run had no backward here
                conn.send(("ok", trainer._apply(msg[1])))
                trainer.step_count += 1
            elif kind == "discard":
                trainer.discard()
                conn.send(("ok", None))
            elif kind == "load":
                trainer.load_state_dict(msg[1])  # weights first (below), then the optimizer over them
                conn.send(("ok", None))
            elif kind == "weights":
                ranks.broadcast_weights()
                conn.send(("ok", None))
            elif kind == "stop":
                conn.send(("ok", None))
                return
        except Exception as e:  # noqa: BLE001 - handed to rank 0, which fails the step with it
            conn.send(("error", f"rank {rank}: {type(e).__name__}: {e}"))


class DistributedTrainer(Trainer):
    """Rank 0 of a data-parallel trainer; starts and commands ranks 1..M-1 (see the module doc)."""

    def __init__(self, policy: torch.nn.Module, cfg: TrainerConfig, mc: ModelConfig, devices: list[str]):
        super().__init__(policy, cfg, mc.name, lora=mc.lora is not None)
        self.world = len(devices)
        if self.world < 2:
            raise ValueError(f"a data-parallel trainer needs world_size >= 2, got {self.world}")
        backend = "nccl" if devices[0].startswith("cuda") else "gloo"
        port = _free_port()
        ctx = multiprocessing.get_context("spawn")  # a fork of a process with torch threads may hang
        self._conns, self.procs = [], []
        for rank in range(1, self.world):
            here, there = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, name=f"swarm-rank-{mc.name}-{rank}", daemon=True,
                               args=(there, mc.model_dump(), cfg.model_dump(), rank, self.world, port, backend,
                                     devices[rank]))
            proc.start()
            there.close()
            self._conns.append(here)
            self.procs.append(proc)
        self.ranks = _Collectives(self, _group(backend, port, 0, self.world))
        self.ranks.broadcast_weights()  # rank 0's weights are the run's: a resumed module's included
        for rank, conn in enumerate(self._conns, start=1):
            self._answer(conn, rank, RANK_START_S)
        self._shares: list[list[Sample]] = []

    def backward(self, prepared: PreparedStep) -> None:
        """Each rank's token-balanced share through its model, then the gradients summed over ranks."""
        shares = balance(prepared.active, self.world) if prepared.normalizer > 0 else [[]] * self.world
        self._send_all([("backward", share, prepared.normalizer) for share in shares[1:]])
        was_training = self.policy.training
        self.policy.train()
        try:
            prepared.sums = self.ranks.reduce(self._accumulate(shares[0], prepared.normalizer))
        finally:
            self.policy.train(was_training)
        self._gather()

    def _apply(self, loss: float) -> tuple[float, bool, bool]:
        self._send_all([("apply", loss)] * (self.world - 1))
        out = super()._apply(loss)
        answers = self._gather()
        if any(a != out for a in answers):  # identical gradients must give identical steps
            raise RankError(f"ranks disagree on the step: rank 0 {out}, others {answers}")
        return out

    def discard(self) -> None:
        super().discard()
        self._command("discard")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Rank 0 loads (the checkpoint code already put the weights in its module); the other ranks
        take its weights and the same optimizer state, so the checkpoint's world size does not matter."""
        super().load_state_dict(state)
        self.sync_ranks(state)

    def sync_ranks(self, state: dict[str, Any] | None = None) -> None:
        self._send_all([("weights",)] * (self.world - 1))
        self.ranks.broadcast_weights()
        self._gather()
        if state is not None:
            self._command("load", state)

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(("stop",))
            except OSError:
                pass
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()

    # -- talking to the ranks -------------------------------------------------------------------
    def _command(self, *msg: Any) -> list[Any]:
        self._send_all([msg] * (self.world - 1))
        return self._gather()

    def _send_all(self, msgs: list[tuple]) -> None:
        for rank, (conn, msg) in enumerate(zip(self._conns, msgs), start=1):
            try:
                conn.send(msg)
            except OSError as e:
                raise RankError(f"trainer rank {rank} of {self.model_name!r} is gone: {e}") from e

    def _gather(self) -> list[Any]:
        return [self._answer(conn, rank, RANK_TIMEOUT_S) for rank, conn in enumerate(self._conns, start=1)]

    def _answer(self, conn: Any, rank: int, timeout: float) -> Any:
        proc = self.procs[rank - 1]
        waited = 0.0
        while not conn.poll(1.0):
            waited += 1.0
            if not proc.is_alive():
                raise RankError(f"trainer rank {rank} of {self.model_name!r} died (exit code {proc.exitcode})")
            if waited >= timeout:
                raise RankError(f"trainer rank {rank} of {self.model_name!r} did not answer in {timeout:g} s")
        try:
            kind, payload = conn.recv()
        except (EOFError, OSError) as e:
            raise RankError(f"trainer rank {rank} of {self.model_name!r} hung up: {e}") from e
        if kind == "error":
            raise RankError(payload)
        return payload


def build_trainer(policy: torch.nn.Module, cfg: RunConfig, name: str) -> Trainer:
    """The trainer `models[name]` asks for: one process, or `trainer.world_size` data-parallel ranks."""
    mc = next(m for m in cfg.models if m.name == name)
    if mc.trainer.world_size == 1:
        return Trainer(policy, cfg.trainer, name, lora=mc.lora is not None)
    ranks, _ = model_devices(mc, torch.cuda.device_count())
    return DistributedTrainer(policy, cfg.trainer, mc, ranks)
