"""Stage 1 of the replay, in bulk: runs of compact step lines between two other records.

Most lines of a compact trace are step records of a step that kept the state, exactly as
``EventTrace`` writes them::

    {"ts":T,"rank":R,"world":W,"event":"step","state":"S","step":N,"seq":Q}

``feed_run`` checks a run of them as a whole and counts it (``Walker.plain_steps``)
instead of parsing each line:

- first against ``StepLines``, made once per file with a few numpy passes over its bytes:
  every line with each run of digits cut to one ``0`` (its "shape"), and the number each
  line ends with before its closing brace (a step line's ``seq``). A run passes when every
  line has the shape of a step line stamped with the replayed state (ts with a fraction,
  rank, world, step and seq unsigned integers, nothing else) and the seqs run on by one
  from the walker's next one;
- else by one regex match of the whole run, which also takes the optional ``dummy`` flag,
  signs and trailing blanks, with the ``seq`` values read by a second regex
  (``seqs_follow``).

A run that passes neither is parsed and replayed line by line.
"""

from __future__ import annotations

import operator
import re
from bisect import bisect_left
from itertools import compress
from typing import Callable

import numpy as np

from eplb_fsm.inspect.records import SILENCE_S

__all__ = ["STEP_NO", "StepLines", "calm", "calm_lines", "feed_run", "seqs_follow", "step_of", "step_run"]

# A compact step record exactly as EventTrace writes it (keys in emit order, nothing but
# an optional dummy flag after seq). A run of such lines in the replayed state is checked
# by one regex match in C instead of a json.loads per line; anything else is parsed.
_NUM = r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?"
_STEP_LINE = (r'\{"ts":' + _NUM + r',"rank":-?\d+,"world":\d+,"event":"step","state":"%s","step":-?\d+,'
              r'"seq":\d+(?:,"dummy":(?:true|false))?\}[ \t\r]*\n')
_STEP_RUNS: dict[str, re.Pattern] = {}
_SEQ = re.compile(r'"seq":(\d+)')
STEP_NO = re.compile(r'"step":(-?\d+)')


def step_run(state: str) -> re.Pattern:
    """The regex of a run of compact step lines stamped ``state`` (each line with its newline)."""
    pattern = _STEP_RUNS.get(state)
    if pattern is None:
        pattern = _STEP_RUNS[state] = re.compile("(?:" + _STEP_LINE % re.escape(state) + ")*")
    return pattern


_MAX_DIGITS = 18    # longer numbers do not fit an int64: such a line is left to the regex


_ZERO_DIGITS = bytes.maketrans(b"123456789", b"000000000")


def _shape_of(raw: bytes) -> bytes:
    """``raw`` with every run of ASCII digits cut to one ``0``: digits made zeros (one C pass), then every
    zero that follows a zero dropped (numpy)."""
    zeros = np.frombuffer(raw.translate(_ZERO_DIGITS), np.uint8)
    keep = np.empty(len(zeros), bool)
    keep[:1] = True
    np.not_equal(zeros[1:], 48, out=keep[1:])
    keep[1:] |= zeros[:-1] != 48
    return zeros[keep].tobytes()


_PAD = 32          # zero bytes either side of a file's bytes: every index read stays inside


def _rough_times(padded: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """The ``ts`` of each line laid out ``{"ts":DDDDDDDDDD.D`` (ten digits: a time of this century), read to
    within 0.1 s (its tenths); NaN for a line laid out otherwise."""
    at = starts + 6
    whole = np.zeros(len(at))
    ok = np.ones(len(at), bool)
    for k in range(10):
        digit = padded[at + k] - np.uint8(48)     # (uint8: bytes below "0" wrap round to large values)
        ok &= digit < 10
        whole = whole * 10 + digit
    tenths = padded[at + 11] - np.uint8(48)
    ok &= (padded[at + 10] == 46) & (tenths < 10)
    return np.where(ok, whole + tenths / 10, np.nan)


class StepLines:
    """The shape of every line of one file and the number each ends with, for ``feed_run``.

    Lines are those of ``text.split("\n")``; a newline byte never occurs inside a UTF-8
    character, so the lines of the encoded bytes are the same lines. ``of_lines`` makes one
    over a file's lines but those listed in ``other`` (its records that are no step lines, which
    no run holds): a third of a compact file's bytes that the numpy passes then skip.
    """

    other: list[int] = []     # file lines left out (sorted): line i of the file is line i - (those before it)

    @classmethod
    def of_lines(cls, lines: list[str], other: list[int]) -> "StepLines":
        """``StepLines`` of ``lines`` but ``other`` (sorted indices); ``follow`` takes file line numbers."""
        keep = bytearray(b"\x01") * len(lines)
        for i in other:
            keep[i] = 0
        known = cls("\n".join(compress(lines, keep)))
        known.other = other
        return known

    def __init__(self, text: str) -> None:
        raw = text.encode("utf-8", "replace")
        data = np.frombuffer(raw, np.uint8)
        self.shape = _shape_of(raw)
        ends = np.flatnonzero(np.frombuffer(self.shape, np.uint8) == 10)
        self.shape_start = np.concatenate(([0], ends + 1))
        self.shape_end = np.concatenate((ends, [len(self.shape)]))
        padded = np.concatenate((np.zeros(_PAD, np.uint8), data, np.zeros(_PAD, np.uint8)))
        line_end = np.concatenate((np.flatnonzero(data == 10), [len(data)])) + _PAD
        # the number before each line's last byte (a step line's seq, before its "}")
        tail = np.zeros(len(line_end), np.int64)
        scale = 1
        going = np.ones(len(line_end), bool)
        for k in range(_MAX_DIGITS + 1):
            byte = padded[np.maximum(line_end - 2 - k, 0)] - np.uint8(48)
            going &= byte < 10
            if not going.any():
                break
            if k == _MAX_DIGITS:
                tail[going] = -1      # too long: no seq this check vouches for
                break
            tail += np.where(going, byte.astype(np.int64) * scale, 0)
            scale *= 10
        self.tail = tail
        # a line and the next: seq up by one and no silence between them (times read to 0.1 s: a gap within
        # 0.2 s of SILENCE_S, or a time laid out otherwise, is left to the exact paths)
        ts = _rough_times(padded, np.concatenate(([_PAD], line_end[:-1] + 1)))
        self.next_follows = np.concatenate(((np.diff(tail) == 1) & (np.diff(ts) < SILENCE_S - 0.2), [False]))
        self._expected: dict[str, bytes] = {}

    def step_shape(self, state: str) -> bytes:
        """The shape of a compact step line stamped ``state``."""
        shape = self._expected.get(state)
        if shape is None:
            line = '{"ts":0.0,"rank":0,"world":0,"event":"step","state":"%s","step":0,"seq":0}' % state
            shape = self._expected[state] = _shape_of(line.encode("utf-8", "replace"))
        return shape

    def follow(self, start: int, end: int, state: str, first: int | None) -> bool:
        """Lines[start:end] are compact step lines stamped ``state`` whose seqs run on by one from
        ``first`` (None: from the first line's)."""
        n = end - start
        if self.other:
            skipped = bisect_left(self.other, start)
            if skipped < len(self.other) and self.other[skipped] < end:
                return False      # a line left out lies inside: no run of step lines
            start, end = start - skipped, end - skipped
        one = self.step_shape(state)
        if self.shape[self.shape_start[start]:self.shape_end[end - 1]] != b"\n".join([one] * n):
            return False
        tail = self.tail
        if first is not None and tail[start] != first or tail[start] < 0:
            return False
        return n == 1 or bool(self.next_follows[start:end - 1].all())


_TS = re.compile(r'^\{"ts":([^,]*),', re.M)


def calm_lines(lines: list[str], start: int, end: int) -> bool:
    """``calm`` for lines[start:end], a long stretch, reading few of its times: a rank's times only go forward,
    so a part whose first and last lines are at most SILENCE_S apart holds no longer gap; a part further
    apart is halved until its halves are that close, or a gap between two neighbouring lines is found."""
    def ts(i: int) -> float:
        line = lines[i]
        if not line.startswith('{"ts":'):
            raise ValueError(line[:20])
        return float(line[6:line.index(",", 6)])

    try:
        parts = [(start, end - 1, ts(start), ts(end - 1))]
        while parts:
            a, b, ta, tb = parts.pop()
            if tb - ta <= SILENCE_S:
                continue
            if b - a <= 1:
                return False
            m = (a + b) // 2
            tm = ts(m)
            parts += [(a, m, ta, tm), (m, b, tm, tb)]
    except ValueError:   # a line laid out otherwise: the exact paths read it
        return False
    return True


def calm(run: str) -> bool:
    """No two consecutive lines of ``run`` further apart in time than SILENCE_S (a silence inside a run
    is kept by the line-by-line path, with the records either side)."""
    try:
        ts = list(map(float, _TS.findall(run)))
    except ValueError:   # a time that is no number: the exact paths warn about it
        return False
    return not ts or max(map(operator.sub, ts[1:], ts[:-1]), default=0.0) <= SILENCE_S


def seqs_follow(w, run: str, count: int) -> bool:
    """The run's ``seq`` values go up by one from what the session's next record must carry.

    When they do not, the caller replays the run line by line, which checks each step record's
    ``seq`` (``seqcheck``: lost lines, disorder with its line).
    """
    seqs = list(map(int, _SEQ.findall(run)))
    first = w.next_seq()
    if first is None:
        first = seqs[0]
    return seqs == list(range(first, first + count))


def step_of(line: str) -> int | None:
    """The ``step`` of a step line (read, not parsed)."""
    m = STEP_NO.search(line)
    return int(m.group(1)) if m else None


def feed_run(w, lines: list[str], start: int, end: int, parse: Callable[[str], dict | None],
             known: StepLines | None = None) -> int:
    """Replay lines[start:end] (step lines between two other records) into walker ``w``; returns the
    unreadable lines. ``parse`` reads one line (None: unreadable); ``known``: the file's ``StepLines``.
    Taken in bulk only with no ``seq`` jump open, as ``diagnose()``'s record-by-record replay sees it."""
    while end > start and not lines[end - 1].strip():
        end -= 1  # the empty string after the file's final newline, trailing blank lines
    if end <= start:
        return 0
    # a jump forward still open (lost lines, or the first half of a swap or an inserted line) is settled by the
    # records after it, one by one: a run counted in bulk would leave it open for a later line back to misread
    if w.state is not None and w.seqs.jump is None:
        if (known is not None and known.follow(start, end, w.state, w.next_seq())) or (
                step_run(w.state).fullmatch(run := "\n".join(lines[start:end]) + "\n") is not None
                and seqs_follow(w, run, end - start) and calm(run)):
            if w.plain_steps(end - start):
                w.saw_run(lines[start], lines[end - 1])
                w.step_seq.run(step_of(lines[start]), step_of(lines[end - 1]), end - start,
                               w.n_steps + w.run_steps - (end - start), w.s.transitions)
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
