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
- **One writer per file across processes.** The writer also holds an advisory lock
  (``fcntl.flock``, exclusive) on ``.<file name>.lock`` in the trace's folder (hidden, and
  no reader takes it for a trace) from the moment its file opens until ``close()``; a trace
  in another process (a second run started on the same folder, the same rank twice) that
  finds it held is refused with a ``ValueError`` naming the trace file and the holder's pid.
  The lock file never moves (rotation renames the live file, not it); ``close()`` removes it
  (a writer killed leaves it behind, unlocked: the next writer takes it).
  Where ``fcntl`` is missing or the file system refuses locks, only the check within the
  process holds.
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

import errno
import gc
import os
import threading
import weakref
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:   # not a POSIX system: the one-writer check stays within the process
    fcntl = None

__all__ = ["claim", "end_open_traces", "lock", "lock_path", "opened", "release"]

_lock = threading.Lock()
_open: "weakref.WeakSet[Any]" = weakref.WeakSet()   # traces with a file and no `end` yet
_paths: dict[str, "weakref.ref[Any]"] = {}          # resolved file path -> the trace holding it open
_locks: dict[str, Any] = {}                         # resolved file path -> its open lock file (flock held)
LOCK_ATTEMPTS = 5   # opens of a lock file that a writer letting go removed meanwhile, at most


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


def lock_path(path: str | os.PathLike) -> Path:
    """The lock file of the trace file ``path``: ``.<name>.lock`` next to it."""
    path = Path(path)
    return path.with_name(f".{path.name}.lock")


def lock(key: str, trace: Any) -> None:
    """Take the cross-process lock of the trace file ``key`` (a :func:`claim` key; its folder exists) for
    ``trace`` until :func:`release` with that key, or until ``trace`` is collected.

    ValueError naming the file and the holder's pid when another process holds it. A lock the
    file system cannot give (no ``fcntl``, a file system without locks) is not taken.
    """
    if fcntl is None:
        return
    with _lock:
        if key in _locks:   # taken by a trace of this process that is gone now: this one holds it on
            weakref.finalize(trace, _unlock, key, _locks[key])
            return
    path = lock_path(key)
    for _ in range(LOCK_ATTEMPTS):
        try:
            fh = open(path, "a+", encoding="ascii")
        except OSError:
            return   # the trace file's own open reports an unwritable folder
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            held = exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK)
            holder = _read_pid(fh) if held else ""
            fh.close()
            if not held:
                return   # no locks on this file system (ENOLCK, EINVAL): the in-process check only
            raise ValueError(f"trace file {key} is already written by another process (pid {holder or '?'} "
                             f"holds {path}): one writer per rank file; give each run its own trace_dir, or stop "
                             "the other writer first (two writers interleave their records, and replay misreads "
                             "them)") from None
        if _same(fh, path):
            break
        fh.close()   # a writer that let go removed the file between our open and our lock: take the new one
    else:
        return
    try:
        fh.seek(0)
        fh.truncate()
        fh.write(str(os.getpid()))   # for the refusal message of a later writer
        fh.flush()
    except OSError:
        pass   # the lock is held all the same
    with _lock:
        _locks[key] = fh
    weakref.finalize(trace, _unlock, key, fh)


def _same(fh: Any, path: Path) -> bool:
    try:
        mine, there = os.fstat(fh.fileno()), os.stat(path)
    except OSError:
        return False
    return (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)


def _read_pid(fh: Any) -> str:
    try:
        fh.seek(0)
        return fh.read(32).strip()
    except (OSError, ValueError):
        return ""


def _let_go(key: str, fh: Any) -> None:
    """Remove the lock file (still ours: only its holder removes it) and close it, which lets the lock go."""
    try:
        os.unlink(lock_path(key))
    except OSError:
        pass   # gone already, or a folder that refuses: the lock goes with the descriptor all the same
    fh.close()


def _unlock(key: str, fh: Any) -> None:
    """A collected trace's lock, unless another trace of this process holds it on."""
    if _locks.get(key) is fh and _holder(key) is None:
        _locks.pop(key, None)
        _let_go(key, fh)


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
            fh = _locks.pop(key, None) if key not in _paths else None
        if fh is not None:
            _let_go(key, fh)


def end_open_traces(how: str, error: str | None = None, signal: str | None = None,
                    sender: dict | None = None) -> int:
    """Write ``end`` (see :func:`eplb_fsm.trace_fields.end_fields`) to every trace of this process still
    open; returns how many. For a signal handler that is about to exit the process (``eplb_fsm.sim.signals``,
    ``eplb_fsm.stop_signals``). A trace another process opened (inherited through a fork the hooks did not
    see) is left alone."""
    pid = os.getpid()
    return sum(trace.end(how, error, signal, sender) is not None for trace in list(_open) if trace.pid == pid)


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()   # a parent thread may have held it at the fork: it never lets go here
    traces = {id(t): t for t in [*list(_open), *(ref() for ref in list(_paths.values()))] if t is not None}
    _open.clear()
    _paths.clear()
    for fh in _locks.values():
        fh.close()   # the child's descriptor only: the lock stays the parent's (it is the open file's, not the fd's)
    _locks.clear()
    for trace in traces.values():
        trace.detach_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
