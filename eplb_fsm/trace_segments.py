"""Size-based rotation of a rank's trace file, and reading a rank's segments back in order.

A rank writes ``rank<NNNNN>.jsonl`` (the live segment; a joiner its own
``rank<NNNNN>.g<g>.jsonl``, rolled the same way). Once it holds more than ``max_bytes``,
the writer rolls it: ``.jsonl`` becomes ``.jsonl.1``, ``.jsonl.1`` becomes ``.jsonl.2``
and so on, the oldest beyond ``max_segments - 1`` rotated segments is deleted (with every
older one a run with a larger ``max_segments`` left in the folder), and a new live segment
starts with a copy of the header marked ``"continued": true`` (docs/events.md,
"Rotation"). A trace file therefore keeps at most ``max_segments``
segments, each of at most ``max_bytes`` plus the one write that took it past (a record, or
a ``steps`` run and its record): with the defaults 4 x (64 MiB + that write). With
``max_segments == 1`` the roll deletes the live file, so it comes before the write that would
pass ``max_bytes`` (:meth:`eplb_fsm.trace_file.TraceFile.roll_first`): that write opens the new file.

Oldest first, a rank's segments are ``.jsonl.<K-1>``, ..., ``.jsonl.1``, ``.jsonl``;
:func:`read_trace` reads them in that order. A running writer may roll the file while it is
read (names move on between the listing and the reads): a reader lists the segments again
after reading them, and reads again when another file took a name (at most
:data:`READ_ATTEMPTS` times; the last read is returned as it is). :func:`record_steps` says
which engine steps a record stands for (a ``steps`` run stands for ``count`` of them).
"""

from __future__ import annotations

import bisect
import glob
import json
import os
import re
import stat
import time
from pathlib import Path
from typing import Any, Callable

__all__ = ["DAMAGED", "DEFAULT_MAX_BYTES", "DEFAULT_MAX_SEGMENTS", "READ_ATTEMPTS", "check_rotation",
           "read_rank_segments", "read_rank_text", "read_segments", "read_trace", "record_steps", "rotate",
           "segment_line", "segment_paths"]

DEFAULT_MAX_BYTES = 64 * 1024 * 1024   # a segment rolls at the first write past this size
DEFAULT_MAX_SEGMENTS = 4               # segments kept per trace file, the live one included
# reads of a rank's segments while its writer rolls them, at most (a roll takes microseconds; a read that keeps
# meeting one is returned as it is after this many), and the wait before the n-th retry (n x this)
READ_ATTEMPTS = 6
READ_RETRY_S = 0.002

_ROTATED = re.compile(r"\.(\d+)$")


def check_rotation(max_bytes: object, max_segments: object) -> tuple[int, int]:
    """``(max_bytes, max_segments)`` as ints (>= 1024 and >= 1); ValueError naming the field otherwise."""
    for name, value, least in (("max_bytes", max_bytes, 1024), ("max_segments", max_segments, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"trace {name} must be an int >= {least}, got {value!r}")
    return int(max_bytes), int(max_segments)


def rotated_path(path: Path, index: int) -> Path:
    """The ``index``-th rotated segment of ``path`` (1 = the newest rotated one)."""
    return path.with_name(f"{path.name}.{index}")


def rotate(path: Path, max_segments: int) -> None:
    """Shift the segments of ``path`` by one (the caller has closed the live file).

    Deletes the segment that would become the ``max_segments``-th, and every higher-numbered
    one (a folder reused with a smaller ``max_segments`` holds them: kept, they would pass the
    cap and read as this run's oldest history); with ``max_segments == 1`` the live file
    itself is deleted too (the new segment starts empty).
    """
    for index, old in _numbered(path):
        if index >= max_segments - 1 and not (old.is_dir() and not old.is_symlink()):
            old.unlink(missing_ok=True)
    if max_segments <= 1:
        path.unlink(missing_ok=True)
        return
    for index in range(max_segments - 2, 0, -1):
        older = rotated_path(path, index)
        if older.exists():
            os.replace(older, rotated_path(path, index + 1))
    os.replace(path, rotated_path(path, 1))


def segment_paths(path: str | os.PathLike) -> list[Path]:
    """Every segment of the rank file ``path`` that exists, oldest first (the live file last).

    Rotated segments are ordered by their number, highest (oldest) first. A hole in the
    numbering does not end the list: a writer killed in the middle of :func:`rotate` leaves
    one (``.jsonl.2`` and ``.jsonl.3`` moved on, ``.jsonl.1`` not yet there, or no live
    file), and every segment left is still that rank's history, in that order.
    """
    return [one for one, _ in _listing(Path(path))]


def _numbered(path: Path) -> list[tuple[int, Path]]:
    """``(n, path)`` for every ``<name>.<n>`` next to ``path`` (n decimal digits), in no order."""
    try:
        siblings = list(path.parent.glob(f"{glob.escape(path.name)}.*"))
    except OSError:
        return []
    out = []
    for other in siblings:
        m = _ROTATED.search(other.name)
        if m and other.name == f"{path.name}.{m.group(1)}":
            out.append((int(m.group(1)), other))
    return out


def _listing(path: Path) -> list[tuple[Path, os.stat_result]]:
    """:func:`segment_paths` with each segment's ``stat`` (what a reader compares after reading)."""
    rotated = []
    for index, other in _numbered(path):
        if (st := _regular(other)) is not None:
            rotated.append((index, other.name, other, st))
    out = [(one, st) for _, _, one, st in sorted(rotated, key=lambda e: e[:2], reverse=True)]
    if (st := _regular(path)) is not None:
        out.append((path, st))
    return out


def _regular(path: Path) -> os.stat_result | None:
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return st if stat.S_ISREG(st.st_mode) else None


def is_rotated_segment(path: str | os.PathLike) -> bool:
    """True for a ``<name>.jsonl.<n>`` file (read through its live file, never on its own)."""
    name = Path(path).name
    return bool(_ROTATED.search(name)) and ".jsonl." in name


def record_steps(record: dict) -> range:
    """The engine steps a record stands for: a ``steps`` run its ``count`` steps from ``step``,
    a ``step`` record its one step, any other record none (``range`` objects: nothing is expanded)."""
    event = record.get("event")
    if event == "steps":
        return range(record["step"], record["step"] + record["count"])
    if event == "step":
        return range(record["step"], record["step"] + 1)
    return range(0)


#: what a byte that is not UTF-8 is read as; records are written ASCII-only, so a line
#: holding one is damaged (a bad disk block) even where it would still parse as JSON
DAMAGED = "\ufffd"


def read_rank_text(path: str | os.PathLike) -> str:
    """The text of a rank's trace: its segments (:func:`segment_paths`) joined oldest first.

    A rotated segment passed itself is read alone. Each segment's text is ended by a newline
    so that a line never runs into the next segment's header. A line with bytes that are not
    UTF-8 comes back as a lone :data:`DAMAGED`, which no reader parses: it is counted as an
    unreadable line instead of read with a changed value.
    """
    return read_rank_segments(path)[0]


def read_rank_segments(path: str | os.PathLike) -> tuple[str, list[tuple[str, int]]]:
    """:func:`read_rank_text`, with where each segment begins: ``(file name, lines of the text before it)``
    per segment, oldest first (:func:`segment_line` turns a line of the text into its file and line)."""
    path = Path(path)
    texts = [(path, _read(path))] if is_rotated_segment(path) else read_segments(path) or [(path, _read(path))]
    parts, starts, before = [], [], 0
    for i, (one, text) in enumerate(texts):
        parts.append(text if not text or text.endswith("\n") or i == len(texts) - 1 else text + "\n")
        starts.append((one.name, before))
        before += parts[-1].count("\n")
    text = "".join(parts)
    if DAMAGED in text:  # one scan, and none at all for an ASCII text (str keeps its widest char)
        text = "\n".join(DAMAGED if DAMAGED in line else line for line in text.split("\n"))
    return text, starts


def segment_line(starts: list[tuple[str, int]], line: int) -> tuple[str, int]:
    """The segment file and its own line (1-based) of ``line`` (1-based) of the joined text; ``starts``:
    :func:`read_rank_segments`'s."""
    i = bisect.bisect_right([before for _, before in starts], line - 1) - 1
    name, before = starts[max(i, 0)]
    return name, line - before


def read_trace(path: str | os.PathLike, segments: bool = True) -> tuple[list[dict], int]:
    """Read one rank's trace: (records, number of unreadable lines skipped).

    ``path`` is the live file ``rank<NNNNN>.jsonl``; with ``segments`` its rotated segments
    are read first, oldest first (a rotated segment passed itself is read alone). Records
    are returned as written (``steps`` runs stay runs). A truncated last line (a rank
    killed mid-write) or a line of bytes that are not UTF-8 (a damaged disk block) is
    counted, not fatal.
    """
    path = Path(path)
    if segments and not is_rotated_segment(path):
        parsed = read_segments(path, _parse_lines)
    else:
        with open(path, encoding="utf-8", errors="replace") as fh:
            parsed = [(path, _parse_lines(fh))]
    if not parsed:
        raise FileNotFoundError(f"no trace file at {path}")
    records = [record for _, (some, _bad) in parsed for record in some]
    return records, sum(bad for _, (_some, bad) in parsed)


def _parse_lines(lines: Any) -> tuple[list[dict], int]:
    """The records of an open segment, line by line (never its whole text at once), and its unreadable lines."""
    records: list[dict] = []
    bad = 0
    for line in lines:
        line = line.strip()
        if not line:
            continue
        if DAMAGED in line:
            bad += 1
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):   # garbage, or nested past json's depth limit
            record = None
        if type(record) is dict:
            records.append(record)
        else:   # a line that parses but is no object (a list, a number) is no record either
            bad += 1
    return records, bad


def _whole(fh: Any) -> str:
    return fh.read()


def read_segments(path: str | os.PathLike, read: Callable[[Any], Any] = _whole) -> list[tuple[Path, Any]]:
    """``(segment, its text)`` for every segment of the live file ``path``, oldest first (``[]``: none there);
    ``read(open file)`` gives what is kept of each segment instead of its text (a parser that goes line by line
    keeps no segment's whole text).

    The segments as they stood at one moment of a running writer: they are listed, read, and
    listed again, and read again (after a short wait) when a roll came in between: a listed
    file gone, or a name that another file took (not the same ``(st_dev, st_ino)``, a size
    that shrank, or a rotated segment whose size or ``st_mtime_ns`` changed). The live file
    growing is not a change. After :data:`READ_ATTEMPTS` reads that each met a roll, the last
    one is returned as it is (what was there to read; a listed file gone is left out).
    """
    path = Path(path)
    texts: list[tuple[Path, Any]] | None = []
    for attempt in range(READ_ATTEMPTS):
        last = attempt == READ_ATTEMPTS - 1
        listed = _listing(path)
        texts = _read_listed(listed, last, read)
        if texts is not None and (last or _unchanged(listed, _listing(path), path)):
            break
        time.sleep(READ_RETRY_S * (attempt + 1))
    return texts or []


def _read(path: Path) -> str:
    with open(path, encoding="utf-8", errors="replace") as fh:
        return fh.read()


def _read_listed(listed: list[tuple[Path, os.stat_result]], as_is: bool,
                 read: Callable[[Any], Any]) -> list[tuple[Path, Any]] | None:
    """``read`` of each listed segment; None as soon as one is gone or is another file (unless ``as_is``)."""
    texts = []
    for one, listed_stat in listed:
        try:
            fh = open(one, encoding="utf-8", errors="replace")
        except FileNotFoundError:
            if as_is:
                continue
            return None
        with fh:
            if not as_is and not _same_file(listed_stat, os.fstat(fh.fileno())):
                return None
            texts.append((one, read(fh)))
    return texts


def _same_file(before: os.stat_result, now: os.stat_result) -> bool:
    # segments only grow (the live one) or keep their bytes (a rotated one) under one name while that name holds them
    return (before.st_dev, before.st_ino) == (now.st_dev, now.st_ino) and now.st_size >= before.st_size


def _unchanged(before: list[tuple[Path, os.stat_result]], after: list[tuple[Path, os.stat_result]],
               live: Path) -> bool:
    """True when no roll came between the two listings (module docstring: what counts as one)."""
    if [one for one, _ in before] != [one for one, _ in after]:
        return False
    for (one, was), (_, now) in zip(before, after):
        if not _same_file(was, now):
            return False
        if one != live and (was.st_size, was.st_mtime_ns) != (now.st_size, now.st_mtime_ns):
            return False
    return True
