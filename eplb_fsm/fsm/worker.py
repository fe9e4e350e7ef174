"""The background worker of async mode: one thread running its own asyncio loop.

The controller hands it the slow parts of a rearrangement (the policy, and one layer's
weight transfer into a one-layer buffer) so the engine keeps stepping. Jobs run one at
a time, in submission order. The worker never fires machine events and never decides
anything: it only reports, through ``Job.done()`` / ``Job.error()``, and the
controller turns those local facts into a shared decision with an all-reduce.

On a CUDA device the worker runs every job on its own CUDA stream. The job first waits
for an event recorded on the submitter's stream at submission (the commit of the layer
before, which reads the buffer this job overwrites, was enqueued there), and records an
event after it; ``Job.done()`` is true only once that event has completed, and
``Job.wait_stream()`` makes the caller's stream wait for it before the buffer is read.
Without a GPU that path is never taken.

Every wait here is bounded: ``result(timeout)``, ``wait_idle(timeout)``, ``close(timeout)``,
and :class:`~eplb_fsm.fsm.pacing.StepPacer`'s wait for the next engine step.

Two knobs bound what the worker takes from the engine on a CPU-bound host
(``EplbConfig.async_worker_nice``, ``async_max_bytes_per_step``; docs/guide.md): the worker
thread renices itself at start (:func:`renice_this_thread`), and so do the transfer group's own
threads, started from a niced thread (:func:`run_niced`); a layer's transfer can go in chunks
with a wait for the next engine step between them (:mod:`eplb_fsm.fsm.pacing`), but none while the
engine thread itself waits for the worker.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import os
import threading
import time
import warnings
import weakref
from typing import Any, Callable

import torch


class Job:
    """One unit of work given to the worker, and what became of it."""

    def __init__(self, job_id: int, kind: str, fn: Callable[..., Any], args: tuple, kwargs: dict,
                 layer: int | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.id = job_id
        self.kind = kind
        self.layer = layer
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.clock = clock
        self.submitted_at = clock()
        self.waited_from = self.submitted_at   # what age() counts from (a prefetched job: its hand-over)
        self.started_at: float | None = None
        self.finished_at: float | None = None
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.cuda_event = None  # set on GPU: completion of the job's stream work
        self.after = None       # set on GPU: the submitter's stream work the job must wait for

    def done(self) -> bool:
        """True once the job has returned or raised (and, on GPU, its stream work finished)."""
        if not self.future.done():
            return False
        if self.cuda_event is not None and self.future.exception() is None:
            return bool(self.cuda_event.query())
        return True

    def ok(self) -> bool:
        """Done without an error."""
        return self.done() and self.future.exception() is None

    def error(self) -> BaseException | None:
        """The exception the job raised, or None (also None while it runs)."""
        if not self.future.done():
            return None
        return self.future.exception()

    def result(self, timeout: float | None = None) -> Any:
        """The job's return value; waits at most ``timeout`` seconds, then TimeoutError."""
        return self.future.result(timeout=timeout)

    def age(self, now: float | None = None) -> float:
        """Seconds since the ranks began waiting for it: its submission, or for a job submitted
        ahead (``async_prefetch``) its hand-over (local time: for timeout flags and logs only)."""
        return (self.clock() if now is None else now) - self.waited_from

    def wait_stream(self) -> None:
        """On GPU, make the current stream wait for the job's stream work (no-op on CPU)."""
        if self.cuda_event is not None:
            torch.cuda.current_stream().wait_event(self.cuda_event)

    def __repr__(self) -> str:
        status = "done" if self.done() else ("running" if self.started_at is not None else "queued")
        return f"Job(id={self.id}, kind={self.kind!r}, layer={self.layer}, {status})"


_RENICE_WARNED = False


def renice_this_thread(increment: int) -> int | None:
    """Raise the calling thread's nice value by ``increment`` (Linux: per thread); returns the new value.

    Where threads cannot be reniced one by one (no ``os.setpriority``, or not Linux, where it
    would renice the whole process) it does nothing and warns once per process; returns None.
    """
    global _RENICE_WARNED
    if not increment:
        return None
    if not hasattr(os, "setpriority") or not os.uname().sysname == "Linux":
        if not _RENICE_WARNED:
            _RENICE_WARNED = True
            warnings.warn("async_worker_nice: this platform cannot renice one thread; the worker keeps the "
                          "process's priority", RuntimeWarning, stacklevel=2)
        return None
    tid = threading.get_native_id()
    value = min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment)
    os.setpriority(os.PRIO_PROCESS, tid, value)
    return value


def run_niced(fn: Callable[[], Any], increment: int, timeout_s: float) -> Any:
    """Call ``fn`` on a short-lived thread niced by ``increment``; return its result or raise its error.

    Linux threads start at the nice value of the thread that starts them, so every thread
    ``fn`` starts keeps it for life: when ``fn`` builds a gloo process group, its tcp loop
    and work threads, which do a weight transfer's sends, receives and copies, not the
    Python thread that posts them. ``increment`` 0 calls ``fn`` on the calling thread.
    Raises ``TimeoutError`` if ``fn`` has not returned within ``timeout_s``.
    """
    if not increment:
        return fn()
    outcome: dict[str, Any] = {}

    def body() -> None:
        try:
            renice_this_thread(increment)
            outcome["value"] = fn()
        except BaseException as exc:  # handed to the caller below
            outcome["error"] = exc

    thread = threading.Thread(target=body, name="eplb-niced-call", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"niced call {getattr(fn, '__name__', fn)!r} did not return within {timeout_s} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


class BackgroundWorker:
    """A daemon thread with its own asyncio loop that runs submitted jobs one at a time.

    ``nice``: the thread's nice increment, applied by the thread itself at start
    (:func:`renice_this_thread`; 0: none). ``native_id``: the thread's OS id once started.
    ``start_yield_s``: how long the worker sleeps before each job's own code runs. The
    submitter (the engine thread, inside ``step()``) wakes the loop through a socket send
    that releases the GIL; the woken worker would take the GIL and start the job's Python,
    and the engine thread waited up to the switch interval (5 ms) to get it back. Sleeping
    first lets the submitter finish its step's Python before the job competes for the GIL.
    ``owner``: an object whose collection stops the worker as :meth:`stop_soon` does (the
    thread holds the worker, so a controller dropped without ``close()`` would leave it running).
    """

    def __init__(self, device: torch.device | str | None = None, name: str = "eplb-worker",
                 start_timeout_s: float = 10.0, nice: int = 0, start_yield_s: float = 0.001, owner: Any = None) -> None:
        if not 0 <= start_yield_s <= 1:
            raise ValueError(f"start_yield_s must be in 0..1 s, got {start_yield_s}")
        if owner is not None:
            try:   # before the thread starts: a refused owner leaves nothing running
                weakref.ref(owner)
            except TypeError:
                raise ValueError(f"owner must be weakly referenceable, got a {type(owner).__name__}") from None
        self.start_yield_s = float(start_yield_s)
        # numpy 2's unique (the planners') imports numpy.ma on first use: ~12-20 ms of Python
        # under the GIL, which would land in the engine's steps during the first rearrangement
        import numpy.ma  # noqa: F401
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.name = name
        self.nice = int(nice)
        self.native_id: int | None = None
        self.niced_to: int | None = None   # the nice value the thread set (None: unchanged)
        self.stream = None
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._pending = 0
        self._unfinished: set[Job] = set()
        self._closing = False
        self._idle = threading.Event()
        self._idle.set()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        if not self._ready.wait(start_timeout_s):
            raise RuntimeError(f"background worker {name!r} did not start within {start_timeout_s} s")
        if self._start_error is not None:
            raise RuntimeError(f"background worker {name!r} failed to start: {self._start_error}")
        if owner is not None:
            weakref.finalize(owner, self.stop_soon)

    # -- thread body -----------------------------------------------------
    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        self.native_id = threading.get_native_id()
        try:
            # the thread's own priority, before any job: it yields the CPU to the engine thread
            self.niced_to = renice_this_thread(self.nice)
            if self.device.type == "cuda":
                # the worker's own stream: transfers overlap the engine's compute
                self.stream = torch.cuda.Stream(device=self.device)
        except BaseException as exc:  # pragma: no cover - GPU only
            self._start_error = exc
            self._ready.set()
            return
        # signal readiness from inside the loop, so ``alive`` is already true for callers
        self._loop.call_soon(self._ready.set)
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()
            self._fail_unfinished(RuntimeError(f"background worker {self.name!r} was closed"))

    def _run(self, job: Job) -> None:
        """Run one job on the loop's thread (a plain callback: no coroutine is left unawaited
        if the loop closes before it runs). A job submitted before ``close()`` still runs: every
        rank submitted it at the same step, so dropping it on one rank only would leave its
        peers' transfer waiting for messages that never come."""
        if self.start_yield_s:
            time.sleep(self.start_yield_s)   # let the submitting thread have the GIL back first
        job.started_at = job.clock()
        try:
            if self.stream is not None:
                with torch.cuda.stream(self.stream):
                    if job.after is not None:
                        # what the submitter's stream enqueued before (a commit reading the buffer
                        # this job overwrites) runs first: streams do not order each other
                        self.stream.wait_event(job.after)
                    value = job.fn(*job.args, **job.kwargs)
                    event = torch.cuda.Event()
                    event.record(self.stream)
                    job.cuda_event = event
            else:
                value = job.fn(*job.args, **job.kwargs)
        except BaseException as exc:  # the job's failure is reported, never raised here
            job.finished_at = job.clock()
            job.future.set_exception(exc)
        else:
            job.finished_at = job.clock()
            job.future.set_result(value)
        finally:
            self._finish(job)

    def _finish(self, job: Job) -> None:
        with self._lock:
            if job in self._unfinished:
                self._unfinished.discard(job)
                self._pending -= 1
                if self._pending == 0:
                    self._idle.set()

    def _fail_unfinished(self, exc: BaseException) -> None:
        with self._lock:
            jobs = list(self._unfinished)
        for job in jobs:
            if not job.future.done():
                job.future.set_exception(exc)
            self._finish(job)

    # -- API -------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._loop.is_running()

    def submit(self, fn: Callable[..., Any], *args: Any, kind: str = "job", layer: int | None = None,
               **kwargs: Any) -> Job:
        """Queue ``fn(*args, **kwargs)``; returns its Job at once."""
        if self._closing or not self.alive:
            raise RuntimeError(f"background worker {self.name!r} is not running")
        job = Job(next(self._ids), kind, fn, args, kwargs, layer=layer)
        if self.stream is not None:
            job.after = torch.cuda.Event()
            job.after.record(torch.cuda.current_stream(self.device))
        with self._lock:
            self._pending += 1
            self._unfinished.add(job)
            self._idle.clear()
        try:
            # one callback per job: other callbacks of the loop run between jobs
            self._loop.call_soon_threadsafe(self._run, job)
        except RuntimeError as exc:  # the loop closed between the check above and now
            job.future.set_exception(RuntimeError(f"background worker {self.name!r} is not running: {exc}"))
            self._finish(job)
        return job

    def run_coroutine(self, coro) -> concurrent.futures.Future:
        """Run a coroutine on the worker's loop (for callers that are themselves async)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    @property
    def pending(self) -> int:
        """Jobs submitted and not finished."""
        return self._pending

    def idle(self) -> bool:
        return self._pending == 0

    def wait_idle(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for every submitted job to finish; True if they did."""
        return self._idle.wait(timeout)

    def stop_soon(self) -> None:
        """Refuse new jobs and stop the loop once the jobs already submitted have run (they pair with the
        peers'), without waiting for the thread (idempotent)."""
        self._closing = True
        if self._thread.is_alive() and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._loop.stop)
            except RuntimeError:  # loop already closed
                pass

    def close(self, timeout: float = 5.0) -> bool:
        """:meth:`stop_soon`, then wait at most ``timeout`` seconds; True if the thread ended."""
        self.stop_soon()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def __enter__(self) -> "BackgroundWorker":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
