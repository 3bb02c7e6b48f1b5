"""How an FSDP2 rank's shards meet rank 0's full weights (`core.train.sharded`), without any rank
holding a second whole model: `fill` gives every rank its shards of rank 0's module (one scatter a
parameter: the policy at start and at a load, the KL reference at start); `Gathers` makes the
trained weights whole one at a time for a streamed replica sync (`ShardedTrainer.stream_weights`,
`core.engine.weight_sync.send_weights`), in the order every rank joins the gathers.

Deliberately not here: sharding (`core.train.meta`), the step, and the transfer to a replica itself.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor


@torch.no_grad()
def fill(module: torch.nn.Module, source: torch.nn.Module | None) -> None:
    """`module`'s shards and buffers from rank 0's full module of the same names (`source`; None on
    the other ranks): one scatter a parameter, one broadcast a buffer (unsharded, and unset by
    `to_empty`: rotary frequencies; non-persistent ones too, which a state dict leaves out)."""
    params = dict(source.named_parameters()) if source is not None else {}
    for name, p in module.named_parameters():
        if not isinstance(p, DTensor):
            continue
        whole = params[name].detach() if source is not None else torch.empty(p.shape, dtype=p.dtype, device=p.device)
        p.copy_(distribute_tensor(whole.to(p.device), p.device_mesh, p.placements, src_data_rank=0))
    buffers = dict(source.named_buffers()) if source is not None else {}
    for name, b in module.named_buffers():
        if source is not None:
            b.copy_(buffers[name])
        dist.broadcast(b, src=0)


class Gathers:
    """Rank 0's side of the gathers of one streamed sync (`ShardedTrainer.stream_weights`): each weight
    made whole once, in the order every rank walks the parameters (`_Shard.gather_weights`)."""

    def __init__(self, model: torch.nn.Module):
        named = list(model.named_parameters())
        self.params = [p for _, p in named]
        self.weights = {n: _Lazy(self, i, p) for i, (n, p) in enumerate(named)}
        self.done = 0

    def take(self, index: int) -> torch.Tensor:
        if index != self.done:  # the other ranks gather in parameter order: another would mismatch
            raise RuntimeError(f"weight {index} gathered out of order (the next is {self.done})")
        self.done += 1
        p = self.params[index]
        return p.full_tensor() if isinstance(p, DTensor) else p.detach()

    def finish(self) -> None:
        """Join the gathers the send did not reach (after a failure), dropping their results."""
        while self.done < len(self.params):
            self.take(self.done)


class _Lazy:
    """One weight of a streamed sync: its full shape and dtype for the layout, made whole on demand."""

    def __init__(self, gathers: Gathers, index: int, p: torch.Tensor):
        self.gathers, self.index, self.shape, self.dtype = gathers, index, p.shape, p.dtype

    def full_tensor(self) -> torch.Tensor:
        return self.gathers.take(self.index)
