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
goes straight into the parameter where it can); a vLLM replica, whose module holds no weights, hands
each received bucket to vLLM's model instead (`receive_streamed`). Memory in flight: each side of a sync cuts its
buckets into two reusable buffers, used in turn; a buffer is reused only when the broadcast that
last used it has finished (`_Slots`: gloo's blocking `wait`, a CUDA event under NCCL, whose `wait`
does not block the CPU). So at most two buckets are in flight per replica, and a sync holds 2 x
`BUCKET_BYTES` of buffers on each side (512 MB; more only for one tensor larger than a bucket that
cannot go in place), freed when the sync ends: never a second copy of a 7B model. The same code
runs on gloo and NCCL. The sender stops at the sync's deadline (`TimeoutError`), which comes before
the group's own timeout (`core.engine.process`), so a hung replica is killed before NCCL's watchdog
would act. Only the layout (names, shapes, dtypes) travels over the
replica's pipe, when it changes (at the first sync, in practice once); both sides cut the same
buckets from it, and the replica checks it against its own module, naming the parameter that does
not match.

Backend: NCCL when both ends are on distinct GPUs; gloo otherwise, through host memory (CPU, or a
replica sharing the trainer's GPU: NCCL refuses two ranks on one device).
Ray replica actors (`core.ray.replicas`) use the same two ends, `WeightSender` in the model actor and
`WeightReceiver` in the replica actor, with the backend named by the caller (each actor sees its own
GPU as cuda:0) and the store at the model actor's node address.

The groups are groups of their own (`core.engine.groups`), not the process-wide default group.
Deliberately not here: when to sync and what a failure means
(`core.engine.process`, `core.engine.replicas`, `core.ray.replicas`).
"""

from __future__ import annotations

import datetime
import hashlib
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from core.engine.groups import process_group

# The most bytes flattened into one broadcast buffer: large enough that a 7B model goes in ~60
# collectives (each costs a round trip), small enough that the one extra buffer on either side is
# a rounding error next to the model.
BUCKET_BYTES = 256 * 2**20

# How often the sender looks whether an NCCL broadcast it waits on has finished: far below a bucket's
# transfer time over NVLink or PCIe (milliseconds), so polling adds little to a sync.
POLL_S = 0.001

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


class _Slots:
    """The two reusable bucket buffers of one side of one replica's group, used in turn (module doc).

    A slot is reused only once the broadcast that last used it has finished: on gloo its `Work` is
    waited on (the CPU blocks); on NCCL `Work.wait` only orders the current stream after NCCL's, so a
    CUDA event recorded after it is what the CPU waits for (polled, so a deadline can end the wait:
    NCCL's own watchdog fires only at the group's longer timeout). Without this, each bucket took a
    fresh buffer while the earlier broadcasts were still queued on the GPU: up to a whole model in
    flight per replica. With it, at most two buckets are in flight."""

    def __init__(self, device: torch.device, deadline: float | None):
        self.device, self.deadline = device, deadline
        self.raw: list[torch.Tensor | None] = [None, None]
        self.pending: list[Any] = [None, None]  # the CUDA event after each slot's last broadcast (NCCL only)
        self.turn = 0

    def take(self, numel: int, dtype: torch.dtype) -> tuple[int, torch.Tensor]:
        """The next slot, once free, as a flat `dtype` tensor of `numel` elements."""
        i, self.turn = self.turn, 1 - self.turn
        self.settle(i)
        nbytes = numel * dtype.itemsize
        raw = self.raw[i]
        if raw is None or raw.numel() < nbytes:  # the first use, or a tensor larger than a bucket
            raw = self.raw[i] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return i, raw[:nbytes].view(dtype)

    def started(self, i: int | None, work: Any) -> None:
        """`work` (a broadcast) now uses slot i (None: a tensor sent in place, waited for at once)."""
        if self.device.type != "cuda":  # gloo: the CPU waits for it here, no later than the deadline
            if self.deadline is None:
                work.wait()
            elif not _waited(work, self.deadline - time.monotonic()):
                raise TimeoutError("a weight broadcast did not finish by the sync's deadline")
            return
        work.wait()  # NCCL: the current stream now waits for the broadcast; the CPU does not
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))  # the buffer's GPU, whatever this thread's is
        if i is None:
            self._finish(event)
        else:
            self.pending[i] = event

    def settle(self, i: int) -> None:
        pending, self.pending[i] = self.pending[i], None
        if pending is not None:
            self._finish(pending)

    def drain(self) -> None:
        """Every broadcast finished: the weights may change again, and the transfer is over."""
        for i in (0, 1):
            self.settle(i)

    def _finish(self, event: Any) -> None:
        while not event.query():
            if self.deadline is not None and time.monotonic() > self.deadline:
                raise TimeoutError("a weight broadcast did not finish by the sync's deadline")
            time.sleep(POLL_S)


def _waited(work: Any, seconds: float) -> bool:
    """Whether gloo's `work` finished within `seconds` (its own error, a dead peer's, is raised)."""
    try:
        work.wait(datetime.timedelta(seconds=max(seconds, 0.0)))
    except RuntimeError as e:
        if "timed out" in str(e):
            return False
        raise
    return True


def send_weights(group: Any, weights: dict[str, torch.Tensor], layout: Layout, device: torch.device,
                 cap: int = BUCKET_BYTES, deadline: float | None = None) -> None:
    """Rank 0's half of a sync: every bucket of `weights` (laid out as `layout`) broadcast on `group`,
    through two reusable buffers (`_Slots`); raises TimeoutError past `deadline` (time.monotonic).

    A weight may be a shard (anything with `full_tensor`, a DTensor of an fsdp2 trainer): it is made
    whole when its turn in its bucket comes, copied in and dropped, one at a time and in the layout's
    order (so every rank joins the same gathers: `ShardedTrainer.stream_weights`). The sender then
    holds at most the two bucket buffers and one whole weight, never the whole model."""
    tensors = list(weights.values())
    slots = _Slots(device, deadline)
    with torch.no_grad():
        for bucket in buckets(layout, cap):
            if len(bucket) == 1:
                whole = _whole(tensors[bucket[0]])
                if whole.device == device and whole.is_contiguous():
                    slots.started(None, _broadcast(group, whole.view(-1)))  # the root only reads: no copy
                    del whole  # sent (`started` waits for an in-place broadcast): drop it before the next
                    continue
            numel = sum(math.prod(layout[j][1]) for j in bucket)
            i, flat = slots.take(numel, _dtype(layout[bucket[0]][2]))
            offset = 0
            for j in bucket:
                if len(bucket) > 1:
                    whole = None  # the weight before goes first: never two made whole at once
                    whole = _whole(tensors[j])
                flat[offset: offset + whole.numel()].copy_(whole.reshape(-1))
                offset += whole.numel()
            del whole  # the last weight made whole goes before the next bucket's first
            slots.started(i, _broadcast(group, flat))
        slots.drain()


def _whole(t: Any) -> torch.Tensor:
    """`t` as the replica receives it: a shard's `full_tensor()` (a collective), else `t` itself."""
    full = getattr(t, "full_tensor", None)
    return full() if full is not None else t.detach()


def receive_weights(group: Any, params: list[torch.nn.Parameter], layout: Layout, device: torch.device,
                    cap: int = BUCKET_BYTES) -> None:
    """The replica's half: each bucket received and copied into `params` (from `check_layout`); `cap`
    must be the sender's. A bucket's copies follow its broadcast on the same stream, so the slot's
    event (recorded after them) frees it for the bucket after next."""
    slots = _Slots(device, None)
    with torch.no_grad():
        for bucket in buckets(layout, cap):
            dtype = _dtype(layout[bucket[0]][2])
            first = params[bucket[0]]
            if len(bucket) == 1 and first.dtype == dtype and first.device == device and first.is_contiguous():
                slots.started(None, _broadcast(group, first.data.view(-1)))  # straight into the parameter
                continue
            i, flat = slots.take(sum(params[j].numel() for j in bucket), dtype)
            work = _broadcast(group, flat)
            work.wait()  # the copies below run after the broadcast (gloo: it is done; NCCL: stream order)
            offset = 0
            for j in bucket:
                p = params[j]
                p.copy_(flat[offset: offset + p.numel()].view(p.shape))
                offset += p.numel()
            slots.started(i, work)
        slots.drain()


def receive_streamed(group: Any, layout: Layout, device: torch.device, load: Callable[[list], None],
                     cap: int = BUCKET_BYTES) -> None:
    """The replica's half for an engine that takes the weights into its own model (a vLLM replica keeps
    no module copy): each bucket received into a fresh buffer and handed to `load` as (name, tensor)
    views. Fresh, not one of two reused slots: the engine may keep a view until a layer's last weight
    comes (vLLM's layerwise load), so only one bucket's buffer, plus what the engine still holds, is live."""
    with torch.no_grad():
        for bucket in buckets(layout, cap):
            sizes = [math.prod(layout[j][1]) for j in bucket]
            flat = torch.empty(sum(sizes), dtype=_dtype(layout[bucket[0]][2]), device=device)
            _broadcast(group, flat).wait()  # gloo: received; NCCL: the copies `load` makes follow it on the stream
            views = flat.split(sizes)
            load([(layout[j][0], v.view(layout[j][1])) for j, v in zip(bucket, views)])


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

    def __init__(self, source_device: str, replica_device: str, backend: str | None = None):
        """`backend`: None to choose from the two devices (`backend_for`), or named by the caller."""
        self.backend = backend or backend_for(source_device, replica_device)
        self.buffers = buffer_device(self.backend, source_device)
        self.group: Any = None
        self.layout: Layout | None = None  # None until the replica accepts one, and after it refuses one

    def join(self, port: int, timeout_s: float, host: str = "127.0.0.1") -> None:
        self.group = process_group(self.backend, port, 0, 2, timeout_s, host)

    def send(self, weights: dict[str, torch.Tensor], deadline: float | None = None) -> None:
        if self.group is None or self.layout is None:
            raise RuntimeError("no weights group, or no layout the replica accepted")
        send_weights(self.group, weights, self.layout, self.buffers, deadline=deadline)

    def close(self) -> None:
        """Drop the group once its replica is gone. It is aborted: an NCCL group's watchdog would
        otherwise take the whole run process down when a transfer the dead replica left pending
        times out (gloo fails a pending transfer by itself once the peer's socket closes)."""
        group, self.group, self.layout = self.group, None, None
        if group is not None:
            group.abort()


class WeightReceiver:
    """The replica's end: its group, the layout it accepted and the parameters that layout names.

    `load`: where the buckets go instead of the module's parameters (`receive_streamed`), for an engine
    that holds the weights itself and a module that holds none (on the meta device: it still names and
    shapes them, so the layout is checked against it). `torn`: a receive began and did not finish, so
    the weights are part old, part new; the replica must not serve them (it exits and is restarted)."""

    def __init__(self, module: torch.nn.Module, device: str, load: Callable[[list], None] | None = None):
        self.module, self.device, self.load = module, device, load
        self.torn = False
        self.cap = BUCKET_BYTES  # the sender's
        self.group: Any = None
        self.buffers = torch.device("cpu")
        self.layout: Layout | None = None
        self.params: list[torch.nn.Parameter] = []

    def join(self, port: int, backend: str, timeout_s: float, host: str = "127.0.0.1") -> str:
        if backend == "nccl":
            torch.cuda.set_device(torch.device(self.device))
        self.group = process_group(backend, port, 1, 2, timeout_s, host)
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
        if self.load is None and any(p.device.type == "meta" for p in self.params):
            raise RuntimeError("this replica's module holds no weights to receive into, and no engine takes them")
        self.torn = True
        if self.load is not None:
            receive_streamed(self.group, self.layout, self.buffers, self.load, self.cap)
        else:
            receive_weights(self.group, self.params, self.layout, self.buffers, self.cap)
        self.torn = False

    def digest(self) -> str:
        """`weights_digest` of the parameters the layout names, as this replica holds them."""
        if self.load is not None:
            raise RuntimeError("this replica's engine holds its weights in its own layout: no copy to digest")
        return weights_digest((n, p) for (n, _, _), p in zip(self.layout or [], self.params))


def _broadcast(group: Any, t: torch.Tensor) -> Any:
    """Start a broadcast from rank 0 of `t` on `group`; its `Work` (`_Slots.started` waits on it)."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return group.broadcast([t], opts)
