"""Ending a rank's traces when a launcher stops it: ``end how=signal`` under torchrun and its like.

A launcher that sees one rank gone (torchrun, a scheduler, ``eplb-fsm simulate``) sends SIGTERM to the
ranks still running. With Python's default disposition such a rank dies at once and writes nothing, so
every rank's trace just stops: the rank killed first and the ranks the launcher stopped after it look
alike, and ``eplb-fsm replay`` can only say that no rank ended. A rank that writes ``end how=signal``
(with the signal's name) on the way out gives replay what it needs: ranks stopped by a signal after
another rank's trace had stopped are the launcher's reaction, and the rank without an ``end`` is the
cause (docs/debugging-hangs.md, "Real failures").

The library never takes a signal on its own (signals belong to the host, as logging does); the engine
asks for it once, first thing in each rank process::

    import eplb_fsm.stop_signals
    eplb_fsm.stop_signals.end_traces_on_signal()      # before init_process_group and the controller

:func:`end_traces_on_signal` blocks the signals in the calling thread, which every thread started later
inherits, and starts one thread that waits for them (``sigwait``). It works while the main thread is
blocked inside a gloo or NCCL wait, where a Python signal handler would run only once the wait
returned. On a signal that thread writes ``end`` to every trace of the process still open (with the
sender: its pid, and whether it is this process's parent, the launcher), writes the
Python stack of every thread to stderr (where each thread stood when the launcher stopped the rank:
the one thing a trace cannot say about a rank that went quiet), and ends the process by that same
signal with its default action, so the launcher sees the exit it expects (torchrun: ``exitcode -15``).
A host that handles SIGTERM itself calls :func:`eplb_fsm.trace.end_open_traces` ``("signal",
signal="SIGTERM")`` from its own handler instead.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

__all__ = ["end_traces_on_signal", "dump_stacks", "thread_count"]

# what sigwait can take: SIGKILL and SIGSTOP cannot be caught, and the fault signals belong to faulthandler
_REFUSED = {signal.SIGKILL, signal.SIGSTOP, signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL}
_installed: tuple[frozenset, bool] | None = None   # (signals, stacks) of the call that took effect


def thread_count() -> int:
    """Threads of this process: the OS's count on Linux (native threads included), else Python's."""
    with contextlib.suppress(OSError):
        return len(os.listdir("/proc/self/task"))
    return threading.active_count()


def dump_stacks(reason: str, fd: int = 2) -> None:
    """Write ``reason`` and the Python stack of every thread of this process to ``fd`` (default: stderr).

    ``faulthandler`` reads the frames without taking the GIL, so the dump works even when
    another thread holds it (a C call that never returns, a deadlock).
    """
    import faulthandler

    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
        sys.stderr.flush()
    os.write(fd, f"eplb-signals: {reason}; the stack of every thread follows\n".encode())
    faulthandler.dump_traceback(file=fd, all_threads=True)


def _checked(signals) -> frozenset:
    try:
        chosen = list(signals)
    except TypeError:
        raise ValueError(f"signals must be a list of signals, got {type(signals).__name__}") from None
    if not chosen:
        raise ValueError("signals must name at least one signal")
    out = []
    for s in chosen:
        if isinstance(s, bool) or not isinstance(s, int):
            raise ValueError(f"signals must hold signal numbers (signal.SIGTERM, ...), got {s!r}")
        try:
            s = signal.Signals(s)
        except ValueError:
            raise ValueError(f"signals: {s} is no signal of this platform") from None
        if s in _REFUSED:
            raise ValueError(f"signals: {s.name} cannot be taken (SIGKILL and SIGSTOP cannot be caught; "
                             "SIGSEGV, SIGBUS, SIGFPE and SIGILL are faulthandler's)")
        out.append(s)
    return frozenset(out)


def end_traces_on_signal(signals=(signal.SIGTERM,), stacks: bool = True) -> None:
    """End every open trace of this process with ``how: signal`` when one of ``signals`` arrives, then die by it.

    Call once per process, from the main thread, before any other thread exists (before ``import torch``,
    which starts one, and so before the process group and the controller): a thread started earlier does not block
    the signals, and the kernel may hand the signal to it, which ends the process with no ``end``.
    ``signals``: SIGTERM by default (what torchrun and most schedulers send); add ``signal.SIGINT`` to
    trace a Ctrl-C too (the process then dies by it instead of raising ``KeyboardInterrupt``). ``stacks``:
    write every thread's Python stack to stderr before the end. A second call with the same arguments does
    nothing. Raises ``ValueError`` naming the rule before anything changes.
    """
    global _installed
    chosen = _checked(signals)
    if not isinstance(stacks, bool):
        raise ValueError(f"stacks must be a bool, got {type(stacks).__name__}")
    if _installed is not None:
        if _installed != (chosen, stacks):
            raise ValueError("end_traces_on_signal was already called with other signals or stacks "
                             "(once per process)")
        return
    if threading.current_thread() is not threading.main_thread():
        raise ValueError("end_traces_on_signal must be called from the main thread")
    count = thread_count()
    if count > 1:
        raise ValueError(f"end_traces_on_signal must be called before any other thread starts (this process "
                         f"has {count} threads): call it first thing in the rank process, before "
                         "init_process_group and the controller")
    for s in chosen:   # the default action at the end; a handler set later is honoured (see _end)
        signal.signal(s, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_BLOCK, chosen)
    _installed = (chosen, stacks)
    threading.Thread(target=_wait, args=(chosen, stacks), name="eplb-stop-signals", daemon=True).start()


def _wait(chosen: frozenset, stacks: bool) -> None:
    if not hasattr(signal, "sigwaitinfo"):   # macOS: the signal alone, no sender
        _end(signal.sigwait(chosen), stacks)
        return
    info = signal.sigwaitinfo(chosen)
    # who sent it: a launcher stopping its ranks is their parent; an operator's kill, or a scheduler, is not
    _end(info.si_signo, stacks, {"pid": int(info.si_pid), "parent": int(info.si_pid) == os.getppid()})


def _end(signum: int, stacks: bool, sender: dict | None = None) -> None:
    name = signal.Signals(signum).name
    with contextlib.suppress(Exception):   # nothing may keep the process from ending
        from eplb_fsm.trace_owners import end_open_traces

        end_open_traces("signal", signal=name, sender=sender)
    if stacks:
        with contextlib.suppress(Exception):
            dump_stacks(f"{name} received (pid {os.getpid()})")
    if signal.getsignal(signum) == signal.SIG_DFL:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
        signal.pthread_kill(threading.get_ident(), signum)   # its default action ends the whole process
    os._exit(128 + signum)   # a handler the host set since: exit as a shell reports that signal
