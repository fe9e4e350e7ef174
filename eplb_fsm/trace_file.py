"""The live file of one rank's trace: appended line by line, rolled by size, never a crash in the engine.

:class:`~eplb_fsm.trace.EventTrace` owns the records; this owns the bytes. Three rules:

- **A trace never stops the engine.** A write that fails (disk full, the folder removed, a
  file made read-only) is counted in ``errors`` and logged once through structlog; the
  record is dropped and the next one is tried again. A controller whose trace raised into
  its state machine would be left half-way through a transition, and its peers would fail.
- **A new session starts on a line of its own.** A file whose last line was torn (a rank
  killed mid-write, a full disk) gets a newline before anything is appended, so a restarted
  job's header is not glued to the broken line and lost.
- **Rolling never loses the live file.** If moving the segments fails, the live file is
  opened again all the same (:func:`eplb_fsm.trace_segments.rotate` does the moves).
"""

from __future__ import annotations

import os
from pathlib import Path

import structlog

from eplb_fsm import trace_segments

__all__ = ["TraceFile"]

_log = structlog.get_logger("eplb_fsm.trace")


class TraceFile:
    """Lines appended to ``path``; :meth:`write` says when the segment has passed ``max_bytes``."""

    def __init__(self, path: Path, max_bytes: int, max_segments: int) -> None:
        self.path, self.max_bytes, self.max_segments = path, max_bytes, max_segments
        self.errors = 0          # writes, rolls or reopens that failed (their records are lost)
        self.bytes = 0           # size of the live segment
        self.lines = 0           # lines written to the live segment since it was opened
        self._file = None
        self._sink = None
        self._torn = False       # a failed write may have left half a line: start the next on a new one
        self.open()              # errors here reach the caller: a trace_dir that cannot be written is bad input

    def open(self) -> None:
        with open(self.path, "ab") as raw:
            if raw.tell() and not _ends_with_newline(self.path):
                raw.write(b"\n")  # the last line was torn: this session starts on a line of its own
        self._file = open(self.path, "a", encoding="utf-8")
        self.bytes = self._file.tell()
        self.lines = 0
        # structlog's WriteLogger writes and flushes one message per call
        self._sink = structlog.WriteLogger(self._file)

    def write(self, text: str) -> bool:
        """Append ``text`` as one line (flushed); True when the live segment has grown past ``max_bytes``."""
        if self._sink is None:
            self._failed(OSError("the trace file could not be opened again"))
            return False
        if self._torn:
            text = "\n" + text
        try:
            self._sink.msg(text)
        except (OSError, ValueError) as exc:  # ValueError: the file was closed under us
            self._torn = True
            self._failed(exc)
            return False
        self._torn = False
        self.bytes += len(text) + 1      # ASCII JSON: characters are bytes
        self.lines += 1
        return self.bytes > self.max_bytes

    def roll(self) -> None:
        """Move the segments on by one and open a new, empty live segment (whatever the move did)."""
        try:
            self._file.close()
            trace_segments.rotate(self.path, self.max_segments)
        except OSError as exc:
            self._failed(exc)
        finally:
            try:
                self.open()
            except OSError as exc:
                self._sink = self._file = None
                self._failed(exc)

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError as exc:
                self._failed(exc)
        self._file = self._sink = None

    def _failed(self, exc: BaseException) -> None:
        self.errors += 1
        if self.errors == 1:  # once per trace: a full disk would otherwise log as often as it records
            _log.warning("eplb trace write failed; records are dropped while it fails", path=str(self.path),
                         error=f"{type(exc).__name__}: {exc}")


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as fh:
        fh.seek(-1, os.SEEK_END)
        return fh.read(1) == b"\n"
