"""Liveness: a background thread that writes a low-rate ``alive`` record to a rank's trace.

Why: when a job stops, a trace alone cannot tell a rank that froze (SIGSTOP, a stuck
driver) from a rank that waits on it. An ``alive`` record every ``interval_s`` seconds
(default :data:`DEFAULT_INTERVAL_S`) settles it:

- a running rank keeps writing them; ``step`` advances between them, or it does not
  and ``waiting_on`` names the collective it waits in (the controller's, or, when that
  is null while the step stays put, the engine's own collective the controller never sees);
- a frozen rank writes none for as long as it is frozen: a gap in its ``alive`` records
  (every thread of a stopped process stops), while the ranks waiting on it keep writing;
- a killed rank's records simply stop, and its trace has no ``end`` record.

Cost on the engine's step path: nothing of its own. The thread reads the trace's
``step`` and ``state`` (which the controller already stores on every step) and its
open collectives; the step path does not call into this module at all. Each record
costs the thread one JSON line (~10 us) per interval, i.e. ~1e-5 of one core at 1 s.
"""

from __future__ import annotations

import math
from typing import Any

from eplb_fsm.periodic import PeriodicThread

__all__ = ["DEFAULT_INTERVAL_S", "Liveness", "check_interval"]

DEFAULT_INTERVAL_S = 1.0


def check_interval(interval_s: Any) -> float:
    """``interval_s`` as a float > 0 and finite; ValueError naming the field otherwise."""
    if isinstance(interval_s, bool) or not isinstance(interval_s, (int, float)) \
            or not math.isfinite(interval_s) or interval_s <= 0:
        raise ValueError(f"liveness_interval_s must be a finite number > 0 (seconds), got {interval_s!r}")
    return float(interval_s)


class Liveness:
    """Write ``alive`` to ``trace`` every ``interval_s`` seconds from a daemon thread.

    ``trace``: an :class:`~eplb_fsm.trace.EventTrace` whose ``emit`` is safe from another
    thread (``SharedTrace``), or None until :meth:`start_on`. ``interval_s``: None or 0
    turns liveness off (``start`` then starts nothing). ``tick()`` writes one record and is
    what the thread calls, so tests can drive it without the thread. ``steps_seen`` in a
    record is the trace's step at the previous record (None for the first).
    """

    def __init__(self, trace: Any, interval_s: float | None = DEFAULT_INTERVAL_S) -> None:
        self.trace = trace
        self.interval_s = check_interval(interval_s) if interval_s else None
        self._steps_seen: int | None = None
        self._loop = PeriodicThread("eplb-liveness", lambda: self.interval_s, self._beat)

    def tick(self) -> dict | None:
        """Write one ``alive`` record now; returns it (None once the trace has ended)."""
        step = self.trace.step
        record = self.trace.alive(self.interval_s, self._steps_seen)
        self._steps_seen = step
        return record

    def _beat(self) -> bool:
        if getattr(self.trace, "ended", False):
            return False
        try:
            self.tick()
        except Exception:  # a closed file at shutdown: liveness must never take the engine down
            return False
        return True

    def start_on(self, trace: Any) -> "Liveness":
        """Attach ``trace`` and start, if it writes to a file (nothing to report to otherwise)."""
        self.trace = trace
        return self.start() if getattr(trace, "path", None) is not None else self

    def start(self) -> "Liveness":
        if self.interval_s is not None and self.trace is not None:
            self._loop.start()
        return self

    def stop(self, timeout: float = 2.0) -> bool:
        """Stop the thread; True if it ended within ``timeout``."""
        return self._loop.stop(timeout)

    @property
    def running(self) -> bool:
        return self._loop.running
