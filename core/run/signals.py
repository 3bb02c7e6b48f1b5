"""Ctrl-C and SIGTERM as an action on a thread of its own, so a signal never deadlocks the thread it lands on.

A Python signal handler runs in the main thread, between two of its bytecodes. One that calls
`threading.Event.set()` while the main thread is inside `Event.wait()` on the same event waits for
ever on the event's lock, which the interrupted frame holds: a `swarm run` hung this way after Ctrl-C
(its handler set `stop` while `_train` sat in `stop.wait`), more often the busier the machine. Here
the handler only puts the signal on a `queue.SimpleQueue`, whose `put` is reentrant by contract, and
a daemon thread runs the action.

Deliberately not: a signal framework. A handler that must act in the interrupted thread (raise
`SystemExit`) needs none of this, and asyncio code uses `loop.add_signal_handler`.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from queue import SimpleQueue

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def on_signals(action: Callable[[], None], signals: tuple[int, ...] = STOP_SIGNALS) -> Iterator[None]:
    """Within the block, each of `signals` runs `action` on the relay thread; the previous handlers after."""
    arrived: SimpleQueue[int | None] = SimpleQueue()

    def relay() -> None:
        while arrived.get() is not None:
            action()

    thread = threading.Thread(target=relay, daemon=True, name="signal-relay")
    thread.start()
    previous = {sig: signal.signal(sig, lambda signum, _frame: arrived.put(signum)) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        arrived.put(None)  # the relay ends after any action still queued
