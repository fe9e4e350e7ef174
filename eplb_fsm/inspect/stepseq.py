"""A session's own engine-step numbers: where they skip a number or go back.

Every engine step of a rank is in its trace ("Every engine step is in the trace",
docs/events.md): a ``step`` record, a ``steps`` run (``count`` consecutive numbers), or a
due ``step`` transition (the step that reached the interval). So a rank's step numbers run
on by one per engine step, and a skipped step still shows in them. ``StepSeq`` is told each
stretch of step records the walker reads (one record, a run, a bulk stretch of lines) with
how many step records were counted before it; the first number of a stretch must be the
last one checked plus the step records counted since (those read on the hot path, which
only takes a step whose number follows the record before it), plus at most one per
``step`` transition since (a due one is an engine step; a forced one, written by
``rearrange()`` with the next step's number, is not). A stretch whose last number is not
its first plus its count, minus one, broke inside. Each break is kept in
``RankSummary.step_breaks``.

``step_count_mismatch`` (``liveness``) uses them to break a tie: when as many ranks ended
at one final step as at another, the ranks whose own step numbers broke (and whose trace
lost no lines and holds none out of order, ``RankSummary.gaps`` and ``disorder``, which break
them too) are the odd ones.
"""

from __future__ import annotations

from typing import Any

from eplb_fsm.inspect.model import RankSummary

__all__ = ["MAX_BREAKS", "StepSeq", "own_steps_broken", "step_break_text"]

MAX_BREAKS = 5   # breaks kept per session (the first says where)


class StepSeq:
    """The engine-step numbers of one session, checked stretch by stretch (see the module docstring).

    While the numbers run on by one, a step record's number less the step records counted before it
    is the same for every one: ``base``. A caller may skip ``run`` for a stretch that starts at ``base``
    plus those counted when no state change came since the last call (``tlen``).
    """

    __slots__ = ("base", "tsteps", "tlen", "breaks")

    def __init__(self, breaks: list[dict]) -> None:
        self.base: int | None = None     # a step record's number less the step records counted before it
        self.tsteps = 0                  # `step` transitions among the first ``tlen`` state changes
        self.tlen = 0
        self.breaks = breaks

    def run(self, first: Any, last: Any, count: int, before: int, transitions: list) -> None:
        """``count`` step records numbered ``first`` .. ``last``, after ``before`` counted ones; ``transitions``:
        the session's state changes so far (``RankSummary.transitions``)."""
        if type(first) is not int or type(last) is not int:
            return
        t = self.tsteps
        if len(transitions) != self.tlen:
            t += sum(1 for tr in transitions[self.tlen:] if tr.trigger == "step")
            self.tlen = len(transitions)
        if self.base is not None and first - before != self.base:
            due = self.base + before
            if not due <= first <= due + t - self.tsteps:
                self._break(due - 1, first, due)
        if last - first != count - 1:
            self._break(first, last, first + count - 1, True)
        self.base, self.tsteps = last + 1 - before - count, t

    def _break(self, after: int, step: int, due: int, within: bool = False) -> None:
        if len(self.breaks) < MAX_BREAKS:
            self.breaks.append({"after": after, "step": step, "expected": due, "within": within})


def own_steps_broken(s: RankSummary) -> bool:
    """The session's own step numbers skip or go back, in a trace that lost no lines and holds none out of order."""
    return bool(s.step_breaks) and not s.gaps and not s.disorder


def step_break_text(s: RankSummary) -> str | None:
    """How the session's own step numbers break, or None (``own_steps_broken``)."""
    if not own_steps_broken(s):
        return None
    b = s.step_breaks[0]
    how = "skip" if b["step"] > b["expected"] else "go back"
    more = f" ({len(s.step_breaks) - 1} more)" if len(s.step_breaks) > 1 else ""
    since = "counting on from" if b.get("within") else "after"
    return (f"its own step numbers {how}: step {b['step']} where step {b['expected']} was due ({since} step "
            f"{b['after']}){more}")
