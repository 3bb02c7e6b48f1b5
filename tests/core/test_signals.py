"""Ctrl-C and SIGTERM set a run's stop event without deadlocking the thread they interrupt (`core.run.signals`)."""

from __future__ import annotations

import signal
import threading

import pytest

from core.run.signals import on_signals

# The failure this guards against is a hang: fail in seconds, not at the suite's default timeout.
pytestmark = pytest.mark.timeout(30)


def test_a_signal_that_lands_while_the_main_thread_holds_the_stop_events_lock_still_stops_the_run():
    stop = threading.Event()
    with on_signals(stop.set, (signal.SIGUSR1,)):
        # Where `stop.wait()` holds it when Ctrl-C lands in `CoreRun._train`: a handler that called
        # stop.set() itself would wait here for ever on a lock its own thread holds.
        with stop._cond:
            signal.raise_signal(signal.SIGUSR1)  # runs the Python-level handler before it returns
            assert not stop.is_set()  # the relay thread is waiting for the lock, not this thread
        assert stop.wait(10)


def test_each_signal_runs_the_action_and_the_previous_handler_is_back_after_the_block():
    calls: list[int] = []
    done = threading.Event()
    before = signal.getsignal(signal.SIGUSR1)

    def action() -> None:
        calls.append(1)
        if len(calls) == 2:
            done.set()

    with on_signals(action, (signal.SIGUSR1,)):
        assert signal.getsignal(signal.SIGUSR1) is not before
        signal.raise_signal(signal.SIGUSR1)
        signal.raise_signal(signal.SIGUSR1)
        assert done.wait(10)
    assert signal.getsignal(signal.SIGUSR1) is before and len(calls) == 2
    relays = [t for t in threading.enumerate() if t.name == "signal-relay"]
    for t in relays:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in relays)
