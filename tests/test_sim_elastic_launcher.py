"""The elastic launcher's bookkeeping: who died, who was only stopped; a clean run ends with no signal."""

from __future__ import annotations

import queue
import time
from types import SimpleNamespace

import pytest

from eplb_fsm.sim.elastic_launcher import settle_after_failure


def test_a_process_killed_while_another_reported_is_named_as_died():
    """After a failure, a process gone by a signal is a failure of its own; a live or cleanly exited one is not."""
    procs = {0: SimpleNamespace(exitcode=None), 1: SimpleNamespace(exitcode=0), 1002: SimpleNamespace(exitcode=-9)}
    values: dict = {}
    failures = {1: "RuntimeError: Connection closed by peer"}
    settle_after_failure(procs, values, failures, queue.Queue())
    assert failures == {1: "RuntimeError: Connection closed by peer",
                        1002: "process exited with code -9 without reporting"}
    assert values == {}


def test_reports_that_arrive_within_the_grace_are_taken_first():
    """A report still in the queue counts as what that process did, before any exit code is read."""
    procs = {0: SimpleNamespace(exitcode=-15), 1: SimpleNamespace(exitcode=0), 2: SimpleNamespace(exitcode=None)}
    results: queue.Queue = queue.Queue()
    results.put((0, "error", "ValueError: bad"))
    results.put((2, "ok", {"rank": 2}))
    values: dict = {}
    failures = {1: "RuntimeError: x"}
    settle_after_failure(procs, values, failures, results)
    assert failures == {1: "RuntimeError: x", 0: "ValueError: bad"} and values == {2: {"rank": 2}}


def test_a_process_gone_without_a_report_is_a_failure_once_the_queue_is_quiet():
    """A dead process with nothing in flight is named with its exit code; a live or reported one is not."""
    from eplb_fsm.sim.launcher import note_unreported_deaths

    procs = {0: SimpleNamespace(exitcode=None), 1: SimpleNamespace(exitcode=3), 2: SimpleNamespace(exitcode=0)}
    values: dict = {2: {"rank": 2}}
    failures: dict = {}
    note_unreported_deaths(procs, values, failures, queue.Queue())
    assert failures == {1: "process exited with code 3 without reporting"} and values == {2: {"rank": 2}}


class SlowExit:
    """A per-rank hook: the process is still in its exit path (a finalizer) for 0.5 s after it reported."""

    def on_start(self, ctx):
        from multiprocessing import util

        util.Finalize(None, time.sleep, args=(0.5,), exitpriority=100)


def make_slow_exit() -> SlowExit:
    return SlowExit()


@pytest.mark.multiprocess
def test_a_clean_elastic_run_lets_its_processes_exit_unsignalled(tmp_path):
    """After every process of a clean --scale run reported, none is sent SIGTERM: no rank log holds its dump."""
    from eplb_fsm.cli import build_parser
    from eplb_fsm.commands.simulate import build_options
    from eplb_fsm.commands.simulate_run import run_simulation

    args = build_parser().parse_args([
        "simulate", "--ranks", "2", "--layers", "2", "--experts", "8", "--redundant", "2", "--steps", "10",
        "--interval", "5", "--window", "4", "--scale", "5:3", "--trace-dir", str(tmp_path), "--no-png",
        "--no-progress"])
    args.hooks = [(f"{__name__}:make_slow_exit", {})]
    report = run_simulation(build_options(args), progress=False, timeout=120, want_png=False)
    assert report["ok"], report
    logs = sorted(p.name for p in tmp_path.glob("*.log"))
    assert logs == ["rank00000.log", "rank00001.log", "rank00002.g1.log"]
    for name in logs:
        assert "SIGTERM received" not in (tmp_path / name).read_text(), name
