"""The elastic launcher's bookkeeping once a process failed: who died, who was only stopped."""

from __future__ import annotations

import queue
from types import SimpleNamespace

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
