"""A daemon thread that runs one callable at a fixed period: the watchdog's and liveness's loop."""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable

__all__ = ["PeriodicThread", "weakly"]


class PeriodicThread:
    """Call ``body()`` every ``period()`` seconds on a daemon thread until stopped.

    ``period`` is read before each wait, so an owner may change its own period attribute
    while the thread runs. ``body`` returning False ends the thread (e.g. the trace has
    ended); it must handle its own errors, since nothing here may reach the engine.

    Each thread has its own stop event (``stopping`` is the current thread's), and calls of
    ``body`` never overlap, even across a restart: a new thread waits for an old one's call
    still in progress before it makes its own.
    """

    def __init__(self, name: str, period: Callable[[], float], body: Callable[[], bool | None]) -> None:
        self.name = name
        self.period = period
        self.body = body
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None
        self._body_lock = threading.Lock()

    def run(self, stopping: threading.Event | None = None) -> None:
        """The loop: until ``stopping`` (default: the current ``self.stopping``) is set or ``body`` returns False."""
        stopping = self.stopping if stopping is None else stopping
        while not stopping.wait(self.period()):
            with self._body_lock:
                if stopping.is_set():  # stopped while an older thread's call held the lock
                    return
                if self.body() is False:
                    return

    def start(self) -> None:
        """Make the loop run: a no-op while a thread runs and was not asked to stop; else a new thread.

        After a ``stop()`` that timed out (``body`` outlasted its timeout), the old thread is still
        alive: it ends on its own once that call returns, since its stop event stays set, and the
        new thread, with a fresh event, makes its first call after the old call returns.
        """
        if self.thread is not None and self.thread.is_alive() and not self.stopping.is_set():
            return
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.run, args=(self.stopping,), name=self.name, daemon=True)
        self.thread.start()

    def stop(self, timeout: float = 2.0) -> bool:
        """Stop the thread; True if it ended within ``timeout``."""
        self.stopping.set()
        if self.thread is not None:
            self.thread.join(timeout)
            return not self.thread.is_alive()
        return True

    @property
    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()


def weakly(method: Callable[[], Any], gone: Any) -> Callable[[], Any]:
    """``method`` (a bound method) called through a weak reference, ``gone`` once its object is freed: a
    thread that calls it does not keep the object, nor the trace it writes to, alive. A controller dropped
    without ``close()`` so releases its trace file when it is collected, and its threads end."""
    ref = weakref.WeakMethod(method)

    def call() -> Any:
        bound = ref()
        return gone if bound is None else bound()

    return call
