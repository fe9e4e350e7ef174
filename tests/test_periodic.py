"""Tests for eplb_fsm.periodic: the daemon loop shared by the watchdog and the liveness thread."""

from __future__ import annotations

import threading

from eplb_fsm.periodic import PeriodicThread


def test_body_runs_until_stopped_and_can_restart():
    """The body runs repeatedly; stop() ends the thread; start() after stop() runs it again."""
    calls = threading.Semaphore(0)
    loop = PeriodicThread("t", lambda: 0.001, calls.release)
    loop.start()
    assert all(calls.acquire(timeout=5) for _ in range(3))
    assert loop.stop(timeout=5) and not loop.running
    loop.start()
    assert calls.acquire(timeout=5)
    assert loop.stop(timeout=5)


def test_body_returning_false_ends_the_thread():
    """A body that returns False (e.g. the trace has ended) ends the loop on its own."""
    done = threading.Event()

    def body() -> bool:
        done.set()
        return False

    loop = PeriodicThread("t", lambda: 0.001, body)
    loop.start()
    assert done.wait(5)
    loop.thread.join(5)
    assert not loop.running


def test_stop_before_start_is_harmless():
    """stop() on a loop that never started returns True."""
    assert PeriodicThread("t", lambda: 1.0, lambda: None).stop()
