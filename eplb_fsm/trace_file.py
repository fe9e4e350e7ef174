"""The live file of one rank's trace: appended line by line, rolled by size, never a crash in the engine.

:class:`~eplb_fsm.trace.EventTrace` owns the records; this owns the bytes. Four rules:

- **A trace never stops the engine.** A write that fails (disk full, a file made
  read-only) is counted in ``errors`` and its records are dropped; the next one is tried
  again, on a line of its own. Each line goes out in one unbuffered write call, so nothing
  of a failed write is kept back and written later: a counted record never reaches the
  file (``seq`` gaps name the lost ones). The failure is logged once through structlog, by
  a call that cannot raise either (:mod:`eplb_fsm.safe_log`: stdout is often on the same
  full disk). A controller whose trace raised into its state machine would be left
  half-way through a transition, and its peers would fail.
- **A lost live file is opened again.** Writes to a file that was removed (or whose folder
  was) succeed and reach nothing. At most every :data:`CHECK_S` seconds, before a record,
  :meth:`TraceFile.check` compares the open file with the one at ``path``; when they differ
  it counts an error, logs it and opens the path again. Before a trace's last write (its
  ``end``, or a close's pending steps) it looks whatever the time: no later record would find
  the loss. A live file that is not open (a roll whose reopen failed, or that a signal's
  exception interrupted) is opened again the same way, until it opens; the owner starts
  each such file with a continued header once its own header is out (before that, the
  header itself is the new file's first line).
- **A new session starts on a line of its own.** A file whose last line was torn (a rank
  killed mid-write, a full disk) gets a newline before anything is appended, so a restarted
  job's header is not glued to the broken line and lost.
- **Rolling never loses the live file, nor invents a segment.** If moving the segments fails
  (:func:`eplb_fsm.trace_segments.rotate` does the moves; a folder that refuses renames),
  the same live file is opened again and goes on growing past ``max_bytes``: no record is
  dropped, no new segment (nor continued header) is started, and :meth:`TraceFile.roll`
  says so. The roll is tried again once :data:`CHECK_S` seconds have passed or the file
  has grown by another ``max_bytes``; each failed try is counted in ``errors``. With
  ``max_segments == 1`` a roll deletes the live file, so it comes before the write that would
  pass ``max_bytes`` (:meth:`TraceFile.roll_first`), never after: the record is in the new file.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import structlog

from eplb_fsm import trace_segments
from eplb_fsm.safe_log import log_safely, retry_due

__all__ = ["CHECK_S", "FILE_LOST", "ROLL_FAILED", "TraceFile", "WRITE_FAILED"]

# at most this often (seconds of `clock`) the open live file is compared with the one at its path, and one that
# could not be opened is tried again: two stat calls a second instead of per record, and a missing folder is
# not retried (and counted) at every record
CHECK_S = 1.0
clock = time.monotonic   # module names, so that a test can hold time still

WRITE_FAILED = "eplb trace write failed; records are dropped while it fails"
FILE_LOST = "eplb trace file was removed; it is opened again (the records written to it since are lost)"
ROLL_FAILED = ("eplb trace roll failed; the live file goes on past max_bytes (no record is dropped) and the roll "
               "is tried again")

_log = structlog.get_logger("eplb_fsm.trace")


class TraceFile:
    """Lines appended to ``path``; :meth:`write` says when the segment has passed ``max_bytes``.

    The owner calls :meth:`check` before it makes each record, so that a live file opened
    again starts with what the owner writes first (its header), and writes its header when
    :attr:`empty` after a :meth:`roll`.
    """

    def __init__(self, path: Path, max_bytes: int, max_segments: int) -> None:
        self.path, self.max_bytes, self.max_segments = path, max_bytes, max_segments
        self.errors = 0          # failed writes (their records dropped), rolls, reopens; live files found removed
        self.bytes = 0           # size of the live segment
        self.lines = 0           # lines written to the live segment since it was opened
        self._file = None        # the live file (unbuffered), None while it is not open
        self._torn = False       # a failed write may have left half a line: start the next on a new one
        self._warned = False     # the write-failure warning got out
        self._next_check = 0.0   # clock() from which check() looks at the file again
        # after a failed roll: (clock() from which, or a size past which, the next roll is tried)
        self._roll_hold: tuple[float, int] | None = None
        self._roll_failures = 0
        self._roll_warned = False
        self.open()              # errors here reach the caller: a trace_dir that cannot be written is bad input

    def open(self) -> None:
        """Open ``path`` as the live file (a torn last line is ended first); OSError when it cannot be."""
        file = open(self.path, "ab", buffering=0)
        try:
            size = file.tell()
            if size and not _ends_with_newline(self.path):
                file.write(b"\n")  # the last line was torn: this session starts on a line of its own
                size += 1
        except BaseException:
            file.close()
            raise
        self.bytes, self.lines, self._torn = size, 0, False
        self._next_check = clock() + CHECK_S
        # last and in one step: an exception (a signal's) anywhere before leaves no half-opened state behind
        self._file = file

    def write(self, text: str) -> bool:
        """Append ``text`` as one line, in one write call; True when the live segment has grown past ``max_bytes``."""
        file = self._file
        if file is None:
            self._failed(OSError(errno.EBADF, "the live trace file is not open (tried again at the next check)"))
            return False
        data = (("\n" + text) if self._torn else text).encode() + b"\n"
        done = 0
        try:
            while done < len(data):   # a regular file takes it all at once, short of a full disk or a signal
                n = file.write(data[done:] if done else data)
                if not n:
                    raise OSError(errno.EIO, "the trace write made no progress")
                done += n
        except (OSError, ValueError) as exc:  # ValueError: the file was closed under us
            self._failed(exc)
            return False
        finally:
            if done:   # what did reach the file; a line cut short leaves the next record to start a new one
                self.bytes += done
                self._torn = data[done - 1] != 0x0A
        self.lines += 1
        # one segment rolls before the write instead (roll_first): a roll after it would delete this very line
        return self.max_segments > 1 and self.bytes > self.max_bytes and self._roll_due()

    def roll_first(self, size: int) -> bool:
        """With ``max_segments == 1`` only: True when a write of ``size`` characters would take the live segment
        past ``max_bytes`` and it holds more than its first line; the owner rolls (deleting the segment) before
        that write, so the write lands in the new segment instead of being deleted by the roll it brings about."""
        return (self.max_segments == 1 and self._file is not None and self.lines > 1
                and self.bytes + size + 2 > self.max_bytes and self._roll_due())

    @property
    def empty(self) -> bool:
        """The live file is open and holds nothing yet (a new segment)."""
        return self._file is not None and self.bytes == 0

    def _roll_due(self) -> bool:
        hold = self._roll_hold   # a roll failed: not again at every record, but after a while or another segment
        return hold is None or self.bytes > hold[1] or clock() >= hold[0]

    def check(self, force: bool = False) -> bool:
        """At most every :data:`CHECK_S` seconds: open the live file again when it is not open or is no longer the
        file at ``path`` (removed, its folder removed or replaced). True when a live file was opened again.

        ``force``: look now, whatever the last look (a trace's last write, its ``end``: nothing comes after it
        to find the loss, so a file removed since the last look would take that record with it)."""
        now = clock()
        if now < self._next_check and not force:
            return False
        self._next_check = now + CHECK_S
        file = self._file
        if file is not None:
            if not _lost(file, self.path):
                return False
            self._file = None
            self.errors += 1   # the records written to it since it was removed are lost with it
            log_safely(_log, "warning", FILE_LOST, path=str(self.path))
            try:
                file.close()
            except OSError:
                pass           # counted already: the file is gone
        try:
            self.open()
        except OSError as exc:
            self._failed(exc)
            return False
        return True

    def roll(self) -> bool:
        """Move the segments on by one and open the new, empty live segment; True when a new segment starts
        (the segments moved, or the live file was gone already: its folder removed).

        False when the move failed with the live file still there: that file is opened again, its
        ``lines`` kept, and the next roll waits (module docstring). A live file that cannot be opened (the folder
        removed), or a roll that an exception interrupts (a signal handler's), leaves the live
        file closed: :meth:`check` opens it.
        """
        self._next_check = 0.0   # a roll that is interrupted: the next record opens the live file
        lines = self.lines
        self._drop()
        try:
            trace_segments.rotate(self.path, self.max_segments)
            moved, self._roll_hold = True, None
        except OSError as exc:
            moved = not os.path.exists(self.path)   # gone (its folder removed): a new segment starts all the same
            if moved:
                self._failed(exc)
            else:
                self._roll_hold = (clock() + CHECK_S, self.bytes + self.max_bytes)
                self._roll_failed(exc)
        try:
            self.open()
        except OSError as exc:
            self._next_check = clock() + CHECK_S
            self._failed(exc)
            return moved
        if not moved and self.bytes:
            self.lines = lines   # the segment goes on: its header is still its first line
        return moved

    def _roll_failed(self, exc: OSError) -> None:
        self.errors += 1
        self._roll_failures += 1   # logged as _failed() logs (once, retried at the 2nd, 4th... failure)
        if not self._roll_warned and retry_due(self._roll_failures):
            self._roll_warned = log_safely(_log, "warning", ROLL_FAILED, path=str(self.path), retry_s=CHECK_S,
                                           error=f"{type(exc).__name__}: {exc}")

    def close(self) -> None:
        self._next_check = float("inf")   # a closed trace file is never opened again
        self._drop()

    def _drop(self) -> None:
        file, self._file = self._file, None
        if file is not None:
            try:
                file.close()
            except OSError as exc:
                self._failed(exc)

    def _failed(self, exc: BaseException) -> None:
        self.errors += 1
        # once per trace (a full disk would otherwise log as often as it records); a warning that did not get out
        # (stdout on the same full disk, a closed pipe) is tried again at the 2nd, 4th, 8th... failure
        if not self._warned and retry_due(self.errors):
            self._warned = log_safely(_log, "warning", WRITE_FAILED, path=str(self.path),
                                      error=f"{type(exc).__name__}: {exc}")


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as fh:
        fh.seek(-1, os.SEEK_END)
        return fh.read(1) == b"\n"


def _lost(file, path: Path) -> bool:
    """True when the open ``file`` is no longer the file at ``path`` (unlinked, its folder removed, replaced)."""
    try:
        mine = os.fstat(file.fileno())
    except (OSError, ValueError):   # ValueError: closed under us
        return True
    if mine.st_nlink == 0:
        return True
    try:
        there = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return True
    except OSError:                 # cannot tell (a permission changed): go on writing where it goes
        return False
    return (there.st_ino, there.st_dev) != (mine.st_ino, mine.st_dev)
