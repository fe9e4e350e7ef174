"""Pacing a transfer to the engine's steps: chunks of a layer's transfer wait for the next engine step.

Async mode's background worker (:mod:`eplb_fsm.fsm.worker`) moves a layer in chunks
(``EplbConfig.async_max_bytes_per_step``; the cut is :mod:`eplb_fsm.transfer.chunks`); between two
chunks :class:`StepPacer` waits until the engine has stepped, so the worker's copies and
messages spread over the engine's steps instead of taking the CPU in one burst. Every wait is
bounded, and none happens while the engine thread itself waits for the worker (:func:`unpaced`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator

__all__ = ["StepPacer", "unpaced"]


class StepPacer:
    """Between two chunks of a transfer, wait until the engine has stepped since the previous chunk began.

    ``step()``: the engine's current step (the controller's trace step, stored by every
    ``step()`` call). :meth:`begin` notes the step a chunk starts at; :meth:`wait` returns once
    the step differs from it, or after ``max_wait_s`` (an engine that stopped stepping, e.g. a
    drain at close, must not hold the transfer forever). Returns True when the step advanced.

    ``advanced``: an event the engine thread sets after it moves the step on; the pacer then
    sleeps on it and wakes once per step. Without one it polls every ``poll_s``, and every
    poll wakes the worker, which then takes the GIL from the engine thread mid-step.
    ``stop``: while set (the controller closing, or the engine thread waiting for the worker
    in a drain: :func:`unpaced`), no wait at all: the steps that paced the chunks do not
    come while the engine thread waits. Whoever sets it sets ``advanced`` too, to wake a
    wait in progress.
    """

    def __init__(self, step: Callable[[], int], max_wait_s: float = 0.5, poll_s: float = 0.0005,
                 advanced: threading.Event | None = None, stop: threading.Event | None = None) -> None:
        self.step = step
        self.max_wait_s = max_wait_s
        self.poll_s = poll_s
        self.advanced = advanced
        self.stop = stop
        self.started_at: int | None = None
        self.calls = 0           # chunk boundaries (a pure function of the plan and the byte cap)
        self.waits = 0           # chunks that found the step not yet advanced
        self.timeouts = 0        # waits that ended by max_wait_s

    def begin(self) -> None:
        self.started_at = self.step()

    def wait(self) -> bool:
        self.calls += 1
        start = self.started_at
        stop = self.stop
        if start is None or self.step() != start or (stop is not None and stop.is_set()):
            self.begin()
            return True
        self.waits += 1
        deadline = time.monotonic() + self.max_wait_s
        event = self.advanced
        while True:
            if event is not None:
                event.clear()   # before the check: a step moved on after it sets the event again
            if self.step() != start or (stop is not None and stop.is_set()):
                break
            left = deadline - time.monotonic()
            if left <= 0:
                self.timeouts += 1
                self.begin()
                return False
            if event is not None:
                event.wait(left)
            else:
                time.sleep(self.poll_s)
        self.begin()
        return True


@contextlib.contextmanager
def unpaced(stop: threading.Event, advanced: threading.Event) -> Iterator[None]:
    """While the engine thread waits for the worker (a drain after a fault, before a recovery or a switch),
    a paced transfer's chunks go without waiting for engine steps: none come meanwhile, so the wait would
    outlast every remaining chunk's ``max_wait_s``. ``stop``, ``advanced``: a :class:`StepPacer`'s events;
    ``stop`` is cleared on the way out unless it was set before (``close()``: it stays unpaced)."""
    was_set = stop.is_set()
    stop.set()
    advanced.set()   # a chunk waiting for the next step goes now
    try:
        yield
    finally:
        if not was_set:
            stop.clear()
