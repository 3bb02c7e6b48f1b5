"""A sharded data-parallel trainer: FSDP2 (`torch.distributed.fsdp.fully_shard`) over `trainer.world_size` ranks.

`models[].trainer.sharding: fsdp2` (or `auto` when one rank's full state would not fit its GPU,
`core.train.memory.sharding_of`). Each rank holds 1/M of the trained weights, their gradients and
AdamW's moments, as DTensors; FSDP2 all-gathers a layer's weights for its forward and backward and
reduce-scatters its gradients after. Rank 0 is the run's own process, as under
`core.train.distributed`; ranks 1..M-1 are processes of this machine (`core.train.ranks`).

`ShardedTrainer.policy` stays the run's full module (engines, replicas and checkpoints read it),
unless every reader streams from the shards (`drop_module`: a model served by replicas alone).
One rank's side (its `_Shard` trainer and process loop) is `core.train.shard_rank`.
Every rank, rank 0 too, builds its model on the meta device (`core.train.meta`), shards it, then
allocates its shards alone and takes their values from rank 0's module: no rank loads or copies the
whole model. After a step that changed the weights every rank joins one all-gather per parameter
(`DTensor.full_tensor`) and rank 0 copies the result into its full module (none after
`drop_module`). Every method that drives the ranks holds one lock (`_one_at_a_time`): a replica's
catch-up stream from another thread never interleaves its gathers with a step's collectives.
The KL reference is sharded the same way (`core.train.meta.shard_frozen`: frozen, no optimizer), filled from rank 0's
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

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from core.config import ModelConfig, TrainerConfig
from core.engine import Engine
from core.train import sharded_checkpoint
from core.train.meta import meta_model, to_meta
from core.train.packing import micro_batch_count
from core.train.rng import set_rng_state
from core.train.sharded_checkpoint import full, skeleton
from core.train.shard_rank import _Shard, _all_reduce, _device, _join, _rank_main
from core.train.shard_weights import Gathers, write_safetensors
from core.train.ranks import RankError, RankProcesses, backend_of, balance, free_port, reduce_sums, same_outcome
from core.train.trainer import PreparedStep, Trainer


def _one_at_a_time(method: Callable) -> Callable:
    """A method that drives the ranks: it holds the trainer's command lock, so that its collectives never
    interleave with another thread's (a restarted replica's catch-up stream, `stream_weights`)."""
    @functools.wraps(method)
    def run(self: ShardedTrainer, *args: Any, **kwargs: Any) -> Any:
        with self.commands:
            return method(self, *args, **kwargs)
    return run


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
        self.commands = threading.RLock()  # see `_one_at_a_time`
        self.keeps_module = True  # rank 0's full module refreshed after every step (`drop_module`)
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

    @_one_at_a_time
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

    @_one_at_a_time
    def gradients(self) -> dict[str, torch.Tensor]:
        """The summed gradients as one trainer would hold them, by parameter name (every rank joins the
        gather); between `backward` and `apply`, for checks."""
        self.workers.send_all([("gradients",)] * (self.world - 1))
        with self.workers.blamed():
            named = [(n, p.grad) for n, p in self.shard.model.named_parameters() if p.grad is not None]
            out = dict(zip([n for n, _ in named], full([g for _, g in named])))
        self.workers.gather()
        return out

    @_one_at_a_time
    def _apply(self, loss: float) -> tuple[float, bool, bool]:
        self.workers.send_all([("apply", loss, self.keeps_module)] * (self.world - 1))
        with self.workers.blamed():
            out = self.shard.step_and_gather(loss, self.policy, self.keeps_module)
        answers = self.workers.gather()
        if not all(same_outcome(a, out) for a in answers):  # one global norm and loss must give the same outcome
            raise RankError(f"ranks disagree on the step: rank 0 {out}, others {answers}")
        return out

    @_one_at_a_time
    def discard(self) -> None:
        self.shard.discard()
        self.workers.command("discard")

    @_one_at_a_time
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

    @_one_at_a_time
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
        if not self.keeps_module:  # its weights are in a module that holds none now (`drop_module`)
            raise RuntimeError("a single-trainer checkpoint loads before the trainer drops its module")
        self.shard.check_fits(state)
        self.workers.send_all([("load", skeleton(state))] * (self.world - 1))
        with self.workers.blamed():
            self.shard.take_weights(self.policy)
            local = self.shard.scatter_state(state)
        self.shard.load_state_dict(local)
        self.workers.gather()
        self.step_count = int(state["step"])

    @_one_at_a_time
    def save_sharded(self, path: str) -> None:
        """Every rank writes its shards to the DCP folder `path` (`core.train.sharded_checkpoint`)."""
        self._together("save_sharded", path)

    @_one_at_a_time
    def load_sharded(self, path: str) -> None:
        """Every rank reads its shards of a DCP checkpoint written at any world size, then rank 0's full
        module takes the loaded weights (the engines' copy), unless it keeps none (`drop_module`)."""
        self._together("load_sharded", path)
        if not self.keeps_module:
            return
        self.workers.send_all([("gather",)] * (self.world - 1))
        with self.workers.blamed():
            self.shard.gather_weights(self.policy)
        self.workers.gather()

    @_one_at_a_time
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

    def stream_to(self, engine: Engine) -> None:
        """When `engine` takes its syncs as streams from the shards (replicas alone), keep no module."""
        if self.keeps_module and engine.stream_syncs(self.stream_weights):
            self.drop_module()

    @_one_at_a_time
    def drop_module(self) -> None:
        """From now on rank 0 keeps no whole module: no rank gathers the weights after a step, and the
        run's module goes to the meta device (`to_meta`: names, shapes and ties stay, for a layout).
        For a model whose every reader streams from the shards: its replicas (`core.engine.replicas`,
        or a Ray model actor's `core.ray.weights`: one stream per replica per sync) and the
        checkpoint's weights file (`save_weights`); never with an engine that generates with the
        module itself. A single-trainer checkpoint then no longer loads (its weights would go through
        the module): a run resumes before it drops it."""
        self.keeps_module = False
        to_meta(self.policy)

    def save_weights(self, path: str) -> None:
        """The trained weights as a safetensors file at `path` (the checkpoint's model.safetensors, tied
        weights once), streamed from the shards one weight at a time, then its persistent buffers."""
        params = {n for n, _ in self.shard.model.named_parameters(remove_duplicate=False)}
        buffers = {n: b for n, b in self.shard.model.state_dict().items() if n not in params}
        self.stream_weights(lambda weights: write_safetensors(path, {**weights, **buffers}))

    @_one_at_a_time
    def _together(self, command: str, path: str) -> None:
        self.workers.send_all([(command, path)] * (self.world - 1))
        with self.workers.blamed():
            getattr(sharded_checkpoint, command.removesuffix("_sharded"))(self.shard, path)
        self.workers.gather()

    def close(self) -> None:
        self.workers.close()
        if dist.is_initialized():
            dist.destroy_process_group()
