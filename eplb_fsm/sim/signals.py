"""Real signals for the simulator's rank processes: endings on SIGTERM/SIGINT, kill and freeze.

A rank process calls :func:`install` first thing, before any other thread exists:

- it moves into a process group of its own (``setpgid``), so that the launcher can stop
  the rank and everything it started (a freeze helper) with one ``killpg``, and so that a
  Ctrl-C in the terminal reaches the launcher only (the launcher stops the ranks);
- it watches its launcher and sends itself SIGTERM once the launcher is gone, dead or a
  zombie not reaped yet (:func:`die_with_launcher`), so no rank outlives a launcher that was
  killed outright;
- it blocks SIGTERM and SIGINT in every thread and starts one thread that waits for
  them (``sigwait``). That thread runs the registered callbacks, writes ``end how=signal``
  to every trace of the process still open (``trace.end_open_traces``: the controller's),
  writes the stack of every thread to the process's stdout (:func:`dump_stacks`; a
  simulated rank's stdout is its ``rank<NNNNN>.log``, appended to below a line naming the
  process, :func:`log_to`), stops any freeze helper and exits the
  process with ``128 + signum``. It works while the main thread is blocked inside a gloo
  wait, where a Python signal handler would not run until the wait returned. The stacks
  say where each thread was when the launcher stopped the rank: the one question a trace
  cannot answer about a rank that went quiet.

:func:`kill_self` and :func:`freeze_self` are the injected faults: a real SIGKILL sent to
this process, and a real SIGSTOP / SIGCONT pair sent by a helper process (a process
cannot continue itself) while this rank waits for the helper to finish.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

__all__ = ["STOP_SIGNALS", "INTERPRETER_WATCH_S", "install", "on_signal", "clear", "dump_stacks",
           "watch_interpreter", "redirect_stdout", "log_to", "die_with_launcher", "kill_self", "freeze_self",
           "stop_groups", "resume_siblings", "pid_gone"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# a rank whose Python threads make no progress for this long dumps their stacks into its log
INTERPRETER_WATCH_S = 10.0

_callbacks: list[Callable[[str], None]] = []
_helpers: list[subprocess.Popen] = []
_installed = False
_log_path: Path | None = None   # where this process's stdout goes (redirect_stdout), None: where it started
_watching = False


def on_signal(callback: Callable[[str], None]) -> None:
    """Call ``callback(signal_name)`` when SIGTERM/SIGINT arrives, before the process exits."""
    _callbacks.append(callback)


def clear() -> None:
    """Forget the registered callbacks (a rank loop that has closed its trace)."""
    _callbacks.clear()


def dump_stacks(reason: str, fd: int = 1) -> None:
    """Write ``reason`` and the Python stack of every thread of this process to ``fd`` (default: stdout, a
    simulated rank's log): :func:`eplb_fsm.stop_signals.dump_stacks`, which reads frames without the GIL."""
    from eplb_fsm.stop_signals import dump_stacks as dump

    dump(reason, fd)


def watch_interpreter(timeout_s: float, period_s: float = 1.0) -> threading.Thread:
    """Dump every thread's stack to stdout when this process's Python threads stop running for ``timeout_s``.

    A daemon thread re-arms ``faulthandler.dump_traceback_later(timeout_s)`` every
    ``period_s``; the dump itself comes from faulthandler's C thread, which needs no GIL.
    So when no Python thread can run for ``timeout_s`` (a C call that holds the GIL and
    blocks, a real SIGSTOP: the dump then comes right after SIGCONT) the rank's log says
    where each thread stood. The simulator's ranks only: ``dump_traceback_later`` is one
    per process, and a library must not take it from its host.
    """
    import faulthandler

    if not (timeout_s > period_s > 0):
        raise ValueError(f"watch_interpreter: need timeout_s > period_s > 0, got {timeout_s!r}, {period_s!r}")

    def rearm() -> None:
        while True:
            faulthandler.dump_traceback_later(timeout_s, repeat=False, file=sys.stdout, exit=False)
            time.sleep(period_s)

    thread = threading.Thread(target=rearm, name="eplb-interpreter-watch", daemon=True)
    thread.start()
    return thread


def redirect_stdout(path: Path) -> None:
    """Append this process's stdout (fd 1) to ``path``, starting with a line naming the process; once per path.

    Starts no thread, so a rank process may call it before :func:`install` (which must run while
    the process has one thread): from then on whatever the process prints, the stacks a stop
    makes it dump included, lands in its log and not on the launcher's terminal.
    """
    global _log_path
    path = Path(path)
    if _log_path == path:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.close(fd)
    _log_path = path
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    os.write(1, f"===== eplb-fsm rank process {os.getpid()} started {started} =====\n".encode())


def log_to(path: Path) -> None:
    """Append this rank process's stdout (structlog's default sink) to ``path``, and watch its threads there.

    Appended, never truncated: a reused ``--trace-dir`` keeps the earlier runs' logs (their
    stack dumps) as it keeps their traces. Each process first writes
    ``===== eplb-fsm rank process <pid> started <UTC time> =====``; the ``pid`` is the one
    in the header of the trace this process writes, so a log part is matched to its run
    (``eplb-fsm replay --run-id``) by it. A process already sent there (:func:`redirect_stdout`,
    done by the launcher before the rank joined its group) is not sent again.

    A rank whose Python threads all stop for :data:`INTERPRETER_WATCH_S` (a C call holding
    the GIL, a real freeze) leaves their stacks in that file (:func:`watch_interpreter`).
    """
    global _watching
    redirect_stdout(path)
    if not _watching:
        _watching = True
        watch_interpreter(INTERPRETER_WATCH_S)


def _handle(signum: int) -> None:
    name = signal.Signals(signum).name
    for callback in list(_callbacks):
        with contextlib.suppress(Exception):
            callback(name)
    with contextlib.suppress(Exception):
        from eplb_fsm.trace import end_open_traces

        end_open_traces("signal", signal=name)
    with contextlib.suppress(Exception):
        dump_stacks(f"{name} received (pid {os.getpid()})")
    for helper in list(_helpers):
        with contextlib.suppress(Exception):
            helper.kill()
    os._exit(128 + signum)


def _wait_loop() -> None:
    signum = signal.sigwait(set(STOP_SIGNALS))
    _handle(signum)


def pid_gone(pid: int) -> bool:
    """True when ``pid`` no longer runs: no such process, or a zombie (state Z or X in ``/proc``).

    ``kill(pid, 0)`` alone succeeds on a zombie: a launcher SIGKILLed but not yet reaped by its
    own parent would count as alive for as long as that parent does not wait on it.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:   # alive, owned by someone else: its state is still readable below
        pass
    try:
        fields = _stat_fields(pid)
    except FileNotFoundError:   # reaped between the two looks
        return True
    except OSError:   # no /proc (not Linux): kill() said it exists
        return False
    return bool(fields) and fields[0] in (b"Z", b"X")


def _stat_fields(pid: int) -> list[bytes]:
    """The fields of ``/proc/<pid>/stat`` after the process name (state first, then the parent's pid)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    return stat[stat.rfind(b")") + 2:].split()   # the name in (...) may hold spaces and parentheses


def die_with_launcher(period_s: float = 1.0) -> threading.Thread | None:
    """End this rank (SIGTERM to itself) once the process that launched it is gone.

    The launcher is ``multiprocessing.parent_process()`` (with a forkserver, the process
    that asked for the rank, not the forkserver, which outlives it). A launcher killed
    outright (SIGKILL, a crash: it stops no one) so no longer leaves its ranks running and
    waiting on each other: each ends through the signal thread, with its ``end how=signal``
    record. Returns the watching thread (None: no launcher known).

    Gone means either of two signs. First the launcher's end of the pipe multiprocessing
    started this process through (its ``sentinel``): with a forkserver or spawn only the
    launcher holds the write end, so end-of-file comes the moment it dies, zombie or not.
    Then, every ``period_s``, its pid: no such process, or a zombie its own parent has not
    reaped yet (``kill(pid, 0)`` succeeds on one, so ``/proc/<pid>/stat`` is read too). The pid
    check covers the fork start method, where sibling ranks inherit copies of the write end. Before it
    ends itself it resumes its stopped siblings (:func:`resume_siblings`).
    """
    import multiprocessing
    from multiprocessing.connection import wait

    parent = multiprocessing.parent_process()
    if parent is None or parent.pid is None:
        return None
    launcher = parent.pid
    try:
        sentinel = parent.sentinel
    except (AttributeError, ValueError):   # a parent object without one: the pid check alone
        sentinel = None

    def watch() -> None:
        use_pipe = sentinel is not None
        while True:
            gone = False
            if use_pipe:
                try:
                    gone = bool(wait([sentinel], timeout=period_s))
                except (OSError, ValueError):   # the fd was closed under us: its number may be reused, drop it
                    use_pipe = False
            if not use_pipe:
                time.sleep(period_s)
            if gone or pid_gone(launcher):
                resume_siblings()
                os.kill(os.getpid(), signal.SIGTERM)
                return

    thread = threading.Thread(target=watch, name="eplb-launcher-watch", daemon=True)
    thread.start()
    return thread


def resume_siblings() -> None:
    """SIGCONT this rank's sibling ranks: the other children of its parent, when that parent is a forkserver.

    A rank stopped (SIGSTOP) when its launcher died cannot notice: its watch thread stops with it, and the
    forkserver, its parent, lives on while it does, so it would stay a stopped orphan. Resumed by a sibling
    that noticed, its own watch ends it. Only a forkserver's children (its command line says so): with spawn
    the parent is the launcher itself, and after its death whatever adopted the rank is no one's business here.
    """
    parent = os.getppid()
    try:
        with open(f"/proc/{parent}/cmdline", "rb") as f:
            if b"multiprocessing.forkserver" not in f.read():
                return
        pids = [int(e) for e in os.listdir("/proc") if e.isdigit() and int(e) != os.getpid()]
    except OSError:   # no /proc (not Linux), or the parent is gone
        return
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int(_stat_fields(pid)[1]) == parent:
                os.kill(pid, signal.SIGCONT)


def install(new_group: bool = True) -> None:
    """Own process group + a thread that turns SIGTERM/SIGINT into callbacks and an exit (once per process).

    Must run while the process has a single thread: threads started later inherit the
    blocked mask, so the signal reaches only the waiting thread.
    """
    global _installed
    if _installed:
        return
    _installed = True
    if new_group:
        with contextlib.suppress(OSError):
            os.setpgid(0, 0)
    signal.pthread_sigmask(signal.SIG_BLOCK, set(STOP_SIGNALS))
    threading.Thread(target=_wait_loop, name="eplb-signals", daemon=True).start()
    die_with_launcher()


def kill_self() -> None:
    """SIGKILL this process (no clean-up, no ``end`` record: what an OOM kill looks like)."""
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def freeze_self(seconds: float, timeout_s: float | None = None) -> None:
    """Be stopped by a real SIGSTOP for ``seconds``, then continued by SIGCONT; returns after.

    A helper process (``/bin/sh``, in this rank's process group) sends both signals and
    then writes one line; this rank blocks reading that line, so it does not run on
    between asking for the freeze and being stopped. ``timeout_s`` bounds the wait
    (default ``seconds + 30``).
    """
    pid = os.getpid()
    script = f"kill -STOP {pid}; sleep {float(seconds):g}; kill -CONT {pid}; echo done"
    helper = subprocess.Popen(["/bin/sh", "-c", script], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    _helpers.append(helper)
    try:
        helper.communicate(timeout=float(seconds) + 30.0 if timeout_s is None else timeout_s)
    except subprocess.TimeoutExpired:
        helper.kill()
        helper.wait(5.0)
    finally:
        with contextlib.suppress(ValueError):
            _helpers.remove(helper)


def _signal_group(pid: int, sig: int) -> bool:
    """Send ``sig`` to the process group ``pid`` leads (True), or to ``pid`` alone if it leads none."""
    try:
        os.killpg(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
        return False


def stop_groups(pids: list[int], grace: float, is_alive: Callable[[int], bool],
                join: Callable[[int, float], None]) -> None:
    """Stop rank processes and whatever they started: SIGTERM (+SIGCONT, so a frozen one can act on it),
    ``grace`` seconds for their ``end`` records, then SIGKILL to each group.

    ``is_alive(pid)`` / ``join(pid, timeout)`` come from the launcher's process objects.
    Bound: ``grace`` + the joins' timeout.

    A process counts as running while ``is_alive`` says so or its pid still runs: a SIGTERM sent to
    the launcher's whole process group (``timeout``, a batch scheduler) also ends the forkserver the
    ranks came from, and from then on multiprocessing reports every rank as ended (exit code 255)
    while they still write their ``end`` records.
    """

    def running(pid: int) -> bool:
        return is_alive(pid) or not pid_gone(pid)

    live = [pid for pid in pids if running(pid)]
    for pid in live:
        _signal_group(pid, signal.SIGTERM)
        _signal_group(pid, signal.SIGCONT)
    deadline = time.monotonic() + grace
    for pid in live:
        join(pid, max(0.0, deadline - time.monotonic()))
        while not pid_gone(pid) and time.monotonic() < deadline:   # join() cannot tell: see above
            time.sleep(0.01)
    for pid in pids:
        # the whole group: a rank that ended may have left a helper behind
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        if running(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
            join(pid, 5.0)
