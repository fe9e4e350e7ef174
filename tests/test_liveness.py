"""The liveness thread: `alive` records at a set rate, with the step seen at the previous one."""

from __future__ import annotations

import threading
import time

import pytest

from eplb_fsm.liveness import DEFAULT_INTERVAL_S, Liveness, check_interval
from eplb_fsm.trace import EventTrace, read_trace, trace_path


def test_tick_carries_step_state_and_steps_seen():
    """Each record has the trace's current step/state and steps_seen = the step at the previous record."""
    trace = EventTrace(rank=1, world=2, keep=True)
    live = Liveness(trace, interval_s=0.5)
    trace.set_context(state="collecting", step=3)
    first = live.tick()
    trace.set_context(step=9)
    second = live.tick()
    third = live.tick()
    assert (first["step"], first["steps_seen"], first["state"]) == (3, None, "collecting")
    assert (second["step"], second["steps_seen"]) == (9, 3)
    # a rank whose step no longer advances: step == steps_seen
    assert (third["step"], third["steps_seen"]) == (9, 9)
    assert all(r["interval_s"] == 0.5 for r in (first, second, third))


def test_no_alive_after_end():
    """Once the trace has ended, tick writes nothing."""
    trace = EventTrace(keep=True)
    live = Liveness(trace, interval_s=1.0)
    trace.end("closed")
    assert live.tick() is None
    assert [r["event"] for r in trace.records] == ["end"]


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), "1", True])
def test_bad_interval_is_refused(bad):
    """The interval must be a finite number > 0; the error names the field."""
    with pytest.raises(ValueError, match="liveness_interval_s"):
        check_interval(bad)


def test_thread_writes_records_until_stopped(tmp_path):
    """The thread writes alive records to the file while running and stops when asked."""
    from eplb_fsm.fsm.reporting import SharedTrace

    trace = SharedTrace(0, 1, tmp_path)
    live = Liveness(trace, interval_s=0.05).start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if sum(1 for r in read_trace(trace_path(tmp_path, 0))[0] if r["event"] == "alive") >= 2:
            break
        time.sleep(0.02)
    assert live.stop(timeout=5.0) and not live.running
    trace.close()
    alive = [r for r in read_trace(trace_path(tmp_path, 0))[0] if r["event"] == "alive"]
    assert len(alive) >= 2 and [r["seq"] for r in alive] == sorted(r["seq"] for r in alive)


def test_controller_writes_alive_and_ends_closed(tmp_path):
    """A controller with a trace file writes alive records and its close writes `end how=closed` last."""
    from eplb_fsm.config import EplbConfig
    from eplb_fsm.fsm.controller import EplbController

    ctl = EplbController(EplbConfig(), trace_dir=str(tmp_path), liveness_interval_s=0.05)
    assert ctl.liveness is not None and ctl.liveness.interval_s == 0.05
    done = threading.Event()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not done.is_set():
        if any(r["event"] == "alive" for r in read_trace(trace_path(tmp_path, 0))[0]):
            done.set()
        time.sleep(0.02)
    ctl.close()
    records = read_trace(trace_path(tmp_path, 0))[0]
    assert done.is_set()
    assert records[-1]["event"] == "end" and records[-1]["how"] == "closed"
    assert not ctl.liveness.running


def test_controller_without_a_trace_file_has_no_liveness_thread():
    """No trace_dir: no thread (nothing to write to); the default rate is documented as 1 s."""
    from eplb_fsm.config import EplbConfig
    from eplb_fsm.fsm.controller import EplbController

    with EplbController(EplbConfig(), keep_trace=True) as ctl:
        assert not ctl.liveness.running
    assert DEFAULT_INTERVAL_S == 1.0
    assert ctl.trace.records[-1]["event"] == "end"


def test_controller_refuses_a_bad_liveness_interval():
    """A negative interval fails at construction, naming the field."""
    from eplb_fsm.config import EplbConfig
    from eplb_fsm.fsm.controller import EplbController

    with pytest.raises(ValueError, match="liveness_interval_s"):
        EplbController(EplbConfig(), liveness_interval_s=-1.0)
