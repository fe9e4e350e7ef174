"""A rank's ``seq`` counter, checked as the walker reads: lost lines, one foreign line, disorder.

``seq`` advances by one per record of a session. ``SeqCheck`` is told the ``seq`` of every
record the walker reads one by one, with the number of step records counted so far
(runs of step lines are counted, not read): a jump forward is lost lines, a jump forward
and straight back is one record that carried a foreign ``seq`` (an inserted line), any
other step back is disorder, kept with the file line for an ``out_of_order`` finding.
"""

from __future__ import annotations

from typing import Any, Callable

MAX_DISORDER = 20   # disorder entries kept per session (the first ones say where)


class SeqCheck:
    """The ``seq`` bookkeeping of one session (``walker.Walker`` holds one)."""

    def __init__(self) -> None:
        self.prev: int | None = None           # seq of the last record read one by one
        self.steps_at_prev = 0                 # step records counted when it was read
        self.lost = 0
        self.lost_between: tuple[int, int] | None = None
        self.jump: tuple[int, int, int] | None = None   # (seq due after a jump, steps then, size)
        self.odd = 0
        self.disorder: list[dict] = []

    def next_seq(self, n_steps: int) -> int | None:
        """The ``seq`` the session's next record must carry (None before any)."""
        return None if self.prev is None else self.prev + 1 + n_steps - self.steps_at_prev

    def check(self, seq: Any, n_steps: int, locate: Callable[[], tuple[str, int | None]], event: Any) -> bool:
        """Account one record's ``seq``; returns whether it carried one. ``locate()`` gives
        (``file:line``, line) for a disorder entry (asked only then)."""
        if type(seq) is not int:
            return False
        jump, self.jump = self.jump, None     # an inserted or mislabelled record is one jump and back
        if self.prev is not None:
            expected = self.prev + 1 + n_steps - self.steps_at_prev
            if seq > expected:
                self.lost += seq - expected
                self.jump = (expected + 1, n_steps, seq - expected)
                if self.lost_between is None:
                    self.lost_between = (self.prev, seq)
            elif seq < expected and jump is not None and seq - (n_steps - jump[1]) in (jump[0], jump[0] - 1):
                # the sequence goes on from before the previous record: that one record carried an odd seq
                self.lost -= jump[2]
                self.odd += 1
            elif seq < expected and len(self.disorder) < MAX_DISORDER:
                # written out of order (or a copied line): the order of the file is not the rank's
                where, line = locate()
                self.disorder.append({"where": where, "line": line, "seq": seq, "expected": expected,
                                      "event": event})
        self.prev, self.steps_at_prev = seq, n_steps
        return True

    def skip_to(self, last_seq: int, n_steps: int) -> None:
        """A stretch read in bulk ended with ``last_seq``, ``n_steps`` step records counted by then."""
        self.prev, self.steps_at_prev = last_seq, n_steps

    def warnings(self) -> list[str]:
        out = []
        if self.odd:
            out.append(f"{self.odd} record(s) carry a seq outside the rank's sequence (foreign lines?)")
        if self.lost:
            a, b = self.lost_between
            out.append(f"{self.lost} record(s) missing by seq (lost lines), the first between seq {a} and seq {b}")
        return out
