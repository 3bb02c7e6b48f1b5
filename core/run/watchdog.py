"""The hang watchdog: notices a training run in which nothing progresses, says why in one line, dumps every stack.

Progress is a finished episode or a train step. When neither happens for `server.stall_s` seconds
while the trainer waits, the watchdog

- logs one diagnostic line: open episodes (and the oldest one's age), the buffer, whether the server
  is paused, and per engine its queue, active requests, admission and the oldest in-flight request;
- writes the stacks of all threads (`faulthandler`) to `stall-<time>.txt` in the run folder (the
  folder that holds `trainer.checkpoint_dir`);
- sets `Server.stalled`, so `/swarm/v1/status` and `swarm status` read `stalled`.

The next finished episode or step clears it, with one line. The watchdog deliberately does not act
on a stall (no restart, abort or kill): a stall may be a slow machine or a long rollout, and what to
do about it is for a person, or the researcher's monitor, to decide. It reads the server; it does
not train or serve.
"""

from __future__ import annotations

import faulthandler
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the server imports nothing from here
    from core.serve.server import Server

log = logging.getLogger(__name__)

# Looks this many times per `stall_s` (at most every MAX_CHECK_S), so a stall is reported at most a
# quarter of `stall_s` late, and a ten-minute watchdog does not wake every second for nothing.
CHECKS_PER_STALL = 4
MAX_CHECK_S = 5.0


def run_folder(checkpoint_dir: str | Path) -> Path:
    """The run's folder: the one holding its checkpoints (`runs/tiny` for `runs/tiny/checkpoints`)."""
    return Path(checkpoint_dir).resolve().parent


class Watchdog:
    def __init__(self, server: Server, stall_s: float, folder: Path, steps: Callable[[], int],
                 clock: Callable[[], float] = time.monotonic):
        self.server, self.stall_s, self.folder, self.steps, self.clock = server, stall_s, Path(folder), steps, clock
        self._mark = self._progress()
        self._since = clock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _progress(self) -> tuple[int, int]:
        return self.server.registry.status()["counters"]["finished"], self.steps()

    def start(self) -> Watchdog:
        self._thread = threading.Thread(target=self._watch, name="watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=MAX_CHECK_S + 1)
        self.server.stalled = None  # a run that ended is not stalled

    def _watch(self) -> None:
        interval = min(MAX_CHECK_S, self.stall_s / CHECKS_PER_STALL)
        while not self._stop.wait(interval):
            try:
                self.check()
            except Exception:  # the watchdog must never be what breaks a run
                log.exception("watchdog check failed")

    def check(self) -> str | None:
        """One look. Returns the diagnostic line when a stall begins at this look, else None."""
        now, mark = self.clock(), self._progress()
        if mark != self._mark:
            if self.server.stalled is not None:
                log.info("progress again after %.0fs stalled", now - self._since)
                self.server.stalled = None
            self._mark, self._since = mark, now
            return None
        if self.server.stalled is not None or now - self._since < self.stall_s:
            return None
        stacks = self.folder / f"stall-{time.strftime('%Y%m%dT%H%M%S')}.txt"
        line = self.diagnose(now - self._since) + f"; thread stacks in {stacks}"
        self._dump(stacks, line)
        log.error("%s", line)
        self.server.stalled = line
        return line

    def diagnose(self, idle_s: float) -> str:
        reg = self.server.registry.status()
        oldest_open = f" (oldest opened {reg['oldest_open_s']:.0f}s ago)" if reg["oldest_open_s"] is not None else ""
        parts = [
            f"stalled: no finished episode and no train step for {idle_s:.0f}s (server.stall_s={self.stall_s:g})",
            f"open episodes {reg['open_episodes']}{oldest_open}",
            f"buffer {reg['ready_groups']} ready / {reg['filling_groups']} filling groups",
            "server paused" if reg["paused"] else "server not paused",
        ]
        for name, policy in self.server.policies.items():
            try:
                load = policy.engine.load()
            except Exception as e:  # a remote engine that cannot answer is part of the diagnosis, not its end
                parts.append(f"engine {name}: no load report ({type(e).__name__}: {e})")
                continue
            oldest = f"{load.oldest_s:.0f}s old" if load.oldest_s is not None else "none"
            parts.append(f"engine {name}: queue {load.queued}, active {load.active}, "
                         f"{'admitting' if load.admitting else 'held for a weight sync'}, oldest in-flight request {oldest}")
        return "; ".join(parts)

    def _dump(self, path: Path, line: str) -> None:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with open(path, "w") as f:
                f.write(line + "\n\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
        except OSError as e:  # a full or read-only disk must not hide the diagnostic line
            log.warning("cannot write thread stacks to %s: %s", path, e)
