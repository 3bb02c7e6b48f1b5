"""Chaos: a `tiny` run whose isolated clients are SIGKILLed at random, mid-episode, until the run is done.

    python bench/chaos.py                       # 20 steps, a kill every ~3 s
    python bench/chaos.py --steps 6 --kill-every 2 --lease 3

A `CoreRun` (server and trainer in this process) trains the `tiny` model from three isolated client
processes over two sandboxes (`letters` twice, `arith` once). A chaos thread picks a random client
that has an episode open, SIGKILLs it, waits for the run's supervisor (`core.run.supervisor`) to start
it again and for `--between` episodes to finish (so a slow machine still moves), then waits ~`--kill-every`
seconds for the next kill. The run must:

- complete all its steps;
- never train a partial episode: every trained episode was finished by its client (the bench
  records each batch the trainer takes, and follows the episodes that were open at each kill);
- keep its books balanced at every kill and at the end (`core.episodes.books.unbalanced`):
  opened = finished + aborted + expired + open, finished = trained + stale-dropped + buffered.

`--min-kills K` keeps the run training past `--steps` until K kills have landed (at most
`EXTRA_STEPS_CAP` more steps): on a loaded machine a killed client's restart can outlast the few steps a
test asks for, and a test of kills must see the kills it counts on, not a race between the two.

It prints the counts and, last, `chaos: steps=<n> kills=<k> partial_trained=<p> balance=ok|FAIL`,
computed from what happened; the exit code is 0 only when all three hold.
"""

from __future__ import annotations

import argparse
import atexit
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
for key, value in (("HF_HUB_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false"), ("OMP_NUM_THREADS", "1")):
    os.environ.setdefault(key, value)

import httpx  # noqa: E402

from core.config_io import load_config  # noqa: E402
from core.episodes.errors import Refusal  # noqa: E402
from core.episodes.books import unbalanced
from core.run.loop import CoreRun  # noqa: E402
from core.run.signals import on_signals  # noqa: E402

CLIENTS = ["sandbox:letters", "sandbox:letters", "sandbox:arith"]  # three processes over two sandboxes
EXTRA_STEPS_CAP = 50  # --min-kills: how far past --steps the run may go waiting for its kills, then it fails
RESTART_WAIT_S = 60.0  # a killed client is back well within this (start-up is seconds), else the bench says so
SNAPSHOT_RETRY_S = 0.2  # how often the chaos thread looks for a client with an open episode


def books(url: str) -> tuple[dict, list[str]]:
    """One `/swarm/v1/status` snapshot and the identities it breaks (empty: balanced)."""
    status = httpx.get(url + "/swarm/v1/status", timeout=10).json()
    return status, unbalanced(status["episodes"], status["open_episodes"], status["buffer"]["episodes"])


def final_state(run: CoreRun, episode_id: str) -> str:
    try:
        run.server.registry.get_open(episode_id)
        return "open"
    except Refusal as e:
        return e.code.removeprefix("episode_")


class Chaos:
    """Kills a random client that has an episode open, every ~`every` seconds, until stopped."""

    def __init__(self, run: CoreRun, every: float, between: int, seed: int):
        self.run, self.every, self.between, self.rng = run, every, between, random.Random(seed)
        self.kills = 0
        self.killed_open: list[str] = []  # episodes open in a client when it was killed
        self.unbalanced: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="chaos", daemon=True)

    def _loop(self) -> None:
        while not self.stop.wait(self.rng.uniform(0.5, 1.5) * self.every):
            pid, open_ids = self._victim()
            if pid is None:
                continue
            restarts = self.run.supervisor.restarts
            os.kill(pid, signal.SIGKILL)
            self.kills += 1
            self.killed_open += open_ids
            self.unbalanced += books(self.run.server.url)[1]
            deadline = time.monotonic() + RESTART_WAIT_S
            while self.run.supervisor.restarts == restarts and not self.stop.wait(SNAPSHOT_RETRY_S):
                if time.monotonic() > deadline:
                    print(f"chaos: client pid {pid} was not restarted within {RESTART_WAIT_S:.0f}s", flush=True)
                    break
            # Progress between kills, whatever the machine's speed: kills faster than a client starts and
            # finishes an episode would only measure start-up time.
            target = self._finished() + self.between
            while self._finished() < target and not self.stop.wait(SNAPSHOT_RETRY_S):
                pass

    def _finished(self) -> int:
        return self.run.server.registry.status()["counters"]["finished"]

    def _victim(self) -> tuple[int | None, list[str]]:
        """A random running client with an episode open, and the ids of its open episodes."""
        while not self.stop.is_set():
            open_by = self.run.server.registry.open_by_client()
            busy = [(pid, ids) for pid in self.run.supervisor.pids()
                    for cid, ids in open_by.items() if cid.endswith(f"-{pid}")]
            if busy:
                return self.rng.choice(busy)
            self.stop.wait(SNAPSHOT_RETRY_S)
        return None, []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--kill-every", type=float, default=3.0, help="mean seconds between kills")
    ap.add_argument("--lease", type=float, default=4.0, help="server.lease_s: how soon a killed client's episodes expire")
    ap.add_argument("--between", type=int, default=2, help="episodes finished between two kills (so the run moves)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-kills", type=int, default=0, help="train past --steps until this many kills have landed")
    args = ap.parse_args(argv)
    os.chdir(ROOT)  # `sandbox:NAME` resolves under ./sandboxes
    clients = ", ".join(f"{{agent: '{a}', isolate: true, concurrency: 4}}" for a in CLIENTS)
    checkpoints = tempfile.mkdtemp(prefix="swarmrl-chaos-")
    atexit.register(shutil.rmtree, checkpoints, ignore_errors=True)  # the bench reads nothing back from it
    cfg = load_config(ROOT / "configs" / "tiny.yaml", [
        f"trainer.steps={args.steps + (EXTRA_STEPS_CAP if args.min_kills else 0)}", "trainer.batch_groups=2", "trainer.group_size=2", "trainer.checkpoint_every=0",
        f"trainer.checkpoint_dir={checkpoints}", f"server.lease_s={args.lease}",
        "server.port=0", f"clients=[{clients}]"])
    run = CoreRun(cfg)
    trained: dict[str, object] = {}
    take_batch = run.server.registry.take_batch

    def recording_take_batch(*a, **kw):  # the witness: every episode the trainer is handed
        batch = take_batch(*a, **kw)
        for ep in batch.episodes if batch is not None else ():
            trained[ep.id] = ep
        return batch

    run.server.registry.take_batch = recording_take_batch
    chaos = Chaos(run, args.kill_every, args.between, args.seed)
    started = time.perf_counter()
    run.server.start()
    with on_signals(run.stop.set, (signal.SIGTERM,)):  # stop cleanly: clients stopped, counts printed
        try:
            run.start_clients()
            chaos.thread.start()
            run.train(on_step=lambda step, _: step >= args.steps and chaos.kills >= args.min_kills and run.stop.set())
        finally:
            chaos.stop.set()
            chaos.thread.join(timeout=RESTART_WAIT_S + 5)
            run.stop_clients()
    try:
        status, broken = books(run.server.url)
    finally:
        run.server.stop()
    wall = time.perf_counter() - started

    # Trained but never finished by its client: not in the finished state, no reward, or open when its client died
    # and not finished before the kill landed.
    partial = {e.id for e in trained.values() if e.state != "finished" or e.reward is None}
    partial |= {i for i in chaos.killed_open if i in trained and final_state(run, i) != "finished"}
    ends: dict[str, int] = {}
    for episode_id in chaos.killed_open:
        state = final_state(run, episode_id)
        ends[state] = ends.get(state, 0) + 1
    c = status["episodes"]
    rows = [("opened", c["opened"]), ("finished", c["finished"]), ("aborted", c["aborted"]), ("expired", c["expired"]),
            ("open at the end", status["open_episodes"]), ("trained", c["trained"]), ("stale dropped", c["stale"]),
            ("buffered at the end", status["buffer"]["episodes"]), ("kills (SIGKILL, mid-episode)", chaos.kills),
            ("client restarts", run.supervisor.restarts), ("episodes open at a kill", len(chaos.killed_open)),
            ("  ... how they ended", ", ".join(f"{k} {v}" for k, v in sorted(ends.items())) or "-"),
            ("trainer steps", f"{run.step}/{args.steps}"), ("wall time", f"{wall:.0f}s")]
    width = max(len(name) for name, _ in rows)
    print(f"chaos run: tiny, clients {CLIENTS}, lease {args.lease:g}s, a kill every ~{args.kill_every:g}s")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    for line in broken + chaos.unbalanced:
        print(f"  unbalanced: {line}")
    if run.failure is not None:
        print(f"  run failed: {run.failure}")
    balance = "ok" if not broken and not chaos.unbalanced else "FAIL"
    print(f"chaos: steps={run.step} kills={chaos.kills} partial_trained={len(partial)} balance={balance}", flush=True)
    done = run.step >= args.steps and chaos.kills >= args.min_kills and run.failure is None
    return 0 if done and not partial and balance == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
