"""How an FSDP2 rank's shards meet rank 0's full weights (`core.train.sharded`), without any rank
holding a second whole model: `fill` gives every rank its shards of rank 0's module (one scatter a
parameter: the policy at start and at a load, the KL reference at start); `Gathers` makes the
trained weights whole one at a time for a streamed replica sync (`ShardedTrainer.stream_weights`,
`core.engine.weight_sync.send_weights`), in the order every rank joins the gathers;
`write_safetensors` writes such a stream to a file (the checkpoint's weights of a trainer that keeps
no whole module, `ShardedTrainer.save_weights`), one weight in memory at a time.

Deliberately not here: sharding (`core.train.meta`), the step, and the transfer to a replica itself.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

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


# safetensors' names of torch's dtypes (its format: an 8-byte header length, a JSON header, the raw bytes).
_SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL"}


def write_safetensors(path: str, weights: dict[str, Any]) -> None:
    """`weights` (tensors, or shards that `full_tensor()` makes whole, in the order they must be made
    whole) as a safetensors file: the header from their shapes alone, then each one's bytes, made whole
    and dropped in turn. What `safetensors.torch.load_file` reads back."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in weights.items():
        nbytes = math.prod(t.shape) * t.dtype.itemsize
        header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for t in weights.values():
            whole = t.full_tensor() if hasattr(t, "full_tensor") else t
            f.write(whole.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            del whole
