"""Process groups of their own: a torch.distributed group over a TCP store on this machine.

Built here, not with `init_process_group`, so one process can hold several (a run process is rank 0
of its trainer's group and of one weights group per replica) and tests can start and drop them. It
lives in the engine layer because both the replicas' weight sync (`core.engine.weight_sync`) and
the trainer's ranks (`core.train`, a layer above) build their groups this way.

The store's host is loopback unless the caller names another: a Ray replica actor on another node
reaches its model actor's store at that node's address (`core.ray.replicas`). Deliberately not
here: what travels over a group (each user says), and finding that address.
"""

from __future__ import annotations

import datetime
import socket
from typing import Any

import torch.distributed as dist

from core.engine.devices import nccl_env


def free_port() -> int:
    """A TCP port free on this machine now (for a group's store)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tcp_store(port: int, rank: int, world: int, timeout_s: float, host: str = "127.0.0.1") -> dist.TCPStore:
    """The rendezvous of a group's `world` members (rank 0 hosts it on `host`:`port`)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    return dist.TCPStore(host, port, world, is_master=rank == 0, timeout=timeout)


def process_group(backend: str, port: int, rank: int, world: int, timeout_s: float, host: str = "127.0.0.1") -> Any:
    """A group of `world` over a TCP store on `host`:`port` (rank 0 hosts the store), gloo or NCCL; its
    collectives fail after `timeout_s` instead of waiting for ever on a dead member."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = tcp_store(port, rank, world, timeout_s, host)
    if backend == "nccl":
        nccl_env()  # the same NCCL settings as the peer, which got them in its start environment
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world, opts)
    return dist.ProcessGroupGloo(store, rank, world, timeout)
