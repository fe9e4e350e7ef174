"""Watchdog: a stuck (state, layer) is logged with the last collective; resting states never are."""

from __future__ import annotations

import contextlib
import time

import structlog

from eplb_fsm.config import EplbConfig
from eplb_fsm.fsm.controller import EplbController
from eplb_fsm.fsm.machine import Fired
from eplb_fsm.fsm.watchdog import Watchdog
from eplb_fsm.trace import EventTrace


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_stuck_record_names_state_layer_and_last_collective():
    """Past the deadline in transferring, a stuck record carries state, layer, seconds and the last collective."""
    clock = FakeClock()
    trace = EventTrace(keep=True)
    dog = Watchdog(trace, deadline_s=5.0, clock=clock, logger=structlog.get_logger("test"))
    dog.on_fired(Fired("plan_ready", "planning", "transferring", 2, {}))
    with trace.collective("batch_isend_irecv", group="ep_transfer", layer=2):
        pass
    clock.now += 4.0
    assert dog.check() is None
    clock.now += 2.0
    with structlog.testing.capture_logs() as logs:
        record = dog.check()
    assert record["event"] == "stuck" and record["state"] == "transferring" and record["layer"] == 2
    assert record["seconds"] == 6.0
    assert record["last_collective"]["op"] == "batch_isend_irecv"
    assert record["last_collective"]["group"] == "ep_transfer"
    assert logs and logs[0]["event"] == "eplb stuck" and logs[0]["log_level"] == "warning"


def test_stuck_repeats_each_deadline_and_progress_resets():
    """A stuck state is reported again each further deadline; a layer change restarts the clock."""
    clock = FakeClock()
    dog = Watchdog(EventTrace(keep=True), deadline_s=5.0, clock=clock, logger=structlog.get_logger("test"))
    dog.progress("transferring", 0)
    clock.now += 5.0
    assert dog.check() is not None
    clock.now += 1.0
    assert dog.check() is None
    clock.now += 4.0
    assert dog.check()["seconds"] == 10.0
    dog.progress("transferring", 1)
    clock.now += 4.0
    assert dog.check() is None


def test_collecting_and_failed_are_never_stuck():
    """Resting states (waiting for the interval, waiting for the engine) never produce stuck records."""
    clock = FakeClock()
    dog = Watchdog(EventTrace(keep=True), deadline_s=1.0, clock=clock, logger=structlog.get_logger("test"))
    for state in ("collecting", "failed"):
        dog.progress(state, 0)
        clock.now += 100.0
        assert dog.check() is None
    assert dog.reports == []


def test_controller_runs_a_watchdog_thread_that_reports_a_stalled_transfer():
    """With watchdog_deadline_s set, a controller stuck in a state gets a stuck record from the thread."""
    config = EplbConfig(window_size=4, step_interval=8, watchdog_deadline_s=0.1)
    ctl = EplbController(config, keep_trace=True)
    try:
        assert ctl.watchdog is not None and ctl.watchdog.running
        ctl.watchdog.poll_s = 0.02
        ctl.machine.fire("step", due=True)  # planning, and nothing drives it further
        deadline = time.monotonic() + 5.0
        while not ctl.watchdog.reports and time.monotonic() < deadline:
            time.sleep(0.02)
        stuck = [r for r in ctl.trace.records if r["event"] == "stuck"]
        assert stuck and stuck[0]["state"] == "planning"
    finally:
        ctl.close()
    assert not ctl.watchdog.running


def test_watchdog_off_by_default():
    """watchdog_deadline_s = 0 means no watchdog thread."""
    ctl = EplbController(EplbConfig())
    assert ctl.watchdog is None
    ctl.close()


class _RaisingTrace:
    """A trace whose every write raises (a broken trace): what the watchdog thread's checks run into."""

    rank = 0
    last_collective = None

    def __init__(self) -> None:
        self.calls = 0

    def emit(self, event, **fields):
        self.calls += 1
        raise RuntimeError("trace broken")


def test_a_log_that_cannot_get_out_never_stops_the_watchdog():
    """Logs printed to /dev/full: check() still returns its stuck record; the thread goes on through failing checks."""
    full = open("/dev/full", "w")
    logger = structlog.wrap_logger(structlog.PrintLogger(full))
    clock = FakeClock()
    dog = Watchdog(EventTrace(keep=True), deadline_s=5.0, clock=clock, logger=logger)
    dog.progress("transferring", 0)
    clock.now += 6.0
    record = dog.check()
    assert record["event"] == "stuck" and dog.reports == [record]
    broken = _RaisingTrace()
    polled = Watchdog(broken, deadline_s=0.01, poll_s=0.01, logger=logger, state="planning").start()
    try:
        deadline = time.monotonic() + 30
        while broken.calls < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert polled.running and broken.calls >= 3
    finally:
        assert polled.stop(timeout=5.0)
        with contextlib.suppress(OSError):   # the text the failed prints left in its buffer fails again
            full.close()
