"""The model actor's end of its replica actors' weights groups: one `WeightSender` per replica actor.

A model with replicas under Ray keeps its trainer's module in its model actor (`core.ray.actors`),
and each of its replica actors (`core.ray.replicas`) is a `WeightReceiver`. Between the two, a
process group of two (rank 0 here), as a replica process has with its run process
(`core.engine.weight_sync`: the same buckets, buffers and deadline), so the weights go straight
from the trainer's memory to the replica's, over NCCL between two GPUs or gloo otherwise, and never
through Ray's object store. The group's store listens on this node's address (the replica actor
may be on another node); the driver passes that address and port to the replica actor.

An FSDP2 trainer's model actor keeps no whole module (`ShardedTrainer.drop_module`, at its first
step): each send then streams from the shards (`stream`: `ShardedTrainer.stream_weights`, each
weight made whole as its bucket fills, every rank joining), and the layout comes from the module's
names and shapes alone. The trainer's lock makes the replica actors' sends, which arrive in
parallel, stream one after another (never two interleaved gathers): a sync of R replicas costs R
gathers in series, each within its own deadline.

One group per replica actor, keyed by the key the driver gave it: a transfer that fails drops that
group alone (aborted, so no pending collective outlives its peer), and the driver replaces that
replica with a new actor and a new group; the others go on. Deliberately not here: when to sync and
what a failure means (the driver's `RayReplica` and the router), and the receiving end.
"""

from __future__ import annotations

import threading
import time

import ray
import torch

from core.engine.groups import free_port
from core.engine.replica_sync import Stream
from core.engine.replica_child import GROUP_FACTOR, SYNC_S
from core.engine.weight_sync import Layout, WeightSender, layout_of, weights_digest, weights_of


class WeightHost:
    """The weights groups of one model actor, keyed by replica actor (see the module doc)."""

    def __init__(self, model: torch.nn.Module, stream: Stream | None = None):
        """`stream`: where the weights come from instead of `model`'s tensors (see the module doc)."""
        self.model, self.stream = model, stream
        self.device = str(next(model.parameters()).device)
        self._senders: dict[str, WeightSender] = {}
        self._lock = threading.Lock()

    def address(self) -> tuple[str, int]:
        """This node's address as other nodes reach it, and a port free on it now."""
        return ray.util.get_node_ip_address(), free_port()

    def host(self, key: str, host: str, port: int, backend: str, replica_device: str) -> None:
        """Host `key`'s group on `host`:`port` as rank 0; returns once the replica joined (or raises)."""
        sender = WeightSender(self.device, replica_device, backend)
        sender.join(port, GROUP_FACTOR * SYNC_S, host)
        with self._lock:
            old, self._senders[key] = self._senders.get(key), sender
        if old is not None:
            old.close()

    def layout(self) -> Layout:
        return layout_of(weights_of(self.model))

    def send(self, key: str, layout: Layout, timeout_s: float) -> None:
        """The trainable weights over `key`'s group, by `timeout_s` from now. Any failure leaves the group
        out of step: it is dropped, and the replica must come back with a new one."""
        with self._lock:
            sender = self._senders.get(key)
        if sender is None:
            raise RuntimeError(f"no weights group for replica actor {key} (dropped, or this model actor restarted)")
        try:
            weights = weights_of(self.model)
            if layout_of(weights) != layout:
                raise RuntimeError("the trainable weights changed layout since the replica accepted it")
            sender.layout = layout
            deadline = time.monotonic() + timeout_s
            if self.stream is None:
                sender.send(weights, deadline)
            else:
                self.stream(lambda streamed: sender.send(streamed, deadline))
        except BaseException:
            self.drop(key)
            raise

    def drop(self, key: str) -> None:
        with self._lock:
            sender = self._senders.pop(key, None)
        if sender is not None:
            sender.close()

    def keys(self) -> list[str]:
        with self._lock:
            return sorted(self._senders)

    def digest(self) -> str:
        """`weights_digest` of the trainable weights as the trainer holds them (a check, not a path)."""
        if self.stream is None:
            return weights_digest(weights_of(self.model).items())
        out: list[str] = []
        self.stream(lambda streamed: out.append(weights_digest((n, t.full_tensor()) for n, t in streamed.items())))
        return out[0]

    def close(self) -> None:
        for key in self.keys():
            self.drop(key)
