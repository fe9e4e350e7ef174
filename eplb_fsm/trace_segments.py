"""Size-based rotation of a rank's trace file, and reading a rank's segments back in order.

A rank writes ``rank<NNNNN>.jsonl`` (the live segment; a joiner its own
``rank<NNNNN>.g<g>.jsonl``, rolled the same way). Once it holds more than ``max_bytes``,
the writer rolls it: ``.jsonl`` becomes ``.jsonl.1``, ``.jsonl.1`` becomes ``.jsonl.2``
and so on, the oldest beyond ``max_segments - 1`` rotated segments is deleted, and a new
live segment starts with a copy of the header marked ``"continued": true``
(docs/events.md, "Rotation"). A trace file therefore keeps at most ``max_segments``
segments, each of at most ``max_bytes`` plus the one write that took it past (a record, or
a ``steps`` run and its record): with the defaults 4 x (64 MiB + that write).

Oldest first, a rank's segments are ``.jsonl.<K-1>``, ..., ``.jsonl.1``, ``.jsonl``;
:func:`read_trace` reads them in that order. :func:`record_steps` says which engine steps
a record stands for (a ``steps`` run stands for ``count`` of them).
"""

from __future__ import annotations

import bisect
import glob
import json
import os
import re
from pathlib import Path

__all__ = ["DAMAGED", "DEFAULT_MAX_BYTES", "DEFAULT_MAX_SEGMENTS", "check_rotation", "read_rank_segments",
           "read_rank_text", "read_trace", "record_steps", "rotate", "segment_line", "segment_paths"]

DEFAULT_MAX_BYTES = 64 * 1024 * 1024   # a segment rolls at the first write past this size
DEFAULT_MAX_SEGMENTS = 4               # segments kept per trace file, the live one included

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

    Deletes the segment that would become the ``max_segments``-th; with ``max_segments == 1``
    the live file itself is deleted (the new segment starts empty).
    """
    if max_segments <= 1:
        path.unlink(missing_ok=True)
        return
    rotated_path(path, max_segments - 1).unlink(missing_ok=True)
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
    path = Path(path)
    rotated = []
    try:
        siblings = list(path.parent.glob(f"{glob.escape(path.name)}.*"))
    except OSError:
        siblings = []
    for other in siblings:
        m = _ROTATED.search(other.name)
        if m and other.name == f"{path.name}.{m.group(1)}" and other.is_file():
            rotated.append((int(m.group(1)), other))
    out = [p for _, p in sorted(rotated, reverse=True)]
    if path.is_file():
        out.append(path)
    return out


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
    paths = [Path(path)] if is_rotated_segment(path) else segment_paths(path) or [Path(path)]
    parts, starts, before = [], [], 0
    for one in paths:
        with open(one, encoding="utf-8", errors="replace") as fh:
            text = fh.read()
        parts.append(text if not text or text.endswith("\n") or one == paths[-1] else text + "\n")
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
    paths = segment_paths(path) if segments and not is_rotated_segment(path) else [Path(path)]
    if not paths:
        raise FileNotFoundError(f"no trace file at {path}")
    records: list[dict] = []
    bad = 0
    for one in paths:
        with open(one, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                line = line.strip()
                if not line:
                    continue
                if DAMAGED in line:
                    bad += 1
                    continue
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    bad += 1
    return records, bad
