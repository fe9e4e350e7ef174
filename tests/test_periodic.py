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


def test_start_after_a_timed_out_stop_runs_a_new_thread_without_overlap():
    """start() after a stop() that timed out (body still blocked) runs a fresh thread; body calls never overlap."""
    entered, release = threading.Event(), threading.Event()
    later_calls = threading.Semaphore(0)
    guard = threading.Lock()
    inside = [0]
    overlaps = []
    first = [True]

    def body() -> None:
        with guard:
            inside[0] += 1
            overlaps.append(inside[0] > 1)
            is_first, first[0] = first[0], False
        try:
            if is_first:  # the call that outlasts stop's timeout
                entered.set()
                release.wait(30)
            else:
                later_calls.release()
        finally:
            with guard:
                inside[0] -= 1

    loop = PeriodicThread("t", lambda: 0.001, body)
    loop.start()
    assert entered.wait(5)
    old = loop.thread
    assert loop.stop(timeout=0.01) is False and old.is_alive()  # the first call is still blocked
    loop.start()
    assert loop.thread is not old and loop.running
    release.set()
    assert later_calls.acquire(timeout=5)  # the new thread calls body once the old call returned
    old.join(5)
    assert not old.is_alive()  # the old thread saw its own stop event and ended
    assert loop.stop(timeout=5) and not loop.running
    assert not any(overlaps)
