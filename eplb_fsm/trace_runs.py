"""A run of quiet engine steps that :meth:`eplb_fsm.trace.EventTrace.count_step` counts without a lock.

The trace writes a run as one ``steps`` record (docs/events.md, "Runs of quiet steps").
"""

from __future__ import annotations

__all__ = ["DUMMY", "StepRun"]

DUMMY = 1 << 40   # StepRun.packed: steps in the low 40 bits, dummies above


class StepRun:
    """Steps counted by :meth:`EventTrace.count_step` since the run began: consecutive, one state.

    Written by the engine thread only (``packed`` and ``next``); ``written`` (what is
    already on disk) changes only under the trace's lock. ``packed`` holds both counts
    in one int so that a flusher reads them together: ``steps + dummies * 2**40``.
    """

    __slots__ = ("first", "state", "next", "packed", "written")

    def __init__(self, first: int, state: str | None) -> None:
        self.first = first          # the step of the run's first count
        self.state = state
        self.next = first           # the step the next count must carry to stay in this run
        self.packed = 0
        self.written = 0            # packed value already written as `steps` records
