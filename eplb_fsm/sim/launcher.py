"""Run a function on W local processes joined in one torch.distributed group.

``run_ranks(fn, world_size, args)`` starts ``world_size`` processes, each of which
joins a process group (gloo by default) through a TCP rendezvous on a port picked at
run time, calls ``fn(rank, world_size, *args)`` and sends the return value back. The
parent waits with a deadline on everything: a rank that raises, or exits without a
report, makes the whole call raise :class:`RankFailedError` (with the rank's traceback
or exit code) as soon as the other ranks are stopped, not when they end; ranks still
running at the deadline are killed and :class:`RanksTimeoutError` is raised. Ranks that
all reported get :data:`EXIT_GRACE` s to exit on their own before the stop. No child
outlives the call.

``fn`` and ``args`` must be picklable (a top-level function of an importable module).
Processes come from a *forkserver* that has already imported torch, so starting a rank
costs a fork rather than a fresh interpreter; ``start_method="spawn"`` is the fallback.
``eplb-fsm simulate`` starts that server first (:func:`warm_forkserver`), so its import of
torch runs beside the command's own checks and imports instead of after them.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue as queue_mod
import signal
import socket
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from eplb_fsm.maps import MAX_SECONDS, check_seconds

__all__ = ["run_ranks", "last_line", "check_timeout", "find_free_port", "process_context", "stop_processes",
           "RankFailedError", "RanksTimeoutError", "EXIT_GRACE", "await_exit", "note_unreported_deaths",
           "settle_after_failure", "start_process", "rank_log_path", "warm_forkserver", "FORKSERVER_LOST"]

# modules the forkserver imports once so that every forked rank starts warm
_PRELOAD = ["torch", "torch.distributed", "numpy"]
_ADDR_IN_USE = ("address already in use", "eaddrinuse", "errno: 98")
#: seconds the processes of a run that fully reported get to exit on their own before the stop
EXIT_GRACE = 2.0


class RankFailedError(RuntimeError):
    """One or more ranks raised or died.

    ``failures`` maps rank -> traceback / reason, in the order the failures arrived;
    ``first`` is the rank that failed first (usually the cause: the others often fail
    because of it), and its traceback is in the message.
    """

    def __init__(self, failures: dict[int, str], values: dict[int, Any] | None = None):
        self.failures = dict(failures)
        self.values = dict(values or {})  # what the ranks that finished returned
        self.first = next(iter(self.failures))
        # every other failed rank named too, by the last line of its report (often the cause)
        others = "".join(f"\nrank {r}: {last_line(text)}" for r, text in self.failures.items() if r != self.first)
        super().__init__(
            f"rank(s) {sorted(self.failures)} failed; first rank {self.first}:\n{self.failures[self.first]}{others}"
        )


def last_line(text: Any) -> str:
    """The last non-blank line of a rank's report (a traceback's: the error itself), or ``?``."""
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "?"


class RanksTimeoutError(TimeoutError):
    """Ranks still running at the deadline (they were killed); ``pending`` lists them."""

    def __init__(self, pending: Sequence[int], timeout: float, values: dict[int, Any] | None = None,
                 failures: dict[int, str] | None = None):
        self.pending = sorted(pending)
        self.timeout = timeout
        self.values = dict(values or {})      # what the ranks that finished returned
        self.failures = dict(failures or {})  # ranks that failed before the deadline
        super().__init__(f"rank(s) {self.pending} did not finish within {timeout:.1f} s (killed)")


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS reports free right now (bind to port 0, read it, release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    args: tuple,
    init_method: str,
    backend: str,
    timeout: float,
    torch_threads: int | None,
    env: dict[str, str] | None,
    results: Any,
    log_path: str | None = None,
) -> None:
    """Body of one rank process: join the group, run ``fn``, report, leave."""
    from eplb_fsm.sim import signals

    if log_path is not None:
        try:  # before anything can print: a rank stopped while it starts dumps its stacks here, not on a terminal
            signals.redirect_stdout(Path(log_path))
        except OSError:
            results.put((rank, "setup_error", traceback.format_exc()))
            return
    # then, while this process has one thread: own process group, SIGTERM/SIGINT -> `end` + exit
    signals.install()
    try:
        if env:
            os.environ.update(env)
        os.environ["RANK"] = str(rank)
        os.environ["WORLD_SIZE"] = str(world_size)
        import torch
        import torch.distributed as dist

        if torch_threads is not None:
            torch.set_num_threads(torch_threads)
        dist.init_process_group(
            backend=backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
    except BaseException:  # report set-up failures (e.g. the port was taken meanwhile)
        results.put((rank, "setup_error", traceback.format_exc()))
        return
    try:
        value = fn(rank, world_size, *args)
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        return
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    results.put((rank, "ok", value))


@contextlib.contextmanager
def _signals_held():
    """Hold SIGINT and SIGTERM back (main thread only) until the block ends, then deliver them as they came.

    While ``Process.start()`` runs, the child may already exist while its pid is not yet known
    here: an exception raised there (Ctrl-C) would leave a child no stop can reach, which then
    fails to unpickle its queue once this process has let go of it (a traceback on the
    terminal) or runs on alone. Held back, the signal acts once ``start()`` has returned.
    """
    stops = (signal.SIGINT, signal.SIGTERM)
    if threading.current_thread() is not threading.main_thread() or any(signal.getsignal(s) is None for s in stops):
        yield  # only the main thread gets signals; a handler set outside Python cannot be put back
        return
    held: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: held.append(signum)) for s in stops}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for s in dict.fromkeys(held):  # the handler that was in place runs now (KeyboardInterrupt, ...)
            signal.raise_signal(s)


def start_process(process: mp.process.BaseProcess) -> None:
    """``process.start()`` with SIGINT/SIGTERM held back until it returns (:func:`_signals_held`), so that
    a started process always has a known pid and the launcher's stop reaches it.

    With a forkserver, the first start also waits for the server to import torch: a Ctrl-C
    then acts after those few seconds.
    """
    with _signals_held():
        process.start()


def rank_log_path(log_dir: str | os.PathLike, rank: int) -> Path:
    """Where rank ``rank``'s stdout goes with ``run_ranks(..., rank_logs=log_dir)``: ``rank<NNNNN>.log``."""
    return Path(log_dir) / f"rank{rank:05d}.log"


def process_context(start_method: str | None) -> mp.context.BaseContext:
    if start_method is None:
        start_method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        # only takes effect if this process has not started its forkserver yet
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def warm_forkserver() -> None:
    """Start the default context's forkserver now, without waiting for it: it imports torch while this process
    checks its arguments and imports torch itself, on another core (about 1.3 s of a run's start on 2 cores).

    Ranks started later come from it as from one started on demand. A launcher that exits before starting any
    rank (a usage error) leaves nothing: the server ends once this process's end closes its pipe.
    """
    if "forkserver" not in mp.get_all_start_methods():
        return
    from multiprocessing import forkserver

    process_context(None)   # its preload list, set before the server starts
    with _signals_held():   # as a rank's start: a Ctrl-C acts once the server's pid is known
        forkserver.ensure_running()


def stop_processes(procs: Sequence[mp.process.BaseProcess], grace: float = 2.0) -> None:
    """Stop every rank process and its process group (SIGTERM, then SIGKILL after ``grace``); join them.

    A rank writes ``end how=signal`` on SIGTERM (``sim.signals``); a frozen one is sent
    SIGCONT so it can. Bound: ``grace`` + 5 s per process still alive after SIGKILL.
    """
    from eplb_fsm.sim.signals import stop_groups

    by_pid = {p.pid: p for p in procs if p.pid is not None}
    stop_groups(list(by_pid), grace, lambda pid: by_pid[pid].is_alive(), lambda pid, t: by_pid[pid].join(t))


def _take(message: tuple, values: dict, failures: dict) -> None:
    """File one ``(key, status, payload)`` report: a value when ``status`` is ``"ok"``, else a failure."""
    key, status, payload = message
    (values if status == "ok" else failures)[key] = payload


#: why a process failed whose forkserver died while it still ran (multiprocessing then reports exit code 255)
FORKSERVER_LOST = "its forkserver died (killed?): the launcher could no longer watch it, and stopped it"


def _unreported(p: Any) -> str:
    """Why process ``p``, ended without a report, failed: its exit code, or its forkserver's death while it ran on."""
    from eplb_fsm.sim.signals import pid_gone

    if p.exitcode == 255 and p.pid is not None and not pid_gone(p.pid):
        return FORKSERVER_LOST
    return f"process exited with code {p.exitcode} without reporting"


def note_unreported_deaths(procs: Mapping[int, Any], values: dict, failures: dict, results_q: Any) -> None:
    """After a quiet poll: each process (key -> process) gone without a report (killed, segfault,
    ``os._exit``) is a failure, unless a report still in flight arrives within half a second."""
    for key, p in procs.items():
        if key in values or key in failures or p.exitcode is None:
            continue
        with contextlib.suppress(queue_mod.Empty):
            # this message may be another process's: a still silent dead one is found next time
            _take(results_q.get(timeout=0.5), values, failures)
            continue
        failures[key] = _unreported(p)


def settle_after_failure(procs: Mapping[int, Any], values: dict, failures: dict, results_q: Any) -> None:
    """Once a process failed: the others are likely blocked on it, so take what they report
    within a second, then count every process that died meanwhile (a signal) as failed too,
    not as a bystander the launcher stopped. The caller then stops what is left."""
    grace = time.monotonic() + 1.0
    while len(values) + len(failures) < len(procs) and time.monotonic() < grace:
        with contextlib.suppress(queue_mod.Empty):
            _take(results_q.get(timeout=0.1), values, failures)
    for k, p in procs.items():
        if k not in values and k not in failures and p.exitcode not in (None, 0):
            failures[k] = _unreported(p)


def await_exit(procs: Iterable[mp.process.BaseProcess], grace: float = EXIT_GRACE) -> None:
    """Give processes that all reported up to ``grace`` s in all to finish their own exit (queue
    flush, finalizers), so that the stop after it signals none of them and a clean run logs no signal."""
    end = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))


def _launch_once(
    ctx: mp.context.BaseContext,
    fn: Callable[..., Any],
    world_size: int,
    args: tuple,
    timeout: float,
    backend: str,
    host: str,
    torch_threads: int | None,
    env: dict[str, str] | None,
    rank_logs: str | None = None,
) -> tuple[list[Any] | None, dict[int, str], bool, dict[int, Any]]:
    """One launch attempt: (results or None, failures, whether set-up hit a taken port, values so far)."""
    port = find_free_port(host)
    init_method = f"tcp://{host}:{port}"
    results_q = ctx.Queue()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, rank, world_size, tuple(args), init_method, backend, timeout, torch_threads, env, results_q,
                  None if rank_logs is None else str(rank_log_path(rank_logs, rank))),
            name=f"eplb-rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    by_rank = dict(enumerate(procs))
    deadline = time.monotonic() + timeout
    values: dict[int, Any] = {}
    failures: dict[int, str] = {}
    port_taken = False
    try:
        for p in procs:
            start_process(p)
        while len(values) + len(failures) < world_size:
            now = time.monotonic()
            if now >= deadline:
                pending = [r for r in range(world_size) if r not in values and r not in failures]
                raise RanksTimeoutError(pending, timeout, values, failures)
            try:
                rank, status, payload = results_q.get(timeout=min(0.2, deadline - now))
            except queue_mod.Empty:
                note_unreported_deaths(by_rank, values, failures, results_q)
            else:
                _take((rank, status, payload), values, failures)
                if status == "setup_error" and any(s in payload.lower() for s in _ADDR_IN_USE):
                    port_taken = True
            if failures:
                # the others are likely blocked on the failed rank (reported or silently dead)
                settle_after_failure(by_rank, values, failures, results_q)
                break
    finally:
        if len(values) == world_size:
            await_exit(procs)
        stop_processes(procs)  # every started process is joined: none still needs the queue's semaphores
        results_q.close()
        results_q.join_thread()
    if failures:
        return None, failures, port_taken, values
    return [values[r] for r in range(world_size)], {}, False, values


def check_timeout(timeout: Any) -> float:
    """``timeout`` as float seconds (``maps.check_seconds``), else ``ValueError`` naming ``timeout``.

    Checked before any process starts: NaN passes a plain ``> 0`` test the wrong way round,
    and infinity only fails once the ranks are up (a process-group timeout, a deadline).
    """
    try:
        return check_seconds(timeout, "timeout")
    except ValueError:
        raise ValueError(f"timeout: must be a finite number of seconds > 0 and <= {MAX_SECONDS:g}, "
                         f"got {timeout!r}") from None


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    timeout: float = 60.0,
    backend: str = "gloo",
    *,
    host: str = "127.0.0.1",
    start_method: str | None = None,
    torch_threads: int | None = 1,
    env: dict[str, str] | None = None,
    retries: int = 2,
    rank_logs: str | os.PathLike | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return the values by rank.

    Each process joins a ``backend`` process group (TCP rendezvous on a free port found at
    run time, process-group timeout = ``timeout``) before ``fn`` runs and leaves it after.
    ``timeout`` bounds the whole call (start-up included). ``torch_threads`` sets
    ``torch.set_num_threads`` in each rank (1 by default: ranks share few cores).
    ``env`` is added to each rank's environment. A rendezvous port taken between the
    probe and the bind is retried up to ``retries`` times with a new port. With ``rank_logs``
    (a folder), each rank's stdout goes to :func:`rank_log_path` from the process's start, before it
    joins the group: a rank stopped while starting dumps its stacks there, not on the caller's terminal.

    Raises :class:`RankFailedError` if any rank raises or dies, :class:`RanksTimeoutError`
    at the deadline, ``ValueError`` on bad arguments. Every child is stopped before return.
    """
    if not callable(fn):
        raise ValueError(f"fn: must be callable, got {type(fn).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: must be a positive int, got {world_size!r}")
    timeout = check_timeout(timeout)
    ctx = process_context(start_method)
    for attempt in range(retries + 1):
        values, failures, port_taken, partial = _launch_once(
            ctx, fn, world_size, tuple(args), float(timeout), backend, host, torch_threads, env,
            None if rank_logs is None else str(rank_logs),
        )
        if values is not None:
            return values
        if not (port_taken and attempt < retries):
            raise RankFailedError(failures, partial)
    raise AssertionError("unreachable")
