"""Liveness: a background thread that beats at least once per ``interval_s`` and keeps a rank's trace telling.

Why: when a job stops, a trace alone cannot tell a rank that froze (SIGSTOP, a stuck
driver) from a rank that waits on it. Each beat writes what is needed to settle it, and no
more (issue 14: disk per rank stays under 10 MB per million steps at 10 steps/s). A beat
compares the trace's step with the step at the previous beat (a look's included):

- the rank **waits** (no advance since the previous beat, or a traced collective is open):
  an ``alive`` record, with ``waiting_on`` naming the collective it waits in (the
  controller's, or, when that is null while the step stays put, the engine's own
  collective the controller never sees; ``engine_wait`` names the one a thread of the
  process is blocked in, when :mod:`eplb_fsm.engine_wait` sees it). Every beat of a
  wait writes one, one interval apart;
- the rank **makes progress**: its pending ``steps`` run is the evidence of life, written
  every :data:`FLUSH_FACTOR` x ``interval_s`` (1.5 s by default; a killed rank loses at most
  that much of quiet steps), with an ``alive`` record only every :data:`HEARTBEAT_S` seconds
  (and at the first beat: the record that announces ``interval_s``). Between two such
  writes the thread beats once more, one interval after the write, and only *looks* (it
  writes nothing): beats come 1 and 0.5 intervals apart in turn, never more than one
  interval. A live rank is so never silent for more than 1.5 intervals, under replay's 2 s
  (silences kept) and 2.5 intervals (frozen);
- a frozen rank writes nothing for as long as it is frozen (every thread of a stopped
  process stops); a killed rank's records simply stop, and its trace has no ``end`` record.

An ``alive`` record's ``steps_seen`` is the step at this thread's previous record (alive or
run, at least one interval before; a look writes nothing and does not count), so
``step == steps_seen`` says no step for at least one interval. A beat after a look compares
with the look's step instead: no step in that half interval writes ``alive`` (a wait may
have begun), but the record is not read as a wait unless the step also stayed put since the
previous record; a rank whose steps take half to one interval writes such records while it
moves. A wait's records carry ``step == steps_seen`` from its second ``alive`` on.

The detection bound this buys: a rank that starts to wait at time t (its last step counted)
writes its first ``alive`` by t + 1.5 intervals (the first beat after t may still see the
step advance; the next, at most 1.5 intervals after t whatever the phase, cannot), plus its
thread's scheduling delay. A rank frozen for D seconds, with D over replay's limit (2.5
intervals, at least 2 s), is therefore reported ``frozen`` when another rank waits on it
and reaches that wait (its current step) within D - 1.5 intervals of the freeze, thread
delay included. At the default 1 s: any freeze over 2.5 s while the waiter's step and
thread delay stay under 1 s (docs/debugging-hangs.md, "Real failures").

Cost on the engine's step path: nothing of its own. The thread reads the trace's
``step`` (which the controller already stores on every step) and its open collectives;
the step path does not call into this module at all. A beat costs the thread at most one
JSON line (~10 us), i.e. ~1e-5 of one core at 1 s.
"""

from __future__ import annotations

import math
import time
import weakref
from typing import Any, Callable

import structlog

from eplb_fsm.engine_wait import look
from eplb_fsm.periodic import PeriodicThread
from eplb_fsm.safe_log import log_safely, retry_due

__all__ = ["DEFAULT_INTERVAL_S", "FLUSH_FACTOR", "HEARTBEAT_S", "Liveness", "check_interval"]

DEFAULT_INTERVAL_S = 1.0
# while the step advances, the thread writes the run of quiet steps every this many
# intervals: one `steps` line (~120 bytes) per 1.5 s, ~8 MB per million steps at 10 steps/s;
# 1.0 would be ~12 MB, 2.0 would put a live rank's gaps at replay's 2 s limit. It also beats
# (looks, writing nothing) one interval after each write: beats are never more than one
# interval apart, so a wait shows as `alive` within 1.5 intervals of its start.
FLUSH_FACTOR = 1.5
# while the step advances, an `alive` record this often (seconds) all the same: a reader
# that sees only steps runs still learns the rank's interval and that its thread runs
HEARTBEAT_S = 30.0

_log = structlog.get_logger("eplb_fsm.liveness")


def check_interval(interval_s: Any) -> float:
    """``interval_s`` as a float > 0 and finite; ValueError naming the field and every accepted value otherwise
    (the caller, :class:`Liveness`, takes None and 0 as off before it asks)."""
    if isinstance(interval_s, bool) or not isinstance(interval_s, (int, float)) \
            or not math.isfinite(interval_s) or interval_s <= 0:
        raise ValueError("liveness_interval_s must be None, 0 (off) or a finite number > 0 (seconds), "
                         f"got {interval_s!r}")
    return float(interval_s)


class Liveness:
    """Beat at least every ``interval_s`` seconds from a daemon thread: ``alive`` while waiting, runs while moving.

    ``trace``: an :class:`~eplb_fsm.trace.EventTrace` whose ``emit`` is safe from another
    thread (``SharedTrace``), or None until :meth:`start_on`. ``interval_s``: None or 0
    turns liveness off (``start`` then starts nothing). :meth:`beat` is what the thread
    calls (the module docstring says what it writes) and sets the wait before the next
    beat (:meth:`period`); :meth:`tick` writes one ``alive`` record unconditionally. Both
    can be driven without the thread; ``clock`` (seconds, monotonic) times the heartbeat.
    ``steps_seen`` in a record is the trace's step at this thread's previous record (None for the first),
    at least one interval earlier: a look, which writes nothing, does not move it. ``trace`` is held
    weakly: the thread beats while something else refers to it (its controller) and ends once it is freed,
    so a controller dropped without ``close()`` does not keep its trace file open through this thread.
    """

    def __init__(self, trace: Any, interval_s: float | None = DEFAULT_INTERVAL_S,
                 heartbeat_s: float = HEARTBEAT_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.trace = trace
        self.interval_s = check_interval(interval_s) if interval_s else None
        if isinstance(heartbeat_s, bool) or not isinstance(heartbeat_s, (int, float)) \
                or not math.isfinite(heartbeat_s) or heartbeat_s <= 0:
            raise ValueError("heartbeat_s must be a finite number > 0 (seconds between alive records), "
                             f"got {heartbeat_s!r}")
        self.heartbeat_s = float(heartbeat_s)
        self.clock = clock
        self.moving = False                      # the last beat saw the step advance
        self._looked = False                     # a moving beat only looked: the next one (0.5 interval on) writes
        self._steps_seen: int | None = None     # the step at this thread's last record (what records carry)
        self._looked_at: int | None = None      # the step at the last look: the next beat compares with it
        self._last_alive: float | None = None   # clock() at the last alive record
        self._last_write: float | None = None   # clock() at this thread's last record (alive or run)
        self.errors = 0                          # beats that raised (the thread logs the first and goes on)
        self._warned = False                     # that log got out
        self._loop = PeriodicThread("eplb-liveness", self.period, self._beat)
        self.group_of: Callable[[], Any] | None = None   # the controller's current group (engine_wait compares)

    @property
    def trace(self) -> Any:
        """The trace beaten on (None: not attached yet, or freed since)."""
        return None if self._trace is None else self._trace()

    @trace.setter
    def trace(self, trace: Any) -> None:
        self._trace = None if trace is None else weakref.ref(trace)

    def period(self) -> float | None:
        """Seconds to the next beat: ``interval_s``, or the rest of ``FLUSH_FACTOR`` intervals after a look."""
        if self.interval_s is None:
            return None
        return self.interval_s * (FLUSH_FACTOR - 1.0) if self._looked else self.interval_s

    def tick(self) -> dict | None:
        """Write one ``alive`` record now (the pending run first); returns it (None once the trace has ended)."""
        return self._tick(self.trace)

    def _tick(self, trace: Any) -> dict | None:
        step = trace.step
        # a rank that waits may be inside the engine's own collective (also beside a posted one of the
        # controller's): the record names it (eplb_fsm.engine_wait), so that replay can read a peer frozen for good
        group = self.group_of() if self.group_of else None
        # a main thread in a collective engine_wait does not name (a rooted one; another group's, beside a side
        # thread's wait on the controller's ranks; a send or recv) is not in its own work: the record says so too
        engine, main = (None, None) if self.moving else look(group)
        if main:
            engine = (*(engine or (None, None, None, None)), main)
        record = trace.alive(self.interval_s, self._steps_seen, **({"engine_wait": engine} if engine else {}))
        self._steps_seen = step
        self._last_alive = self._last_write = self.clock()
        return record

    def beat(self) -> dict | None:
        """One beat: an ``alive`` record when the rank waits (its step did not advance since the
        previous beat, or a traced collective is open), at the first beat and when the heartbeat
        is due; otherwise, on a write beat, the pending run (an ``alive`` when nothing is
        pending), and on a look beat (the first moving beat after a write) nothing. Returns what
        was written (an ``alive``, ``steps`` or ``step`` record), None for a look: no write beat
        is silent, and a write beat follows every look."""
        trace = self.trace   # held for the whole beat: the weak reference may die between two reads
        step = trace.step
        looked, self._looked = self._looked, False
        # after a look, no advance since it (half an interval) is a wait that may have begun: alive now keeps
        # the 1.5-interval detection bound. The record still carries the step at the last record, so that
        # step == steps_seen keeps meaning no step for at least one interval, not a step slower than half of one
        self.moving = step != (self._looked_at if looked else self._steps_seen) and trace.waiting_on() is None
        now = self.clock()
        due = self._last_alive is None or now - self._last_alive >= self.heartbeat_s
        if not self.moving or due:
            return self._tick(trace)
        if not looked and self.interval_s is not None and self._last_write is not None \
                and now - self._last_write < FLUSH_FACTOR * self.interval_s:
            # one interval after a write: soon enough to see a wait begin, too soon to write the run again
            # (a beat that comes late, after a freeze or a busy host, writes at once instead)
            self._looked = True
            self._looked_at = step
            return None
        written = trace.flush()
        if written is None:
            # the step's own records (a transition, a collective) took the run out already;
            # a beat that wrote nothing would leave up to two beat periods of silence, which
            # replay reads as a freeze, so such a beat says alive instead
            return self._tick(trace)
        self._steps_seen = step
        self._last_write = now
        return written

    def _beat(self) -> bool:
        trace = self.trace
        if trace is None or getattr(trace, "ended", False):   # freed (its controller dropped), or ended
            return False
        try:
            self.beat()
        except Exception as exc:
            # liveness must never take the engine down, and must not fall silent on a passing
            # error either: a live rank without beats replays as frozen. Only a trace that is
            # closed (its file gone at shutdown) ends the thread.
            if getattr(trace, "ended", False) or getattr(trace, "closed", False):
                return False
            self.errors += 1
            # a log that raised here would end the thread all the same (stdout on a full disk, a closed pipe):
            # it cannot raise, and one that did not get out is tried again at the 2nd, 4th, 8th... error
            if not self._warned and retry_due(self.errors):
                self._warned = log_safely(_log, "error", "eplb liveness beat failed; the thread goes on",
                                          error=f"{type(exc).__name__}: {exc}", rank=getattr(trace, "rank", None))
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
