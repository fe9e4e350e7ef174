"""Which traces this process has open: one writer per rank file, what a signal handler ends, nothing after a fork.

:class:`~eplb_fsm.trace.EventTrace` keeps this bookkeeping here (docs/events.md, "Rotation" and "`end`"):

- **One open trace per file and process.** A second ``EventTrace`` on a file another one of
  this process holds open (the same path once symlinks are resolved) is refused with a
  ``ValueError`` until the first is closed: two writers of one file would each roll it by
  their own byte count (the size cap no longer holds) and interleave two ``seq`` counts.
  A trace nothing refers to any more holds nothing (it can never write again): a refusal
  first collects garbage and looks again. A controller's liveness and watchdog threads hold
  it weakly, so a controller dropped without ``close()`` lets its file go once collected, and
  one whose construction raised has closed its trace.
- **A signal handler ends what is open.** :func:`end_open_traces` writes ``end`` to every
  trace of this process that is open and not ended (the simulator's signal thread; a host's
  SIGTERM handler).
- **A forked child writes nothing to its parent's traces.** At ``os.fork`` the child forgets
  them (``os.register_at_fork``) and each becomes inert there (:meth:`EventTrace.detach_in_child`):
  its copy of the file closed, records still counted but never written. Without this a
  worker forked from a rank (a data loader) whose SIGTERM handler calls
  :func:`end_open_traces` would write ``end how=signal`` into the rank's own file.
"""

from __future__ import annotations

import gc
import os
import threading
import weakref
from typing import Any

__all__ = ["claim", "end_open_traces", "opened", "release"]

_lock = threading.Lock()
_open: "weakref.WeakSet[Any]" = weakref.WeakSet()   # traces with a file and no `end` yet
_paths: dict[str, "weakref.ref[Any]"] = {}          # resolved file path -> the trace holding it open


def _holder(key: str) -> Any:
    ref = _paths.get(key)
    trace = ref() if ref is not None else None
    return None if trace is None or trace.closed else trace


def claim(path: str | os.PathLike, trace: Any) -> str:
    """Note ``trace`` as the writer of ``path``; returns the key :func:`release` takes.

    ValueError naming the path and the rule when another open trace of this process writes it.
    Nothing is changed when it is refused.
    """
    key = os.path.realpath(path)
    for attempt in range(2):
        with _lock:
            holder = _holder(key)
            if holder is None:
                _paths[key] = weakref.ref(trace)
                return key
        if attempt == 0:
            del holder
            gc.collect()   # a trace dropped without close() inside a reference cycle can never write: not a writer
    raise ValueError(f"trace file {key} is already open in this process (rank {getattr(holder, 'rank', '?')}'s "
                     f"EventTrace, pid {os.getpid()}): one open EventTrace per rank file and process; close the "
                     "other one first, or the EplbController that writes it (two writers of one file break its size "
                     "cap and its seq order)")


def opened(trace: Any) -> None:
    """``trace`` has its file open and no ``end``: :func:`end_open_traces` will end it."""
    _open.add(trace)


def release(trace: Any, key: str | None = None) -> None:
    """``trace`` needs no ``end`` from a signal handler any more; with ``key``, its file is free again."""
    _open.discard(trace)
    if key is not None:
        with _lock:
            ref = _paths.get(key)
            if ref is not None and ref() in (None, trace):
                del _paths[key]


def end_open_traces(how: str, error: str | None = None, signal: str | None = None) -> int:
    """Write ``end`` (see :func:`eplb_fsm.trace_fields.end_fields`) to every trace of this process still
    open; returns how many. For a signal handler that is about to exit the process (``eplb_fsm.sim.signals``).
    A trace another process opened (inherited through a fork the hooks did not see) is left alone."""
    pid = os.getpid()
    return sum(trace.end(how, error, signal) is not None for trace in list(_open) if trace.pid == pid)


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()   # a parent thread may have held it at the fork: it never lets go here
    traces = {id(t): t for t in [*list(_open), *(ref() for ref in list(_paths.values()))] if t is not None}
    _open.clear()
    _paths.clear()
    for trace in traces.values():
        trace.detach_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
