"""Tests for eplb_fsm.trace."""

import json

import pytest

from eplb_fsm.trace import BASE_FIELDS, COLLECTIVE_FIELDS, EventTrace, read_trace, trace_path


def _ticks():
    t = [100.0]

    def clock():
        t[0] += 1.0
        return t[0]

    return clock


def test_every_record_has_the_base_fields_and_counts_seq(tmp_path):
    """Each line is JSON with ts, rank, world, event, state, step, seq, and seq counts up per rank."""
    with EventTrace(rank=2, world=4, trace_dir=tmp_path, clock=_ticks()) as trace:
        trace.set_context(state="collecting", step=7)
        trace.emit("step")
        trace.emit("balancedness", value=0.5)
    records, bad = read_trace(trace_path(tmp_path, 2))
    assert bad == 0 and [r["seq"] for r in records] == [0, 1]
    for r in records:
        assert set(BASE_FIELDS) <= set(r)
        assert (r["rank"], r["world"], r["state"], r["step"]) == (2, 4, "collecting", 7)
    assert records[1]["value"] == 0.5 and records[0]["ts"] == 101.0


def test_lines_are_on_disk_before_close(tmp_path):
    """Records are flushed per line, so a rank that dies mid-run leaves them readable."""
    trace = EventTrace(rank=0, world=1, trace_dir=tmp_path)
    trace.emit("transition", trigger="step")
    text = trace_path(tmp_path, 0).read_text()
    assert json.loads(text.splitlines()[0])["trigger"] == "step"
    trace.close()


def test_collective_pairs_and_per_group_counters():
    """A collective writes start/end with op, group, shape, dtype, and cseq counts per group."""
    trace = EventTrace(keep=True)
    with trace.collective("all_reduce", shape=(3, 4), dtype="torch.int64", layer=1):
        pass
    with trace.collective("batch_isend_irecv", group="transfer"):
        pass
    with trace.collective("all_reduce"):
        pass
    kinds = [(r["event"], r["group"], r["cseq"]) for r in trace.records]
    assert kinds == [
        ("collective_start", "world", 0), ("collective_end", "world", 0),
        ("collective_start", "transfer", 0), ("collective_end", "transfer", 0),
        ("collective_start", "world", 1), ("collective_end", "world", 1),
    ]
    first = trace.records[0]
    assert set(COLLECTIVE_FIELDS) <= set(first)
    assert first["shape"] == [3, 4] and first["dtype"] == "torch.int64" and first["layer"] == 1
    assert trace.last_collective["group"] == "world" and trace.last_collective["cseq"] == 1


def test_collective_error_is_recorded_and_reraised():
    """An exception inside a collective writes collective_error and propagates."""
    trace = EventTrace(keep=True)
    with pytest.raises(TimeoutError):
        with trace.collective("all_reduce"):
            raise TimeoutError("peer 3 silent")
    assert [r["event"] for r in trace.records] == ["collective_start", "collective_error"]
    assert "peer 3 silent" in trace.records[1]["error"]


def test_transition_updates_state_context():
    """A transition record carries trigger/source/dest and later records carry the new state."""
    trace = EventTrace(keep=True)
    trace.set_context(state="collecting")
    trace.transition("step", "collecting", "planning", layer=0, due=True)
    trace.emit("plan_skipped")
    assert trace.records[0]["dest"] == "planning" and trace.records[0]["due"] is True
    assert trace.records[1]["state"] == "planning"


def test_header_names_versions_and_config(tmp_path):
    """The header carries the schema, library versions and the config."""
    trace = EventTrace(keep=True)
    header = trace.header({"window_size": 3})
    assert header["event"] == "header" and header["config"] == {"window_size": 3}
    assert {"torch", "numpy", "transitions", "structlog", "eplb_fsm"} <= set(header["versions"])


def test_no_trace_dir_writes_nothing_but_counts(tmp_path):
    """Without a trace_dir nothing is written, yet seq and cseq still advance."""
    trace = EventTrace()
    trace.emit("x")
    with trace.collective("barrier"):
        pass
    assert trace.seq == 3 and trace.cseq == {"world": 1} and trace.path is None
    assert list(tmp_path.iterdir()) == []


def test_read_trace_skips_truncated_line(tmp_path):
    """A truncated last line (a killed rank) is counted as bad, the rest is read."""
    path = tmp_path / "rank00000.jsonl"
    path.write_text('{"event": "a", "seq": 0}\n{"event": "b", "se')
    records, bad = read_trace(path)
    assert [r["event"] for r in records] == ["a"] and bad == 1


def test_numpy_and_torch_values_serialise(tmp_path):
    """numpy and torch scalars/arrays in fields are written as plain JSON."""
    import numpy as np
    import torch

    with EventTrace(trace_dir=tmp_path) as trace:
        trace.emit("x", a=np.int64(3), b=torch.tensor([1, 2]), c=(4, 5))
    (record,), _ = read_trace(trace_path(tmp_path, 0))
    assert (record["a"], record["b"], record["c"]) == (3, [1, 2], [4, 5])


# -- issue 12: how a trace ends, liveness records, header identity ---------------------------------


def test_end_is_written_once_and_nothing_follows_it(tmp_path):
    """`end` is the last line of the file: a second end and later records are not written."""
    trace = EventTrace(rank=0, world=2, trace_dir=tmp_path)
    trace.emit("step")
    first = trace.end("exception", error="KeyError: 'x'")
    assert first["how"] == "exception" and first["error"] == "KeyError: 'x'"
    assert trace.end("closed") is None
    trace.emit("step")
    trace.close()
    records, _ = read_trace(trace_path(tmp_path, 0))
    assert [r["event"] for r in records] == ["step", "end"]
    assert records[-1]["how"] == "exception" and records[-1]["seq"] == 1


@pytest.mark.parametrize("how,kwargs,needle", [
    ("gone", {}, "how must be one of"),
    ("exception", {}, "needs error"),
    ("signal", {}, "needs signal"),
    ("closed", {"signal": "SIGTERM"}, "signal is only given"),
    ("closed", {"error": "E: x"}, "error is only given"),
])
def test_end_fields_refuse_a_bad_combination(how, kwargs, needle):
    """A bad `end` names the field and the rule, and writes nothing."""
    from eplb_fsm.trace import end_fields

    with pytest.raises(ValueError, match=needle):
        end_fields(how, **kwargs)


def test_end_signal_record_names_the_signal(tmp_path):
    """how=signal carries the signal's name and no error."""
    with EventTrace(rank=1, world=2, trace_dir=tmp_path) as trace:
        rec = trace.end("signal", signal="SIGTERM")
    assert rec["signal"] == "SIGTERM" and "error" not in rec


def test_alive_reports_the_open_collective_and_the_previous_step():
    """An alive record inside a collective names it; after the collective ends waiting_on is null."""
    trace = EventTrace(rank=0, world=2, keep=True)
    trace.set_context(state="collecting", step=5)
    with trace.collective("all_reduce", group="ep"):
        inside = trace.alive(0.5, steps_seen=3)
    after = trace.alive(0.5, steps_seen=5)
    assert inside["waiting_on"] == {"op": "all_reduce", "group": "ep", "cseq": 0}
    assert (inside["step"], inside["steps_seen"], inside["interval_s"]) == (5, 3, 0.5)
    assert after["waiting_on"] is None


def test_collective_error_clears_the_open_collective():
    """A collective that raises is no longer what the rank waits on."""
    trace = EventTrace(keep=True)
    with pytest.raises(TimeoutError):
        with trace.collective("barrier", group="x"):
            raise TimeoutError("late")
    assert trace.waiting_on() is None


def test_header_carries_run_id_and_config_hash(tmp_path):
    """The header has run_id and the config's 16-hex hash, equal for equal configs, different otherwise."""
    from eplb_fsm.trace import config_hash

    with EventTrace(rank=0, world=1, trace_dir=tmp_path) as trace:
        rec = trace.header({"b": 2, "a": 1}, run_id="0123456789abcdef")
    assert rec["run_id"] == "0123456789abcdef"
    assert rec["config_hash"] == config_hash({"a": 1, "b": 2}) != config_hash({"a": 1, "b": 3})
    assert len(rec["config_hash"]) == 16 and int(rec["config_hash"], 16) >= 0


def test_end_open_traces_ends_every_open_file_once(tmp_path):
    """A signal handler's ending: every open trace gets `end how=signal`; closed or ended ones are skipped."""
    from eplb_fsm.trace import end_open_traces

    a, b, c = (EventTrace(rank=r, world=3, trace_dir=tmp_path) for r in range(3))
    b.end("closed")
    c.close()
    assert end_open_traces("signal", signal="SIGTERM") == 1
    assert end_open_traces("signal", signal="SIGTERM") == 0
    a.close()
    b.close()
    last = {r: read_trace(trace_path(tmp_path, r))[0] for r in range(3)}
    assert last[0][-1]["how"] == "signal" and last[0][-1]["signal"] == "SIGTERM"
    assert last[1][-1]["how"] == "closed" and last[2] == []
