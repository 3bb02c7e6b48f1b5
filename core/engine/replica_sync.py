"""How a `ReplicaEngine` (`core.engine.replicas`) sends the trainer's weights to its replicas at one
version: from a dict of the module's live tensors, the same dict to every replica in parallel; or,
for a trainer that keeps no whole module (an FSDP2 trainer's `stream_weights`), a stream per replica,
one replica after another.

Why one after another: a stream makes each weight whole with a collective over every trainer rank
(`DTensor.full_tensor`), which the ranks join in one fixed order, so two streams must never
interleave. A sync of R replicas then costs R gathers of the model and R transfers in series (not
in parallel), and holds, on rank 0, two buckets and one whole weight at a time: never the model.

Deliberately not here: when to sync, the version lock and restarts (`core.engine.replicas`), and the
transfer itself (`core.engine.weight_sync`, `core.engine.process`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

# A trainer's stream: calls its argument once with the weights (name -> shard or tensor), every rank
# joining the gathers (`ShardedTrainer.stream_weights`).
Stream = Callable[[Callable[[dict[str, Any]], None]], None]


def send_to(replica: Any, version: int, weights: Callable[[], Any], stream: Stream | None) -> int:
    """One replica's sync to `version` (a restarted one's catch-up too); returns the version it serves."""
    if stream is None:
        return replica.sync(weights(), version)
    served: list[int] = []
    stream(lambda streamed: served.append(replica.sync(streamed, version)))
    return served[0]


def sync_replicas(replicas: list[Any], version: int, weights: Callable[[], Any], stream: Stream | None) -> list[str]:
    """Every healthy replica synced to `version` (see the module doc); returns why each one that did not
    serve it is behind. A replica lost in its sync is not behind: it is restarted and caught up."""
    behind: list[str] = []
    whole = weights() if stream is None else None

    def push(i: int, r: Any) -> None:
        try:
            served = r.sync(whole, version) if stream is None else send_to(r, version, weights, stream)
            if served != version:
                behind.append(f"replica {i} serves {served}, not {version}")
        except Exception as e:  # noqa: BLE001 - whatever a replica raised (a Ray task error too) counts
            if r.healthy():  # alive and still not synced: behind. A lost one is restarted and synced.
                behind.append(f"replica {i}: {e}")
    live = [(i, r) for i, r in enumerate(replicas) if r is not None and r.healthy()]
    if stream is not None:
        for i, r in live:
            push(i, r)
        return behind
    threads = [threading.Thread(target=push, args=(i, r), daemon=True) for i, r in live]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return behind
