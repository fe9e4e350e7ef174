"""A daemon thread that runs one callable at a fixed period: the watchdog's and liveness's loop."""

from __future__ import annotations

import threading
from typing import Callable

__all__ = ["PeriodicThread"]


class PeriodicThread:
    """Call ``body()`` every ``period()`` seconds on a daemon thread until stopped.

    ``period`` is read before each wait, so an owner may change its own period attribute
    while the thread runs. ``body`` returning False ends the thread (e.g. the trace has
    ended); it must handle its own errors, since nothing here may reach the engine.
    """

    def __init__(self, name: str, period: Callable[[], float], body: Callable[[], bool | None]) -> None:
        self.name = name
        self.period = period
        self.body = body
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None

    def run(self) -> None:
        while not self.stopping.wait(self.period()):
            if self.body() is False:
                return

    def start(self) -> None:
        """Start the thread unless it is already running (a stopped one can be started again)."""
        if self.thread is None or not self.thread.is_alive():
            self.stopping.clear()
            self.thread = threading.Thread(target=self.run, name=self.name, daemon=True)
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
