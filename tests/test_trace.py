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
