"""Per-rank event trace: one JSON line per transition and per collective.

Every record carries ``ts``, ``rank``, ``world``, ``event``, ``state``, ``step`` and
``seq`` (this rank's event counter); collectives add ``op``, ``group``, ``cseq`` (a
counter per group), ``shape`` and ``dtype``, and come as a ``collective_start`` /
``collective_end`` pair (or ``collective_error``). The schema is in docs/events.md.

The trace is its own structlog logger writing one JSONL file per rank, flushed per
line, so a rank killed mid-collective still leaves the start record on disk. The
library never calls ``structlog.configure()``: the host's logging setup is untouched.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import structlog

SCHEMA_VERSION = 1

# record keys every reader may rely on (docs/events.md documents each)
BASE_FIELDS = ("ts", "rank", "world", "event", "state", "step", "seq")
COLLECTIVE_FIELDS = ("op", "group", "cseq", "shape", "dtype")


def trace_path(trace_dir: str | os.PathLike, rank: int) -> Path:
    """The file a rank writes: ``<trace_dir>/rank<rank>.jsonl``."""
    return Path(trace_dir) / f"rank{rank:05d}.jsonl"


def _json_default(value: Any) -> Any:
    # numpy / torch scalars and shapes reach the trace from counters and tensors
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    return str(value)


def _dumps(record: dict, **_: Any) -> str:
    return json.dumps(record, default=_json_default, separators=(",", ":"))


_RENDER = structlog.processors.JSONRenderer(serializer=_dumps)


class EventTrace:
    """The trace writer of one rank.

    ``state`` and ``step`` are context the owner updates (``set_context``) so that
    every record is stamped without the caller repeating them. With
    ``trace_dir=None`` nothing is written, but counters and ``last_collective`` are
    still kept (the watchdog and the tests read them). ``keep=True`` also keeps every
    record in ``records`` (for tests and in-process inspection).
    """

    def __init__(
        self,
        rank: int = 0,
        world: int = 1,
        trace_dir: str | os.PathLike | None = None,
        clock: Callable[[], float] = time.time,
        keep: bool = False,
    ) -> None:
        self.rank = int(rank)
        self.world = int(world)
        self.clock = clock
        self.state: str | None = None
        self.step = 0
        self.seq = 0
        self.cseq: dict[str, int] = {}
        self.last_collective: dict | None = None
        self.records: list[dict] | None = [] if keep else None
        self.path: Path | None = None
        self._file = None
        self._sink = None
        if trace_dir is not None:
            self.path = trace_path(trace_dir, self.rank)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # append: a rank that re-creates its trace (e.g. after a group swap) keeps history
            self._file = open(self.path, "a", encoding="utf-8")
            # structlog's WriteLogger writes and flushes one line per call; the
            # renderer is called directly rather than through a BoundLogger because
            # the per-step record is on the engine's hot path (~6 us vs ~12 us)
            self._sink = structlog.WriteLogger(self._file)

    # -- context ---------------------------------------------------------
    def set_context(self, state: str | None = None, step: int | None = None) -> None:
        """Update the state/step stamped on later records."""
        if state is not None:
            self.state = state
        if step is not None:
            self.step = int(step)

    def set_world(self, rank: int, world: int) -> None:
        """Change rank/world after a process-group swap (the file stays the same)."""
        self.rank = int(rank)
        self.world = int(world)

    # -- records ---------------------------------------------------------
    def emit(self, event: str, **fields: Any) -> dict:
        """Write one record; returns it. Explicit ``state``/``step`` fields win."""
        record = {
            "ts": self.clock(),
            "rank": self.rank,
            "world": self.world,
            "event": event,
            "state": self.state,
            "step": self.step,
            "seq": self.seq,
        }
        record.update(fields)
        self.seq += 1
        if self._sink is not None:
            self._sink.msg(_RENDER(None, "msg", record))
        if self.records is not None:
            self.records.append(record)
        return record

    def header(self, config: dict | None = None, **extra: Any) -> dict:
        """The first record of a run: schema, versions, rank, world, config (:func:`header_fields`)."""
        return self.emit("header", **header_fields(config, **extra))

    def transition(self, trigger: str, source: str, dest: str, **fields: Any) -> dict:
        """A machine transition: ``event="transition"``, the trigger, source and dest."""
        self.state = dest
        return self.emit("transition", trigger=trigger, source=source, dest=dest, state=dest, **fields)

    @contextlib.contextmanager
    def collective(
        self,
        op: str,
        group: str = "world",
        shape: Any = None,
        dtype: Any = None,
        **fields: Any,
    ) -> Iterator[dict]:
        """Bracket one collective with start/end records; an exception writes ``collective_error``.

        The yielded dict is the start record; the group's ``cseq`` advances once per call,
        so the n-th collective of a group has the same ``cseq`` on every rank that issues it.
        """
        start = self.start_collective(op, group, shape, dtype, **fields)
        info = {key: start[key] for key in (*COLLECTIVE_FIELDS, *fields)}  # what end/error repeat
        t0 = time.perf_counter()
        try:
            yield start
        except BaseException as exc:
            self.emit("collective_error", error=f"{type(exc).__name__}: {exc}", **info)
            raise
        self.emit("collective_end", duration_s=round(time.perf_counter() - t0, 6), **info)

    def start_collective(self, op: str, group: str = "world", shape: Any = None, dtype: Any = None,
                         **fields: Any) -> dict:
        """Write only a ``collective_start`` (the group's ``cseq`` advances); returns the record.

        :meth:`collective` brackets with it; a caller recording a rank that never leaves
        the collective (a hang) writes just this.
        """
        cseq = self.cseq.get(group, 0)
        self.cseq[group] = cseq + 1
        start = self.emit("collective_start", **collective_fields(op, group, cseq, shape, dtype, **fields))
        self.last_collective = dict(start)
        return start

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
            self._sink = None

    def __enter__(self) -> "EventTrace":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _package_version() -> str:
    try:
        from importlib.metadata import version

        return version("eplb-fsm")
    except Exception:  # running from a source checkout that is not installed
        return "0+source"


def header_fields(config: dict | None = None, **extra: Any) -> dict:
    """The fields of a ``header`` record after the base fields: schema, pid, versions, config, ``extra``."""
    import numpy
    import torch
    import transitions

    return {
        "schema": SCHEMA_VERSION,
        "pid": os.getpid(),
        "versions": {
            "eplb_fsm": _package_version(),
            "torch": torch.__version__,
            "numpy": numpy.__version__,
            "transitions": transitions.__version__,
            "structlog": structlog.__version__,
        },
        "config": config or {},
        **extra,
    }


def collective_fields(op: str, group: str, cseq: int, shape: Any = None, dtype: Any = None, **fields: Any) -> dict:
    """The fields of a ``collective_*`` record after the base fields (``COLLECTIVE_FIELDS`` first, then ``fields``)."""
    info = {
        "op": op,
        "group": group,
        "cseq": cseq,
        "shape": list(shape) if shape is not None else None,
        "dtype": str(dtype) if dtype is not None else None,
    }
    info.update(fields)
    return info


def encode_record(record: dict) -> str:
    """One record as the JSON text of its trace line (no newline), as :class:`EventTrace` writes it."""
    return _dumps(record)


def read_trace(path: str | os.PathLike) -> tuple[list[dict], int]:
    """Read one rank's JSONL file: (records, number of unreadable lines skipped).

    A truncated last line (a rank killed mid-write) is counted, not fatal.
    """
    records: list[dict] = []
    bad = 0
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                bad += 1
    return records, bad
