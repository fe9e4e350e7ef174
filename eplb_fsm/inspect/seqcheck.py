"""A rank's ``seq`` counter, checked as the walker reads: lost lines, one foreign line, disorder.

``seq`` advances by one per record of a session. ``SeqCheck`` is told the ``seq`` of every
record the walker reads one by one (step records included), with the number of step records
counted so far (runs of step lines are counted in bulk, once their ``seq`` values are known to
run on from the one due): a jump forward is lost lines, a jump forward and straight back is one
record that carried a foreign ``seq`` (an inserted line), any other step back is disorder, kept
with the file line for an ``out_of_order`` finding.

A jump forward followed by a record back at the ``seq`` that was due is either an inserted
line (the jumped record) or two records swapped (the jumped one and this one); only the
record after tells them apart, so the decision waits for it: going on from the jumped
record's ``seq`` is a swap, reported as disorder at the record that went back.

Any other step back is a copied line or a line written late: the sequence goes on from where it
was (the records after it are not lost lines), and a late line fills its place in a stretch of
lost lines.

Each stretch of lost lines is kept in ``gaps`` (the seqs lost, and the step and ``ts`` of the
records either side), so that a finding whose evidence would lie there can say so
(``lost_records``); a jump that turns out to be a foreign line or a swap is taken back.
"""

from __future__ import annotations

from typing import Any, Callable

MAX_DISORDER = 20   # disorder entries kept per session (the first ones say where)
MAX_GAPS = 50       # stretches of lost lines kept per session; a later one widens the last kept


class SeqCheck:
    """The ``seq`` bookkeeping of one session (``walker.Walker`` holds one)."""

    def __init__(self) -> None:
        self.prev: int | None = None           # seq of the last record read one by one
        self.steps_at_prev = 0                 # step records counted when it was read
        self.lost = 0
        self.lost_between: tuple[int, int] | None = None
        # after a jump forward: (seq due after it if it was mislabelled, steps then, size, its seq,
        # lost_between before it, its entry in ``gaps``); kept while ``back`` waits, so readers that test it see
        # an open question
        self.jump: tuple | None = None
        # a record back at the seq due before the jump: (jumped seq, steps counted after it, disorder entry)
        self.back: tuple | None = None
        self.odd = 0
        self.disorder: list[dict] = []
        # lost lines: {"first", "last" (the seqs lost), "lost", "from_step", "from_ts", "to_step", "to_ts"}
        self.gaps: list[dict] = []

    def next_seq(self, n_steps: int) -> int | None:
        """The ``seq`` the session's next record must carry (None before any)."""
        return None if self.prev is None else self.prev + 1 + n_steps - self.steps_at_prev

    def check(self, seq: Any, n_steps: int, locate: Callable[[], tuple[str, int | None]], event: Any,
              around: tuple | None = None, step: bool = False) -> bool:
        """Account one record's ``seq``; returns whether it carried one. ``locate()`` gives
        (``file:line``, line) for a disorder entry (asked only then); ``around``: (the (ts, step, ...) of
        the record before, this record's step, its ts), kept with a stretch of lost lines. ``step``: the
        record is a step record, which the caller counts among the ``n_steps`` right after it."""
        if type(seq) is not int:
            return False
        after = n_steps + 1 if step else n_steps   # steps counted once this record is read
        jump, self.jump = self.jump, None     # an inserted or mislabelled record is one jump and back
        if self.back is not None:
            if self._settle_back(jump, seq == self.back[0] + 1 + n_steps - self.back[1]):
                self.prev, self.steps_at_prev = seq, after
                return True
            jump = None                       # the jump was the inserted line: settled
        if self.prev is not None:
            expected = self.prev + 1 + n_steps - self.steps_at_prev
            if seq > expected:
                self.jump = (expected + 1, after, seq - expected, seq, self.lost_between,
                             self._gap(expected, seq, around))
                self.lost += seq - expected
                if self.lost_between is None:
                    self.lost_between = (expected - 1, seq)
            elif seq < expected and jump is not None and seq - (n_steps - jump[1]) == jump[0]:
                # the sequence goes on from before the previous record: that one record carried an odd seq
                self._foreign(jump)
            elif seq < expected and jump is not None and seq - (n_steps - jump[1]) == jump[0] - 1:
                # back at the seq due before the jump: an inserted line or a swap, the next record says which
                where, line = locate()
                self.back = (jump[3], after, {"where": where, "line": line, "seq": seq, "expected": expected,
                                              "event": event})
                self.jump = jump
            elif seq < expected:
                # a copied line, or one written late: the file's order is not the rank's, and the sequence goes
                # on from where it was (taking this seq would make the next records look like a jump)
                if len(self.disorder) < MAX_DISORDER:
                    where, line = locate()
                    self.disorder.append({"where": where, "line": line, "seq": seq, "expected": expected,
                                          "event": event})
                self._late(seq)
                self.prev, self.steps_at_prev = expected - 1, after
                return True
        self.prev, self.steps_at_prev = seq, after
        return True

    def _gap(self, first: int, seq: int, around: tuple | None) -> dict:
        """Keep the lost seqs ``first .. seq - 1`` in ``gaps`` (past ``MAX_GAPS``: the last kept one widens)."""
        before, step, ts = around or (None, None, None)
        gap = {"first": first, "last": seq - 1, "lost": seq - first, "from_step": before[1] if before else None,
               "from_ts": before[0] if before else None, "to_step": step, "to_ts": ts}
        if len(self.gaps) < MAX_GAPS:
            self.gaps.append(gap)
            return gap
        last = self.gaps[-1]
        last.update(last=gap["last"], lost=last["lost"] + gap["lost"], to_step=step, to_ts=ts)
        return last

    def _refill(self, gap: dict, n: int, back: int | None = None) -> None:
        """``n`` seqs of ``gap`` were not lost after all (a foreign line, or ``back``: that seq came late)."""
        gap["lost"] -= n
        if back == gap["first"]:
            gap["first"] += 1
        elif back == gap["last"]:
            gap["last"] -= 1
        if gap["lost"] <= 0:
            self.gaps[:] = [g for g in self.gaps if g is not gap]

    def _late(self, seq: int) -> None:
        """A record that went back carried ``seq``: if a stretch of lost lines holds it, it came late, not lost."""
        for gap in self.gaps:
            if gap["first"] <= seq <= gap["last"]:
                self.lost -= 1
                self._refill(gap, 1, seq)
                return

    def _settle_back(self, jump: tuple, swapped: bool) -> bool:
        """Decide the record back held in ``back``: a swap (disorder there) or the jumped record inserted."""
        entry = self.back[2]
        self.back = None
        if not swapped:
            self._foreign(jump)
            return False
        self.lost -= 1                  # the record back filled the slot the jump skipped (others stay lost)
        self._refill(jump[5], 1, jump[0] - 1)
        if jump[2] == 1:
            self.lost_between = jump[4]
        if len(self.disorder) < MAX_DISORDER:
            self.disorder.append(entry)
        return True

    def _foreign(self, jump: tuple) -> None:
        """The jumped record carried a seq outside the sequence: no line was lost there."""
        self.lost -= jump[2]
        self.lost_between = jump[4]
        self._refill(jump[5], jump[2])
        self.odd += 1

    def skip_to(self, last_seq: int, n_steps: int) -> None:
        """A stretch read in bulk ended with ``last_seq``, ``n_steps`` step records counted by then."""
        if self.back is not None:   # the stretch went on from the record back: the jumped one was inserted
            self._settle_back(self.jump, False)
        self.jump = None            # (a jump before the stretch is lost lines: it ran on from the jumped seq)
        self.prev, self.steps_at_prev = last_seq, n_steps

    def warnings(self) -> list[str]:
        if self.back is not None:
            # nothing came after the record back: the last two records swapped, unless the jumped one skipped more
            # than one seq (an inserted line carrying exactly the next seq would be a coincidence)
            self._settle_back(self.jump, self.jump[2] == 1)
            self.jump = None
        out = []
        if self.odd:
            out.append(f"{self.odd} record(s) carry a seq outside the rank's sequence (foreign lines?)")
        if self.lost:
            a, b = self.lost_between
            out.append(f"{self.lost} record(s) missing by seq (lost lines), the first between seq {a} and seq {b}")
        return out
