"""Per-rank event trace: one JSON line per transition and per collective.

Every record carries ``ts``, ``rank``, ``world``, ``event``, ``state``, ``step`` and
``seq`` (this rank's event counter); collectives add ``op``, ``group``, ``cseq`` (a
counter per group), ``shape`` and ``dtype``, and come as a ``collective_start`` /
``collective_end`` pair (or ``collective_error``). The schema is in docs/events.md.

How a rank's trace ends (docs/events.md, "Liveness and endings"): an orderly ending
writes one ``end`` record (``how``: ``closed``, ``exception`` or ``signal``) and nothing
after it; a trace without ``end`` belongs to a rank that died or was still running.
``alive`` records (written by :mod:`eplb_fsm.liveness`, a background thread) carry the
open collective, if any, so a reader can tell a frozen rank from the ranks waiting on it.

Each rank writes one JSONL file (:mod:`eplb_fsm.trace_file`; a joiner: its own,
``trace_path(..., generation)``). Every record goes out at once, in one unbuffered write
(a rank killed mid-collective still leaves the start record on disk), except quiet engine
steps: :meth:`EventTrace.count_step` only counts, and the counted steps reach the file as
one ``steps`` run record (first step, count, dummies) right before the next other record,
at every :meth:`EventTrace.flush` (the liveness thread flushes every 1.5 intervals while
steps advance) and at ``end``/close (docs/events.md, "Runs of quiet steps"). Files roll by
size (:mod:`eplb_fsm.trace_segments`). One open trace per file, across processes too (a lock
file), none written from a forked child (:mod:`eplb_fsm.trace_owners`). A record is encoded
before anything is counted, and a value JSON cannot hold never raises (:mod:`eplb_fsm.trace_encode`).
The library never calls ``structlog.configure()``.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from eplb_fsm import trace_owners, trace_segments
from eplb_fsm.trace_file import TraceFile
from eplb_fsm.trace_owners import end_open_traces  # noqa: F401  (re-exported: a signal handler's call)
from eplb_fsm.trace_runs import DUMMY, StepRun
from eplb_fsm.trace_segments import read_trace, record_steps  # noqa: F401  (re-exported)
from eplb_fsm.trace_encode import check_fields
from eplb_fsm.trace_fields import (  # noqa: F401  (re-exported: the trace's public names)
    COLLECTIVE_FIELDS, END_HOWS, SCHEMA_VERSION, CollectiveBrackets, OpenCollective, alive_fields, check_identity,
    collective_fields, config_hash, continued_fields, encode_record, end_fields, exception_text, header_fields,
    json_default, machine_after, trace_path,
)


# record keys every reader may rely on (docs/events.md documents each)
BASE_FIELDS = ("ts", "rank", "world", "event", "state", "step", "seq")
# a run of counted steps is written once it holds this many, flusher or not: a rank
# without a liveness thread loses at most this many steps when killed
MAX_RUN = 1 << 16
END_LOCK_WAIT_S = 1.0   # end() from a signal handler: past this the lock is its own thread's; defer


class EventTrace(CollectiveBrackets):
    """The trace writer of one rank; its methods are safe from several threads.

    ``state`` and ``step`` are context the owner updates (``set_context``) so that
    every record is stamped without the caller repeating them. With
    ``trace_dir=None`` nothing is written, but counters and ``last_collective`` are
    still kept (the watchdog and the tests read them). ``keep=True`` also keeps every
    record in ``records`` exactly as written (``steps`` runs included; for tests and
    in-process inspection). ``max_bytes`` / ``max_segments``: size-based rotation
    (:mod:`eplb_fsm.trace_segments`; defaults 64 MiB x 4 segments per trace file).
    A file another open trace of this process writes is refused (:mod:`eplb_fsm.trace_owners`);
    ``exclusive=False`` leaves it unclaimed, for a harness whose traces stand for other processes.

    One lock orders every record (its ``seq`` and its line go out together). The step
    path (:meth:`count_step`) takes it only when a run of steps begins; see
    :class:`StepRun` for why counting without it is exact.
    """

    def __init__(
        self,
        rank: int = 0,
        world: int = 1,
        trace_dir: str | os.PathLike | None = None,
        clock: Callable[[], float] = time.time,
        keep: bool = False,
        max_bytes: int = trace_segments.DEFAULT_MAX_BYTES,
        max_segments: int = trace_segments.DEFAULT_MAX_SEGMENTS,
        generation: int = 0,
        exclusive: bool = True,
    ) -> None:
        self.max_bytes, self.max_segments = trace_segments.check_rotation(max_bytes, max_segments)
        self.rank, self.world, generation = check_identity(rank, world, generation, clock)
        if trace_dir is not None and not isinstance(trace_dir, (str, os.PathLike)):
            raise ValueError(f"trace_dir must be a folder path (str or os.PathLike) or None, got "
                             f"{type(trace_dir).__name__} {trace_dir!r}")
        if type(keep) is not bool:   # "no" would keep every record in memory: read by truth, it is True
            raise ValueError(f"keep (keep_trace) must be a bool, got {type(keep).__name__} {keep!r}")
        self.clock = clock
        self.state: str | None = None
        self.step = 0
        self.seq = 0
        self.cseq: dict[str, int] = {}
        self.last_collective: dict | None = None
        # collectives started and not yet ended, by (thread id, group): what alive records report
        self.open_collectives: dict[tuple[int, str], dict] = {}
        self.ended = False              # an `end` record was written: nothing more goes to the file
        self.records: list[dict] | None = [] if keep else None
        self.rotations = 0              # segments this writer has rolled over
        self.path: Path | None = None
        self.pid = os.getpid()          # the process that opened the file: the only one that writes to it
        self._path_key: str | None = None   # this trace's hold on its file (trace_owners: one writer per file)
        self._lock = threading.Lock()
        self._end_pending: tuple | None = None   # an end() that could not take the lock (a signal handler's)
        self._owner: int | None = None           # the thread inside _locked()
        self._run: StepRun | None = None
        self._header: dict = {}         # the header's own fields, repeated at the top of each new segment
        self._headed = False            # the header record was made: from then on a new live file repeats it
        # the machine's layer and scale_pending after the last transition written (machine_after)
        self._machine: dict = {"layer": 0, "scale_pending": False}
        self._file = self._disk = None           # TraceFile: while open, and the last one (its error count)
        self._sink: TraceFile | None = None      # the file while records may go to it (None after `end`)
        if trace_dir is not None:
            path = trace_path(trace_dir, self.rank, generation)
            key = trace_owners.claim(path, self) if exclusive else None   # refused before anything is made
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                if key is not None:
                    trace_owners.lock(key, self)   # another process writing this file: refused here
                # append: a rank that re-creates its trace (e.g. after a group swap) keeps history
                self._disk = self._file = self._sink = TraceFile(path, self.max_bytes, self.max_segments)
            except BaseException as exc:
                trace_owners.release(self, key)
                if isinstance(exc, (FileExistsError, NotADirectoryError)):  # the name, or one above it, is a file
                    raise ValueError(f"trace_dir: {trace_dir} is not a folder (a file has that name or one "
                                     "above it)") from None
                if isinstance(exc, OSError) and not path.parent.is_dir():   # /proc/x, a read-only or gone parent
                    raise ValueError(f"trace_dir: cannot make the folder {trace_dir}: "
                                     f"{exc.strerror or exc}") from None
                raise
            self.path, self._path_key = path, key
            trace_owners.opened(self)

    @property
    def write_errors(self) -> int:
        """Trace failures the engine went on through: failed writes (records dropped), rolls, reopens; files lost."""
        return self._disk.errors if self._disk is not None else 0

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The lock, then an ``end`` deferred while it was held (written even if the holder is unwinding)."""
        try:
            with self._lock:
                self._owner = threading.get_ident()
                try:
                    yield
                finally:
                    self._owner = None
        finally:
            if self._end_pending is not None and not self.ended:
                self.end(*self._end_pending)

    # -- context ---------------------------------------------------------
    def set_context(self, state: str | None = None, step: int | None = None) -> None:
        """Update the state/step stamped on later records."""
        if state is not None:
            self.state = state
        if step is not None:
            self.step = int(step)

    def set_world(self, rank: int, world: int) -> None:
        """Change rank/world after a process-group swap (the file stays the same)."""
        with self._locked():
            self._write_run()   # the run's steps belong to the old rank/world
            self.rank = int(rank)
            self.world = int(world)

    # -- records ---------------------------------------------------------
    def count_step(self, dummy: bool = False) -> None:
        """Count the engine step ``self.step`` (state ``self.state``) into the current run; writes nothing.

        The engine's hot path: call it from the engine thread only. A step that does not
        continue the run (another step number or state, or the run holds ``MAX_RUN``)
        starts a new run, writing what the old one still held.
        """
        run = self._run
        step = self.step
        if run is not None and run.next == step and run.state == self.state and step - run.first < MAX_RUN:
            # lock-free: only this thread writes `packed`/`next`; a flusher reads `packed` once
            run.packed += (DUMMY + 1) if dummy else 1
            run.next = step + 1
            return
        with self._locked():
            self._write_run()
            run = StepRun(step, self.state)
            run.packed = (DUMMY + 1) if dummy else 1
            run.next = step + 1
            self._run = run

    def flush(self) -> dict | None:
        """Write the steps counted since the last write as one ``steps`` record; returns it (None: nothing pending)."""
        with self._locked():
            return self._write_run()

    def emit(self, event: str, /, **fields: Any) -> dict:
        """Write one record (after the pending ``steps`` run, if any); returns it. Explicit ``state``/``step`` win;
        a field named like another base field (``ts``, ``rank``, ``world``, ``event``, ``seq``) is a ValueError."""
        check_fields(fields, f"emit({event!r})")
        with self._locked():
            return self._emit_locked(event, fields)

    def _record(self, event: str, fields: dict, seq: int) -> dict:
        return {"ts": self.clock(), "rank": self.rank, "world": self.world, "event": event, "state": self.state,
                "step": self.step, "seq": seq, **fields}

    def _pending_run(self) -> tuple[str, dict, int] | None:
        """The pending run as (``step``/``steps``, its fields, the ``packed`` it covers), or None; changes nothing."""
        run = self._run
        if run is None:
            return None
        packed = run.packed          # one read: steps and dummies of the same moment
        delta = packed - run.written
        if not delta:
            return None
        first = run.first + run.written % DUMMY
        count, dummy = delta % DUMMY, delta // DUMMY
        if count == 1:   # a run of one step is the classic `step` record (shorter, and what readers bulk-read)
            return "step", {"state": run.state, "step": first, **({"dummy": True} if dummy else {})}, packed
        return "steps", {"state": run.state, "step": first, "count": count, "dummy": dummy}, packed

    def _make(self, run: tuple | None, event: str | None, fields: dict | None) -> tuple[list[dict], str | None]:
        """The records (the run's, then ``event``'s) numbered from ``seq``, and their text (None: no file)."""
        records = [self._record(run[0], run[1], self.seq)] if run is not None else []
        if event is not None:
            records.append(self._record(event, fields, self.seq + len(records)))
        if self._sink is None or not records:
            return records, None
        text = encode_record(records[0]) if len(records) == 1 else "\n".join(map(encode_record, records))
        return records, text

    def _write_run(self) -> dict | None:
        return self._emit_locked(None, None)

    def _emit_locked(self, event: str | None, fields: dict | None, commit: Callable[[], None] | None = None):
        """Write the pending run and ``event`` (None: the run alone) in one write call; returns the last record.
        Encoded before anything changes; ``commit`` (the caller's own change of state) runs before the write."""
        self._check_file()   # before any record is made: lines stay in seq order
        run = self._pending_run()
        records, text = self._make(run, event, fields)
        if text is not None and self.max_segments == 1 and not self.ended and self._sink.roll_first(len(text)):
            self._roll()   # one segment: the roll comes first, so that it never deletes what this write carries
            records, text = self._make(run, event, fields)
        if not records:
            return None
        if run is not None:
            self._run.written = run[2]
        if commit is not None:
            commit()
        self._keep(records)
        if text is not None:
            self._write(text)
        return records[-1]

    def _keep(self, records: list[dict]) -> None:
        self.seq += len(records)
        if self.records is not None:
            self.records.extend(records)

    def _write(self, text: str) -> None:
        # not after `end` (nothing follows it), nor when the segment holds only its header
        # (a header over max_bytes would roll for ever)
        if self._sink.write(text) and not self.ended and self._sink.lines > 1:
            self._roll()

    def _roll(self) -> None:
        if self._sink.roll():      # False: the move failed and the same segment goes on (no header)
            self.rotations += 1
        if self._sink.empty:       # a new segment (not one that failed to open: check() reopens it)
            self._continue()

    def _check_file(self, force: bool = False) -> None:
        """Open the live file again if it was lost (``force``: look now, not at most once per ``CHECK_S``)."""
        if self._sink is not None and self._sink.check(force):
            self._continue()

    def _continue(self) -> None:
        """Start a new live file (rolled, or opened again; lock held) with the header, ``continued: true``, alone:
        always the segment's first line (steps counted meanwhile, lock-free, follow it with a later ``seq``).
        Not before the header is made: a copy ahead of the real one would read as a run of its own."""
        if not self._headed:
            return
        machine = {**self._machine, "state": self.state}
        record = self._record("header", continued_fields(self._header, self.rotations, machine, self.cseq), self.seq)
        line = encode_record(record)
        self._keep([record])
        self._sink.write(line)   # never rolls: a segment that holds only its header does not

    def header(self, config: dict | None = None, run_id: str | None = None, **extra: Any) -> dict:
        """The first record of a run: schema, versions, rank, world, config (:func:`header_fields`),
        ``run_id`` (shared by every rank of the run, :mod:`eplb_fsm.run_identity`) and
        ``config_hash`` (:func:`config_hash` of ``config``). Repeated at the top of each rotated segment."""
        check_fields(extra, "header")
        fields = header_fields(config, run_id=run_id, config_hash=config_hash(config or {}), **extra)
        self._header = dict(fields)
        if isinstance(extra.get("machine"), dict):   # a joiner's starting point
            self._machine.update(extra["machine"])
        with self._locked():
            self._check_file()   # a file lost before the header is only opened again: the header comes first
            self._headed = True  # a roll that this very record brings about starts its segment with the copy
            return self._emit_locked("header", fields)

    def transition(self, trigger: str, source: str, dest: str, **fields: Any) -> dict:
        """A machine transition: ``event="transition"``, the trigger, source and dest."""
        check_fields(fields, "transition")
        record = dict(trigger=trigger, source=source, dest=dest, state=dest, **fields)

        def commit() -> None:   # the state a continued header repeats changes with the record, never apart
            self.state, self._machine = dest, machine_after(self._machine, trigger, dest, fields)
        with self._locked():
            return self._emit_locked("transition", record, commit)

    def start_collective(self, op: str, group: str = "world", shape: Any = None, dtype: Any = None,
                         **fields: Any) -> dict:
        """Write only a ``collective_start`` (the group's ``cseq`` advances); returns the record.

        :meth:`collective` brackets with it; a caller recording a rank that never leaves
        the collective (a hang) writes just this.
        """
        check_fields(fields, "start_collective")
        with self._locked():   # the number, the record and the count a continued header repeats: together
            cseq = self.cseq.get(group, 0)
            start = self._emit_locked("collective_start", collective_fields(op, group, cseq, shape, dtype, **fields),
                                      lambda: self.cseq.__setitem__(group, cseq + 1))
            self.last_collective = dict(start)
        return start

    # -- endings and liveness --------------------------------------------
    def end(self, how: str, error: str | None = None, signal: str | None = None,
            sender: dict | None = None) -> dict | None:
        """Write the ``end`` record (see :func:`end_fields`) once; later calls and records are not written.

        Returns the record, or None when an ``end`` was already written (or is deferred).
        Steps still pending are written first. Safe from another thread and from a signal
        handler: one that interrupted this thread while it held the lock cannot take it, so
        the ``end`` is written as soon as the interrupted write lets go of it.
        """
        fields = end_fields(how, error, signal, sender)
        if self._owner == threading.get_ident() or not self._lock.acquire(timeout=END_LOCK_WAIT_S):
            self._end_pending = (how, error, signal, sender)
            return None
        try:
            self._end_pending = None
            if self.ended:
                return None
            self.ended = True   # before the write: the `end` line never rolls the file
            self._check_file(force=True)   # a file lost since the last look takes no `end` with it
            errors = self.write_errors   # the trace's own failures, where a reader of the file sees them
            record = self._emit_locked("end", {**fields, "write_errors": errors} if errors else fields)
            self._sink = None   # the file stays open until close(); no record follows `end`
        finally:
            self._lock.release()
        trace_owners.release(self)
        return record

    def alive(self, interval_s: float, steps_seen: int | None, engine_wait: tuple | None = None) -> dict | None:
        """Write one ``alive`` record (current state/step, the open collective, the engine's collective a thread
        is blocked in when the caller saw one: (name, on the controller's ranks or None)); None after ``end``.
        The pending ``steps`` run goes first: the liveness thread is also the flusher."""
        if self.ended:
            return None
        errors = {"write_errors": self.write_errors} if self.write_errors else {}
        return self.emit("alive", **alive_fields(interval_s, steps_seen, self.waiting_on(), engine_wait), **errors)

    def close(self) -> None:
        """Write the pending ``steps`` run (unless ended) and close the file (another trace may open it then)."""
        trace_owners.release(self)
        with self._locked():
            run = self._run
            if run is not None and run.packed != run.written:   # the last write: into the file at the path
                self._check_file(force=True)
            self._write_run()
            if self._file is not None:
                self._file.close()
                self._file = self._sink = None
        trace_owners.release(self, self._path_key)

    def detach_in_child(self) -> None:
        """A forked child's copy (``trace_owners`` calls it at the fork): records are made, never written; closed."""
        # a new lock: the parent's may have been held at the fork by a thread the child does not have
        self._lock, self._owner, self._end_pending = threading.Lock(), None, None
        file, self._file, self._sink, self._path_key = self._file, None, None, None
        if file is not None:
            file.close()                # the child's copy of the descriptor; the parent's file is untouched

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran on a trace that wrote to a file (nothing more is written)."""
        return self.path is not None and self._file is None

    def __enter__(self) -> "EventTrace":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
