"""Stage 1 of the replay, in bulk: runs of compact step lines between two other records.

Most lines of a compact trace are step records of a step that kept the state, exactly as
``EventTrace`` writes them::

    {"ts":T,"rank":R,"world":W,"event":"step","state":"S","step":N,"seq":Q}

``feed_run`` checks a run of them as a whole, by one regex match in C (which also takes
the optional ``dummy`` flag and trailing blanks), with the ``seq`` values read by a second
regex (``seqs_follow``, which also records a step back as disorder), and counts it
(``Walker.plain_steps``) instead of parsing each line. A run that does not pass is parsed
and replayed line by line.
"""

from __future__ import annotations

import re
from typing import Callable

__all__ = ["feed_run", "seqs_follow", "step_run"]

# A compact step record exactly as EventTrace writes it (keys in emit order, nothing but
# an optional dummy flag after seq). A run of such lines in the replayed state is checked
# by one regex match in C instead of a json.loads per line; anything else is parsed.
_NUM = r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?"
_STEP_LINE = (r'\{"ts":' + _NUM + r',"rank":-?\d+,"world":\d+,"event":"step","state":"%s","step":-?\d+,'
              r'"seq":\d+(?:,"dummy":(?:true|false))?\}[ \t\r]*\n')
_STEP_RUNS: dict[str, re.Pattern] = {}
_SEQ = re.compile(r'"seq":(\d+)')


def step_run(state: str) -> re.Pattern:
    """The regex of a run of compact step lines stamped ``state`` (each line with its newline)."""
    pattern = _STEP_RUNS.get(state)
    if pattern is None:
        pattern = _STEP_RUNS[state] = re.compile("(?:" + _STEP_LINE % re.escape(state) + ")*")
    return pattern


def seqs_follow(w, run: str, count: int, first_line: int) -> bool:
    """The run's ``seq`` values go up by one from what the session's next record must carry.

    When they do not, a step back (lines out of order) is recorded with its line; the
    caller replays the run line by line (which counts lost lines at the next other record).
    """
    seqs = list(map(int, _SEQ.findall(run)))
    first = w.next_seq()
    if first is None:
        first = seqs[0]
    if seqs == list(range(first, first + count)):
        return True
    for j in range(1, len(seqs)):
        if seqs[j] <= seqs[j - 1] and len(w.s.disorder) < 20:
            w.line = first_line + j
            w.s.disorder.append({"where": w.where(), "line": w.line, "seq": seqs[j], "expected": seqs[j - 1] + 1,
                                 "event": "step"})
            break
    return False


def feed_run(w, lines: list[str], start: int, end: int, parse: Callable[[str], dict | None]) -> int:
    """Replay lines[start:end] (step lines between two other records) into walker ``w``; returns the
    unreadable lines. ``parse`` reads one line (None: unreadable)."""
    while end > start and not lines[end - 1].strip():
        end -= 1  # the empty string after the file's final newline, trailing blank lines
    if end <= start:
        return 0
    if w.state is not None:
        run = "\n".join(lines[start:end]) + "\n"
        if step_run(w.state).fullmatch(run) is not None and seqs_follow(w, run, end - start, start + 1):
            if w.plain_steps(end - start):
                w.saw_line(lines[start])
                w.saw_line(lines[end - 1])
                if w.first is None:
                    w.first = parse(lines[start])
                w.last, w.last_line = None, lines[end - 1]
                return 0
    bad = 0
    for n, line in enumerate(lines[start:end], start + 1):
        if line.strip():
            rec = parse(line)
            if rec is None:
                bad += 1
            else:
                w.line = n
                w.record(rec)
    return bad
