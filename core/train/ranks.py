"""What both multi-rank trainers share: the rank processes rank 0 commands, and the step's split.

A multi-rank trainer (`core.train.distributed` replicates the weights, `core.train.sharded` shards
them with FSDP2) is rank 0 in the run's own process plus M-1 rank processes on this machine, each
started here with `spawn`, each obeying commands that arrive over a pipe of its own (`serve`) and
meeting the others in collectives on a gloo (CPU) or NCCL (GPU) group. Rank 0 waits for every
answer with a timeout and checks the process is alive, so a dead or stuck rank fails the step with
a `RankError` naming it instead of hanging the run.

Also here: `balance` (the token-balanced split of a step's samples), the telemetry sums a step adds
over ranks, and the ranks' TCP store (built by `core.engine.groups`, which the replicas' weights
groups use too, with the ranks' timeout). Deliberately not here: what a rank computes (each trainer
module says), or ranks on other machines.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import os
import pickle
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from core.engine import groups
from core.engine.devices import spawn_pinned
from core.train.timelines import Sample

# How long a collective (and rank 0 waiting for a rank's answer) may take before it fails: far
# beyond a step of the models run here, short enough that a dead rank fails the run within minutes.
RANK_TIMEOUT_S = 600.0
# How long a rank process may take to start: importing torch and transformers and loading the
# model, on a loaded 2-core machine about 20 s for the tiny model.
RANK_START_S = 300.0
# The sums `Trainer._accumulate` returns that add over ranks; behaviour_diff_max is maxed instead.
SUMMED = ("loss", "kl", "clipped", "masked", "tokens", "entropy", "behaviour_diff", "masked_out", "ratio",
          "mismatch_kl")  # the last three: core.train.mismatch


class RankError(RuntimeError):
    """A trainer rank failed or died; the step it was in fails (its error is in the message)."""


def rank_seed(seed: int, rank: int) -> int:
    """The seed rank `rank` draws from (rank 0, the run process, keeps the run's): each rank its own
    stream, so LoRA's dropout masks (and any other draw) differ between the ranks' shares instead of
    repeating rank 0's on every rank."""
    return seed + rank


def same_outcome(a: Any, b: Any) -> bool:
    """Whether two ranks' step outcomes agree field by field, a NaN matching a NaN: every rank skips a
    non-finite step alike (its grad norm is NaN on each), and `nan != nan` would call that a disagreement."""
    def fields(x: Any) -> tuple:
        return dataclasses.astuple(x) if dataclasses.is_dataclass(x) else tuple(x)

    def same(x: Any, y: Any) -> bool:
        if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
            return True
        return x == y

    fa, fb = fields(a), fields(b)
    return len(fa) == len(fb) and all(same(x, y) for x, y in zip(fa, fb))


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


def reduce_sums(sums: dict[str, float], device: torch.device,
                all_reduce: Callable[[torch.Tensor, Any], None]) -> dict[str, float]:
    """A step's telemetry sums over every rank (each rank calls it with its own): the sums added,
    behaviour_diff_max maxed. `all_reduce(tensor, op)` is the trainer's own group's collective."""
    totals = torch.tensor([sums.get(k, 0.0) for k in SUMMED], dtype=torch.float64, device=device)
    all_reduce(totals, dist.ReduceOp.SUM)
    most = torch.tensor([sums.get("behaviour_diff_max", 0.0)], dtype=torch.float64, device=device)
    all_reduce(most, dist.ReduceOp.MAX)
    out: dict[str, float] = defaultdict(float, zip(SUMMED, totals.tolist()))
    out["behaviour_diff_max"] = float(most.item())
    return out


free_port = groups.free_port  # one helper for every group's store port (the replicas' weights groups too)


def tcp_store(port: int, rank: int, world: int) -> dist.TCPStore:
    """The rendezvous of one trainer's ranks on this machine (rank 0 hosts it)."""
    return groups.tcp_store(port, rank, world, RANK_TIMEOUT_S)


def backend_of(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def serve(conn: Any, rank: int, handlers: dict[str, Callable[..., Any]]) -> None:
    """A rank's command loop: say it is ready, then run each command rank 0 sends and answer with its
    result or its error, until `stop` or until rank 0 hangs up."""
    send(conn, ("ready", os.getpid()))
    while True:
        try:
            msg = receive(conn)
        except (EOFError, OSError):
            return  # rank 0 is gone: nothing left to train for
        if msg[0] == "stop":
            send(conn, ("ok", None))
            return
        try:
            send(conn, ("ok", handlers[msg[0]](*msg[1:])))
        except Exception as e:  # noqa: BLE001 - handed to rank 0, which fails the step with it
            send(conn, ("error", f"rank {rank}: {type(e).__name__}: {e}"))


def send(conn: Any, msg: Any) -> None:
    """`msg` over a pipe BY VALUE. `conn.send` pickles with multiprocessing's ForkingPickler, for which
    torch registers reducers that move a tensor into shared memory and hand the other process the
    same storage: a checkpoint's AdamW step counters sent to a rank were then one tensor in two
    processes, each incremented by both ranks' steps, and the ranks' moments drifted apart."""
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def receive(conn: Any) -> Any:
    return pickle.loads(conn.recv_bytes())


class RankProcesses:
    """Ranks 1..M-1 of one trainer as processes of this machine, and rank 0's side of their pipes.

    `target(conn, rank, *args)` runs in each; it must end in `serve`."""

    def __init__(self, model_name: str, devices: list[str], target: Callable[..., None], args: tuple):
        """One process for each of `devices[1:]`, started seeing its device alone (`core.engine.devices`:
        inside, a GPU is cuda:0, `local_device`)."""
        self.model_name = model_name
        ctx = multiprocessing.get_context("spawn")  # a fork of a process with torch threads may hang
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        for rank in range(1, len(devices)):
            here, there = ctx.Pipe()
            proc = spawn_pinned(devices[rank], target, (there, rank, *args), f"swarm-rank-{model_name}-{rank}")
            there.close()
            self.conns.append(here)
            self.procs.append(proc)

    @contextmanager
    def blamed(self) -> Iterator[None]:
        """Rank 0's part of a collective: if it fails (a peer's socket closed), name a rank that died."""
        try:
            yield
        except Exception as e:
            for rank, proc in enumerate(self.procs, start=1):
                proc.join(timeout=1.0)  # a killed peer may take a moment to be reaped
                if not proc.is_alive():
                    raise RankError(f"trainer rank {rank} of {self.model_name!r} died (exit code {proc.exitcode}) "
                                    f"during a collective: {e}") from e
            raise

    def wait_ready(self) -> None:
        for rank, conn in enumerate(self.conns, start=1):
            self.answer(conn, rank, RANK_START_S)

    def command(self, *msg: Any) -> list[Any]:
        """The same command to every rank; their answers, in rank order."""
        self.send_all([msg] * len(self.conns))
        return self.gather()

    def send_all(self, msgs: list[tuple]) -> None:
        for rank, (conn, msg) in enumerate(zip(self.conns, msgs), start=1):
            try:
                send(conn, msg)
            except OSError as e:
                raise RankError(f"trainer rank {rank} of {self.model_name!r} is gone: {e}") from e

    def gather(self) -> list[Any]:
        return [self.answer(conn, rank, RANK_TIMEOUT_S) for rank, conn in enumerate(self.conns, start=1)]

    def answer(self, conn: Any, rank: int, timeout: float) -> Any:
        proc = self.procs[rank - 1]
        waited = 0.0
        while not conn.poll(1.0):
            waited += 1.0
            if not proc.is_alive():
                raise RankError(f"trainer rank {rank} of {self.model_name!r} died (exit code {proc.exitcode})")
            if waited >= timeout:
                raise RankError(f"trainer rank {rank} of {self.model_name!r} did not answer in {timeout:g} s")
        try:
            kind, payload = receive(conn)
        except (EOFError, OSError) as e:
            raise RankError(f"trainer rank {rank} of {self.model_name!r} hung up: {e}") from e
        if kind == "error":
            raise RankError(payload)
        return payload

    def close(self) -> None:
        for conn in self.conns:
            try:
                send(conn, ("stop",))
            except OSError:
                pass
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
