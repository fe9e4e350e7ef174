"""The launcher of an elastic simulation (``simulate --scale``): it owns every process.

It hosts the TCP store every EP group is built from, starts the first ranks, starts a
scale-up's joiners when old rank 0 announces the scale in the store (never for
``STEP:RANKS:absent``; for ``STEP:RANKS:late`` once old rank 0 has put the scale's
outcome there too), collects one result per process and stops them all at the end
(after every process that reported had ``EXIT_GRACE`` s to exit on its own, as in
``sim.launcher``: a clean run logs no signal), at the first failure (one reported, or
a process gone without a report) or at the deadline. A joiner whose scale aborted reports a result
(status ``not_joined``), not a failure. What each process runs is
``eplb_fsm.sim.elastic.run_elastic_rank``.
"""

from __future__ import annotations

import pickle
import queue as queue_mod
import time
import traceback
from typing import Any

from eplb_fsm.sim.elastic import JOINER_ID, outcome_key, rank_log_name, run_elastic_rank, scale_events, spawn_key
# the fixed-size launcher's bookkeeping: a dead or failed process stops the run the same way in both
from eplb_fsm.sim.launcher import (
    RankFailedError, RanksTimeoutError, await_exit, check_timeout, note_unreported_deaths, process_context,
    settle_after_failure, start_process, stop_processes,
)

__all__ = ["run_elastic", "settle_after_failure"]


def _process_main(role: str, rank: int, world: int, opts: Any, store_info: Any, join: dict | None,
                  pid_key: int, results: Any) -> None:
    """One child process: run its rank and put ``(pid_key, "ok" | "error", result | traceback)`` on ``results``."""
    from pathlib import Path

    from eplb_fsm.sim import signals

    if opts.log_dir and opts.redirect_output:
        try:  # first (no thread yet): a process stopped while it starts dumps its stacks in its log, not on a terminal
            signals.redirect_stdout(Path(opts.log_dir) / rank_log_name(rank, join))
        except OSError:
            results.put((pid_key, "error", traceback.format_exc()))
            return
    signals.install()  # issue 12 wiring: own process group, SIGTERM -> `end how=signal` (sim/signals.py)
    try:
        import torch

        torch.set_num_threads(1)
        value = run_elastic_rank(role, rank, world, opts, store_info, join)
    except BaseException:
        results.put((pid_key, "error", traceback.format_exc()))
        return
    results.put((pid_key, "ok", value))


def run_elastic(opts: Any, timeout: float = 300.0, start_method: str | None = None) -> list[dict]:
    """Run an elastic simulation; returns every process's result (first ranks, then joiners).

    Raises ``RankFailedError`` (keys: process ids) if a process raises or dies,
    ``RanksTimeoutError`` at the deadline; no child outlives the call.
    """
    from eplb_fsm.transfer.groups import host_store

    events = scale_events(opts)
    timeout = check_timeout(timeout)  # NaN or inf: a ValueError before the store and any process start
    ctx = process_context(start_method)
    store, info = host_store(timeout_s=max(60.0, opts.collective_timeout_s + 30.0), namespace="eplb")
    results_q = ctx.Queue()
    procs: dict[int, Any] = {}
    values: dict[int, dict] = {}
    failures: dict[int, str] = {}
    spawned: set[int] = set()
    deadline = time.monotonic() + timeout

    def start(role: str, rank: int, world: int, join: dict | None) -> None:
        key = rank if join is None else JOINER_ID * (join["index"] + 1) + rank
        p = ctx.Process(target=_process_main, args=(role, rank, world, opts, info, join, key, results_q),
                        name=f"eplb-elastic-{key}", daemon=True)
        procs[key] = p    # first: a Ctrl-C held through the start acts as it returns, and the stop must see p
        start_process(p)  # a Ctrl-C waits for the pid: the stop below must reach every process started

    def poll_spawns() -> None:
        for index, event in enumerate(events):
            if index in spawned or not store.check([spawn_key(index)]):
                continue
            if event.late and not store.check([outcome_key(index)]):
                continue  # a late joiner starts once the serving ranks are done with the scale
            spawned.add(index)
            announce = pickle.loads(store.get(spawn_key(index)))
            if event.absent:
                continue
            for r in announce["joiners"]:
                start("joiner", r, announce["to"], {"index": index, "generation": announce["generation"],
                                                   "step": announce["step"]})

    try:
        for r in range(opts.ranks):
            start("initial", r, opts.ranks, None)
        while True:
            poll_spawns()
            if len(values) + len(failures) == len(procs):
                poll_spawns()  # a last announcement may have come with the last result
                if len(values) + len(failures) == len(procs):
                    break
            now = time.monotonic()
            if now >= deadline:
                pending = [k for k in procs if k not in values and k not in failures]
                err = RanksTimeoutError(pending, timeout, values, failures)
                err.processes = sorted(procs)  # issue 12 wiring: the report lists every joiner started
                raise err
            try:
                key, status, payload = results_q.get(timeout=min(0.1, deadline - now))
            except queue_mod.Empty:
                note_unreported_deaths(procs, values, failures, results_q)
            else:
                (values if status == "ok" else failures)[key] = payload
            if failures:
                settle_after_failure(procs, values, failures, results_q)
                break
    finally:
        if procs and len(values) == len(procs):
            # every process reported: let each finish its own exit, so a clean run logs no SIGTERM
            await_exit(list(procs.values()))
        stop_processes(list(procs.values()))
        results_q.close()
        results_q.join_thread()
        store = None  # its last reference: the TCP store shuts down here
    if failures:
        err = RankFailedError(failures, values)
        err.processes = sorted(procs)  # issue 12 wiring: the report lists every joiner started
        raise err
    return [values[k] for k in sorted(values)]
