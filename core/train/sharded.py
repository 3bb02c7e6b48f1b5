"""A sharded data-parallel trainer: FSDP2 (`torch.distributed.fsdp.fully_shard`) over `trainer.world_size` ranks.

`models[].trainer.sharding: fsdp2` (or `auto` when one rank's full state would not fit its GPU,
`core.train.memory.sharding_of`). Each rank holds 1/M of the trained weights, their gradients and
AdamW's moments, as DTensors; FSDP2 all-gathers a layer's weights for its forward and backward and
reduce-scatters its gradients after. Rank 0 is the run's own process, as under
`core.train.distributed`; ranks 1..M-1 are processes of this machine (`core.train.ranks`).

`ShardedTrainer.policy` stays the run's full module (engines, replicas and checkpoints read it).
Every rank, rank 0 too, builds its model on the meta device (`core.train.meta`), shards it, then
allocates its shards alone and takes their values from rank 0's module: no rank loads or copies the
whole model. After a step that changed the weights every rank joins one all-gather per parameter
(`DTensor.full_tensor`) and rank 0 copies the result into its full module. The KL reference is
sharded the same way (`core.train.meta.shard_frozen`: frozen, no optimizer), filled from rank 0's
module at start, so no rank holds a whole reference; its forward is a collective too, so a pad pass
(below) scores it as a real micro-batch does.

A step (rank 0 prepares as one trainer does; the normaliser is the WHOLE batch's):

1. the samples that run are split over the ranks, balanced by tokens (`balance`). FSDP2
   communicates inside every forward and backward, so every rank must run the same number of
   passes: a rank with fewer micro-batches runs extra passes on a sample whose loss is multiplied by
   zero (gradient 0, nothing added to the sums), and no rank stops early on a non-finite loss;
2. the gradient reduction SUMS over the ranks: FSDP2 averages by default, so every FSDP module gets
   `set_gradient_divide_factor(1.0)` and `set_force_sum_reduction_for_comms(True)` (in torch 2.13,
   `_fsdp_collectives._get_gradient_divide_factors` then reduces with plain SUM and divides by 1,
   which gloo supports). Each rank's share is already divided by the global normaliser, so the sum
   is the gradient one rank would compute on the whole batch;
3. clipping uses the global norm of the sharded gradient (`get_total_norm`, made whole with
   `full_tensor`), then every rank steps AdamW on its shard.

Checkpoints: a run's are DCP shards, each rank writing and reading its own (`save_sharded` /
`load_sharded`, `core.train.sharded_checkpoint`), resumable at any world size and by one or
replicated ranks. `state_dict` / `load_state_dict` also speak the single-trainer format, gathered
tensor by tensor into rank 0's host memory and scattered back (so a one-rank checkpoint resumes
here). `stream_weights` hands a replica sync the shards, made whole one at a time as its buckets
fill (`core.train.shard_weights`), rather than rank 0's full module.

Units: one FSDP unit per decoder layer (`model.get_decoder().layers`) and a root unit holding the
rest (embeddings, final norm, the tied head). The root is a small wrapper whose forward is the
trainer's scoring pass, because FSDP2 hooks a module's `forward` and `token_logprobs` calls the
decoder and the head, not the causal LM's forward.

The group is torch.distributed's default process group (gloo on CPU, NCCL on GPU), which FSDP2's
device mesh is built on: so one process holds at most one fsdp2 trainer, and not beside anything
else that takes the default group (an in-process vLLM engine). Deliberately not here: LoRA (its
trainable state is its small adapters: replicate), CPU offload, a compute dtype other than the
model's (the shards are in the model's dtype and bf16 trains on fp32 master copies of the shards as
one trainer does; the only mixed-precision policy is the fp32 gradient reduction,
`REDUCE_IN_FP32`), and ranks on other machines. Activation checkpointing per decoder layer is
`models[].trainer.activation_checkpointing`.
"""

from __future__ import annotations

import copy
import datetime
from collections import defaultdict
from collections.abc import Callable
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
from core.train.packing import micro_batch_count, pack
from core.train.rng import set_rng_state
from core.train.sharded_checkpoint import _scatter, _sharded, full, skeleton
from core.train.shard_weights import Gathers, fill
from core.train.ranks import (RANK_TIMEOUT_S, RankError, RankProcesses, backend_of, balance, free_port, reduce_sums,
                              rank_seed, same_outcome, serve, tcp_store)
from core.train.timelines import Sample
from core.train.trainer import PreparedStep, Trainer, seed_everything


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

    def step_and_gather(self, loss: float, into: torch.nn.Module | None) -> tuple[float, bool, bool]:
        """Clip and step the shard; when the weights changed, every rank gathers them and rank 0 (`into`) keeps them."""
        out = self._apply(loss)
        self.step_count += 1
        if out[2]:
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
        serve(conn, rank, {"backward": backward, "apply": lambda loss: trainer.step_and_gather(loss, None),
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


class ShardedTrainer(Trainer):
    """Rank 0 of an FSDP2 trainer: the run's full module for engines and checkpoints, a shard to train
    (see the module doc). It does not call `Trainer.__init__`, which would build an optimizer (and
    fp32 master copies, and a KL reference) over the full module; it takes those of its shard."""

    def __init__(self, policy: torch.nn.Module, cfg: TrainerConfig, mc: ModelConfig, devices: list[str]):
        self.world = len(devices)
        if self.world < 2:
            raise ValueError(f"fsdp2 sharding needs world_size >= 2, got {self.world}")
        if mc.lora is not None:
            raise ValueError(f"model {mc.name!r}: fsdp2 shards a full fine-tune; a LoRA run trains small adapters "
                             "(trainer.sharding: replicate)")
        if dist.is_initialized():
            raise RuntimeError("this process already holds torch.distributed's default process group (another fsdp2 "
                               "trainer or an in-process vLLM engine); fsdp2 needs it: one fsdp2 model a process")
        backend, port = backend_of(devices[0]), free_port()
        self.workers = RankProcesses(mc.name, devices, _rank_main,
                                     (mc.model_dump(), cfg.model_dump(), self.world, port, backend, devices))
        self.procs = self.workers.procs
        try:
            mesh = _join(backend, port, 0, self.world, devices[0])
            dtype = next(policy.parameters()).dtype
            self.shard = _Shard(meta_model(mc, dtype), cfg, mc.name, mesh, devices[0],
                                mc.trainer.activation_checkpointing)
            self.shard.take_weights(policy)  # rank 0's weights are the run's: a resumed module's included
            self.shard.take_reference(policy)
            self.workers.wait_ready()
        except BaseException:
            self.close()
            raise
        # What the loop, checkpoints and metrics read of a Trainer: the full module, and the shard's optimizer.
        self.policy, self.cfg, self.model_name, self.lora, self.step_count = policy, cfg, mc.name, False, 0
        self.master, self.optimizer, self.reference = self.shard.master, self.shard.optimizer, self.shard.reference

    def backward(self, prepared: PreparedStep) -> None:
        """Each rank's token-balanced share, in as many passes as the longest share needs (module doc)."""
        runs = prepared.normalizer > 0 and bool(prepared.active)
        shares = balance(prepared.active, self.world) if runs else [[] for _ in range(self.world)]
        budget = self.cfg.micro_batch_tokens
        passes = max(micro_batch_count(s, budget) for s in shares)
        pad = min(prepared.active, key=lambda s: len(s.input_ids)) if runs else None
        self.workers.send_all([("backward", share, prepared.normalizer, passes, pad) for share in shares[1:]])
        with self.workers.blamed():
            prepared.sums = reduce_sums(self.shard.accumulate(shares[0], prepared.normalizer, passes, pad),
                                        _device(self.shard), _all_reduce)
        self.workers.gather()

    def gradients(self) -> dict[str, torch.Tensor]:
        """The summed gradients as one trainer would hold them, by parameter name (every rank joins the
        gather); between `backward` and `apply`, for checks."""
        self.workers.send_all([("gradients",)] * (self.world - 1))
        with self.workers.blamed():
            named = [(n, p.grad) for n, p in self.shard.model.named_parameters() if p.grad is not None]
            out = dict(zip([n for n, _ in named], full([g for _, g in named])))
        self.workers.gather()
        return out

    def _apply(self, loss: float) -> tuple[float, bool, bool]:
        self.workers.send_all([("apply", loss)] * (self.world - 1))
        with self.workers.blamed():
            out = self.shard.step_and_gather(loss, self.policy)
        answers = self.workers.gather()
        if not all(same_outcome(a, out) for a in answers):  # one global norm and loss must give the same outcome
            raise RankError(f"ranks disagree on the step: rank 0 {out}, others {answers}")
        return out

    def discard(self) -> None:
        self.shard.discard()
        self.workers.command("discard")

    def state_dict(self) -> dict[str, Any]:
        self.workers.send_all([("state",)] * (self.world - 1))
        with self.workers.blamed():
            state = self.shard.full_state()
        self.workers.gather()
        return {**state, "step": self.step_count}

    def check_state(self, state: dict[str, Any]) -> None:
        """Raise ValueError before anything is changed unless `state` fits: the single-trainer format,
        or a run's DCP checkpoint (`sharded_checkpoint.resolve`), whose saved shapes are checked."""
        if sharded_checkpoint.DCP in state:
            sharded_checkpoint.check(self.shard, state[sharded_checkpoint.DCP])
        else:
            self.shard.check_fits(state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The checkpoint code put the weights in the full module; every rank takes its shard of them and
        of the optimizer state (scattered from rank 0: the pipes carry the shapes alone), so the
        checkpoint's world size and sharding do not matter. A run's DCP checkpoint instead: every rank
        reads its own shards of it (`load_sharded`), whatever world size wrote it."""
        if sharded_checkpoint.DCP in state:
            self.check_state(state)
            self.load_sharded(state[sharded_checkpoint.DCP])
            self.step_count = int(state["step"])
            set_rng_state(state["rng"])
            return
        self.shard.check_fits(state)
        self.workers.send_all([("load", skeleton(state))] * (self.world - 1))
        with self.workers.blamed():
            self.shard.take_weights(self.policy)
            local = self.shard.scatter_state(state)
        self.shard.load_state_dict(local)
        self.workers.gather()
        self.step_count = int(state["step"])

    def save_sharded(self, path: str) -> None:
        """Every rank writes its shards to the DCP folder `path` (`core.train.sharded_checkpoint`)."""
        self._together("save_sharded", path)

    def load_sharded(self, path: str) -> None:
        """Every rank reads its shards of a DCP checkpoint written at any world size, then rank 0's full
        module takes the loaded weights (the engines' copy)."""
        self._together("load_sharded", path)
        self.workers.send_all([("gather",)] * (self.world - 1))
        with self.workers.blamed():
            self.shard.gather_weights(self.policy)
        self.workers.gather()

    def stream_weights(self, send: Callable[[dict[str, Any]], None]) -> None:
        """`send` (a replica's `WeightSender.send`, `core.engine.weight_sync`) given the trained weights as
        shards, name -> one that `full_tensor()` makes whole, which the send does one at a time as it
        fills its buckets, every other rank joining each gather in the same order: so rank 0 never
        gathers the whole model at once. If `send` fails part way, rank 0 still joins the gathers it
        left (the other ranks wait in them) before the error goes on."""
        gathers = Gathers(self.shard.model)
        self.workers.send_all([("gather",)] * (self.world - 1))
        with self.workers.blamed():
            try:
                send(gathers.weights)
            finally:
                gathers.finish()
                self.workers.gather()

    def _together(self, command: str, path: str) -> None:
        self.workers.send_all([(command, path)] * (self.world - 1))
        with self.workers.blamed():
            getattr(sharded_checkpoint, command.removesuffix("_sharded"))(self.shard, path)
        self.workers.gather()

    def close(self) -> None:
        self.workers.close()
        if dist.is_initialized():
            dist.destroy_process_group()
