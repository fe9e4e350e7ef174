"""The watchdog: a thread that logs a ``stuck`` record when the machine stops making progress.

Progress is a change of (state, layer), reported by the machine's listener
(``on_fired``). ``collecting`` (waiting for the next interval) and ``failed`` (already
reported as a fault, waiting for the engine) are resting states and are never stuck;
in ``planning``, ``transferring``, ``committing`` and ``scaling`` every layer must
move on within ``deadline_s``. When it does not, the watchdog writes a ``stuck``
record (state, layer, the last collective this rank started, seconds without progress)
to the trace and a warning through ``structlog.get_logger()``, and repeats it every
further ``deadline_s`` while nothing moves.

The watchdog reads local time only to write these logs; nothing it sees feeds a
decision, so it can never make ranks diverge.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import structlog

from eplb_fsm.periodic import PeriodicThread, weakly
from eplb_fsm.safe_log import log_safely
from eplb_fsm.fsm.machine import COMMITTING, PLANNING, SCALING, TRANSFERRING

WATCHED_STATES = (PLANNING, TRANSFERRING, COMMITTING, SCALING)


class Watchdog:
    """Log ``stuck`` when the watched (state, layer) does not change within ``deadline_s``.

    ``trace`` is the rank's EventTrace (thread-safe writes are the owner's business);
    ``check(now)`` does one inspection and is what the thread calls every ``poll_s``,
    so tests can drive it with a fake clock and no thread. The thread holds the watchdog weakly: it
    polls while its owner keeps a reference and ends once it is freed.
    """

    def __init__(
        self,
        trace: Any,
        deadline_s: float,
        poll_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        logger: Any = None,
        state: str = "collecting",
        layer: int = 0,
    ) -> None:
        if deadline_s <= 0:
            raise ValueError(f"deadline_s must be > 0 (0 turns the watchdog off), got {deadline_s}")
        self.trace = trace
        self.deadline_s = float(deadline_s)
        self.poll_s = float(poll_s) if poll_s is not None else max(0.01, min(1.0, self.deadline_s / 4))
        self.clock = clock
        self.logger = logger if logger is not None else structlog.get_logger("eplb_fsm.watchdog")
        self._lock = threading.Lock()
        self.state = state
        self.layer = int(layer)
        self.since = clock()          # when (state, layer) last changed
        self._next_report = self.since + self.deadline_s
        self.reports: list[dict] = []
        # weakly, as liveness's: a controller dropped without close() must not keep its trace open through it
        self._loop = PeriodicThread("eplb-watchdog", weakly(self._period, 0.0), weakly(self._poll, False))

    def _period(self) -> float:
        return self.poll_s

    # -- progress --------------------------------------------------------
    def progress(self, state: str, layer: int) -> None:
        """Tell the watchdog the current (state, layer); a change restarts its clock."""
        with self._lock:
            if state != self.state or layer != self.layer:
                self.state = state
                self.layer = int(layer)
                self.since = self.clock()
                self._next_report = self.since + self.deadline_s

    def on_fired(self, fired: Any) -> None:
        """Machine listener: every fired event is potential progress."""
        self.progress(fired.dest, fired.layer)

    # -- inspection ------------------------------------------------------
    def check(self, now: float | None = None) -> dict | None:
        """Write a ``stuck`` record if the deadline has passed; returns the record or None."""
        now = self.clock() if now is None else now
        with self._lock:
            if self.state not in WATCHED_STATES or now < self._next_report:
                return None
            state, layer, stalled = self.state, self.layer, now - self.since
            self._next_report = now + self.deadline_s
        last = getattr(self.trace, "last_collective", None)
        last_summary = None
        if last:
            last_summary = {k: last.get(k) for k in ("op", "group", "cseq", "step", "seq", "layer") if k in last}
        record = self.trace.emit(
            "stuck",
            state=state,
            layer=layer,
            seconds=round(stalled, 3),
            deadline_s=self.deadline_s,
            last_collective=last_summary,
        )
        self.reports.append(record)
        # the record is written: a log that cannot get out (stdout on a full disk, a closed pipe) changes nothing
        log_safely(self.logger, "warning", "eplb stuck", state=state, layer=layer, seconds=round(stalled, 3),
                   last_collective=last_summary, rank=getattr(self.trace, "rank", None))
        return record

    # -- thread ----------------------------------------------------------
    def _poll(self) -> None:
        try:
            self.check()
        except Exception as exc:  # a failed check must never end the thread, nor its log (stdout may be full)
            log_safely(self.logger, "error", "eplb watchdog check failed", error=f"{type(exc).__name__}: {exc}")

    def start(self) -> "Watchdog":
        self._loop.start()
        return self

    def stop(self, timeout: float = 2.0) -> bool:
        """Stop the thread; True if it ended within ``timeout``."""
        return self._loop.stop(timeout)

    @property
    def running(self) -> bool:
        return self._loop.running
