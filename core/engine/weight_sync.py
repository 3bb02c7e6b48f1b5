"""How the trainer's weights reach a replica process: a process group per replica, flat buckets.

The design: one 2-member group per replica (rank 0 the run process, which holds the trainer's
module; rank 1 the replica process), rather than one group over the trainer and every replica. A
replica that dies or hangs then fails only its own group's collective (at once when its socket
closes, at the latest after the group's timeout), it is killed and restarted with a fresh group,
and the other replicas' syncs never wait on it; one group over all would stall every member's
broadcast on one dead member and would have to be rebuilt by every member on every restart. The
price: the trainer sends the weights once per replica (N times its bytes out of its device, in
parallel), where one tree or ring broadcast would send them about once (docs/scaling.md has the
arithmetic).

Packing: the trainable parameters in their order, cut into buckets of one dtype of at most
`BUCKET_BYTES` each (a larger tensor is a bucket of its own); a bucket is flattened into one buffer
and broadcast, the replica receives it and copies each slice into its parameter (a one-tensor bucket
goes straight into the parameter where it can). At most one bucket's buffer exists on each side at
a time: never a second copy of a 7B model. Only the layout (names, shapes, dtypes) travels over the
replica's pipe, when it changes (at the first sync, in practice once); both sides cut the same
buckets from it, and the replica checks it against its own module, naming the parameter that does
not match.

Backend: NCCL when both ends are on distinct GPUs; gloo otherwise, through host memory (CPU, or a
replica sharing the trainer's GPU: NCCL refuses two ranks on one device).

The groups are groups of their own (`core.engine.groups`), not the process-wide default group.
Deliberately not here: when to sync and what a failure means
(`core.engine.process`, `core.engine.replicas`), and Ray's path (`core.ray.replicas`, the object store).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from core.engine.groups import process_group

# The most bytes flattened into one broadcast buffer: large enough that a 7B model goes in ~60
# collectives (each costs a round trip), small enough that the one extra buffer on either side is
# a rounding error next to the model.
BUCKET_BYTES = 256 * 2**20

# (parameter name, shape, dtype name as torch spells it without "torch.")
Layout = list[tuple[str, tuple[int, ...], str]]


class WeightLayoutError(ValueError):
    """The trainer's weights do not fit the replica's module (a name it lacks, another shape)."""


def backend_for(sender: str, receiver: str) -> str:
    """NCCL between two distinct GPUs, gloo otherwise (see the module doc)."""
    a, b = torch.device(sender), torch.device(receiver)
    if a.type == b.type == "cuda" and (a.index or 0) != (b.index or 0):
        return "nccl"
    return "gloo"


def buffer_device(backend: str, device: str) -> torch.device:
    """Where a side's bucket buffers live: its GPU under NCCL, host memory under gloo."""
    return torch.device(device) if backend == "nccl" else torch.device("cpu")


def weights_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a trainer step changes: the trainable parameters (every weight, or the LoRA adapters)."""
    return {n: p.detach() for n, p in module.named_parameters() if p.requires_grad}


def layout_of(weights: dict[str, torch.Tensor]) -> Layout:
    return [(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in weights.items()]


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise WeightLayoutError(f"{name!r} is not a torch dtype")
    return dtype


def buckets(layout: Layout, cap: int = BUCKET_BYTES) -> list[list[int]]:
    """The layout's entries (indexes, in order) cut into buckets of one dtype and at most `cap` bytes."""
    out: list[list[int]] = []
    size, dtype = 0, None
    for i, (_, shape, name) in enumerate(layout):
        nbytes = math.prod(shape) * _dtype(name).itemsize
        if not out or name != dtype or size + nbytes > cap:
            out.append([])
            size, dtype = 0, name
        out[-1].append(i)
        size += nbytes
    return out


def check_layout(module: torch.nn.Module, layout: Layout) -> list[torch.nn.Parameter]:
    """`module`'s parameters the layout names, in its order; raises WeightLayoutError naming the first
    entry that is malformed, not a parameter of `module`, or of another shape. (A dtype may differ: the
    copy casts, as a load would.)"""
    if not isinstance(layout, list):
        raise WeightLayoutError(f"a weights layout is a list of (name, shape, dtype), got {type(layout).__name__}")
    params = dict(module.named_parameters())
    out = []
    for entry in layout:
        if not (isinstance(entry, (tuple, list)) and len(entry) == 3 and isinstance(entry[0], str)
                and isinstance(entry[1], (tuple, list)) and all(isinstance(d, int) and d >= 0 for d in entry[1])):
            raise WeightLayoutError(f"malformed weights layout entry {entry!r}: want (name, shape, dtype)")
        name, shape, dtype = entry
        _dtype(dtype)
        p = params.get(name)
        if p is None:
            raise WeightLayoutError(f"parameter {name!r} of the trainer's weights is not a parameter of this "
                                    "replica's model")
        if tuple(p.shape) != tuple(shape):
            raise WeightLayoutError(f"parameter {name!r} has shape {list(shape)} in the trainer's weights but "
                                    f"{list(p.shape)} in this replica's model")
        out.append(p)
    return out


def send_weights(group: Any, weights: dict[str, torch.Tensor], layout: Layout, device: torch.device,
                 cap: int = BUCKET_BYTES) -> None:
    """Rank 0's half of a sync: every bucket of `weights` (laid out as `layout`) broadcast on `group`."""
    tensors = list(weights.values())
    for bucket in buckets(layout, cap):
        parts = [tensors[i].detach() for i in bucket]
        if len(parts) == 1 and parts[0].device == device and parts[0].is_contiguous():
            flat = parts[0].view(-1)  # the root only reads: no copy
        else:
            flat = torch.empty(sum(t.numel() for t in parts), dtype=parts[0].dtype, device=device)
            offset = 0
            for t in parts:
                flat[offset: offset + t.numel()].copy_(t.reshape(-1))
                offset += t.numel()
        _broadcast(group, flat)


def receive_weights(group: Any, params: list[torch.nn.Parameter], layout: Layout, device: torch.device,
                    cap: int = BUCKET_BYTES) -> None:
    """The replica's half: each bucket received and copied into `params` (from `check_layout`); `cap`
    must be the sender's."""
    with torch.no_grad():
        for bucket in buckets(layout, cap):
            dtype = _dtype(layout[bucket[0]][2])
            first = params[bucket[0]]
            if len(bucket) == 1 and first.dtype == dtype and first.device == device and first.is_contiguous():
                _broadcast(group, first.data.view(-1))  # straight into the parameter
                continue
            flat = torch.empty(sum(params[i].numel() for i in bucket), dtype=dtype, device=device)
            _broadcast(group, flat)
            offset = 0
            for i in bucket:
                p = params[i]
                p.copy_(flat[offset: offset + p.numel()].view(p.shape))
                offset += p.numel()


def sync_replica(engine: Any, load: Callable[[], None], version: int) -> int:
    """`load()` the weights between two decode steps and serve `version` from then on; returns it
    (`WorkerEngine.replace_weights`: a vLLM replica then streams them into vLLM's copy)."""
    return engine.replace_weights(load, version)

def apply_weights(module: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copy `weights` into `module`'s parameters of the same names (checked as `check_layout` checks)."""
    params = check_layout(module, layout_of(weights))
    with torch.no_grad():
        for p, t in zip(params, weights.values()):
            p.copy_(t)


def weights_digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """A sha256 over names and raw bytes: equal digests mean bitwise equal weights (a check, not a path)."""
    h = hashlib.sha256()
    for name, t in named:
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class WeightSender:
    """Rank 0's end of one replica's group: the backend, the group, the layout the replica accepted."""

    def __init__(self, source_device: str, replica_device: str):
        self.backend = backend_for(source_device, replica_device)
        self.buffers = buffer_device(self.backend, source_device)
        self.group: Any = None
        self.layout: Layout | None = None  # None until the replica accepts one, and after it refuses one

    def join(self, port: int, timeout_s: float) -> None:
        self.group = process_group(self.backend, port, 0, 2, timeout_s)

    def send(self, weights: dict[str, torch.Tensor]) -> None:
        if self.group is None or self.layout is None:
            raise RuntimeError("no weights group, or no layout the replica accepted")
        send_weights(self.group, weights, self.layout, self.buffers)

    def close(self) -> None:
        """Drop the group once its replica is gone. It is aborted: an NCCL group's watchdog would
        otherwise take the whole run process down when a transfer the dead replica left pending
        times out (gloo fails a pending transfer by itself once the peer's socket closes)."""
        group, self.group, self.layout = self.group, None, None
        if group is not None:
            group.abort()


class WeightReceiver:
    """The replica's end: its group, the layout it accepted and the parameters that layout names."""

    def __init__(self, module: torch.nn.Module, device: str):
        self.module, self.device = module, device
        self.group: Any = None
        self.buffers = torch.device("cpu")
        self.layout: Layout | None = None
        self.params: list[torch.nn.Parameter] = []

    def join(self, port: int, backend: str, timeout_s: float) -> str:
        if backend == "nccl":
            torch.cuda.set_device(torch.device(self.device))
        self.group = process_group(backend, port, 1, 2, timeout_s)
        self.buffers = buffer_device(backend, self.device)
        return "ok"

    def expect(self, layout: Layout) -> str:
        """Check `layout` against the module (raises naming the parameter) and take it for the next syncs."""
        self.layout = None  # a refused layout leaves none: no sync goes through on a stale one
        self.params = check_layout(self.module, layout)
        self.layout = [(n, tuple(shape), dtype) for n, shape, dtype in layout]
        return "ok"

    def receive(self) -> None:
        if self.group is None or self.layout is None:
            raise RuntimeError("no weights group, or no layout accepted")
        receive_weights(self.group, self.params, self.layout, self.buffers)

    def digest(self) -> str:
        """`weights_digest` of the parameters the layout names, as this replica holds them."""
        return weights_digest((n, p) for (n, _, _), p in zip(self.layout or [], self.params))


def _broadcast(group: Any, t: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([t], opts).wait()
