"""EventTrace's constructor checks, and a collective's cseq taken under the trace lock (continued headers)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import eplb_fsm.trace as trace_module
from eplb_fsm.trace import EventTrace, read_trace, trace_path


@pytest.mark.parametrize("kwargs, field", [
    (dict(rank=-1, world=2), "rank"),
    (dict(rank=2, world=2), "rank"),
    (dict(rank=0, world=0), "world"),
    (dict(rank=0, world=-3), "world"),
    (dict(rank=1.7, world=2), "rank"),
    (dict(rank=True, world=2), "rank"),
    (dict(rank="x", world=2), "rank"),
    (dict(rank=0, world=2.0), "world"),
    (dict(rank=0, world=1, generation=-2), "generation"),
    (dict(rank=0, world=1, generation=1.5), "generation"),
    (dict(rank=0, world=1, generation=False), "generation"),
    (dict(rank=0, world=1, clock=5), "clock"),
])
def test_bad_constructor_arguments_are_refused_before_anything_is_made(tmp_path, kwargs, field):
    """A bad rank/world/generation/clock is a ValueError naming the field; no folder, no file, no claim."""
    folder = tmp_path / "traces"
    with pytest.raises(ValueError, match=f"EventTrace {field}"):
        EventTrace(trace_dir=folder, **kwargs)
    assert not folder.exists()
    EventTrace(0, 1, folder).close()   # the path was not claimed by the refused trace


def test_numpy_integers_are_accepted_as_rank_world_and_generation(tmp_path):
    """numpy ints pass and are stored as Python ints (the file name and records use them)."""
    trace = EventTrace(np.int64(1), np.int32(2), tmp_path, generation=np.int64(3))
    record = trace.emit("alive")
    trace.close()
    assert type(trace.rank) is int and (record["rank"], record["world"]) == (1, 2)
    assert trace_path(tmp_path, 1, 3).exists()


def test_a_roll_while_a_collective_starts_keeps_next_cseq_true(tmp_path, monkeypatch):
    """Another thread's record that rolls the file cannot fall between a start's cseq and its record."""
    trace = EventTrace(0, 1, tmp_path, max_bytes=1500, max_segments=4)
    trace.set_context(state="collecting", step=0)
    trace.header({}, run_id="r" * 16)
    with trace.collective("all_reduce", group="ep"):
        pass
    real = trace_module.collective_fields
    other = threading.Thread(target=lambda: [trace.emit("wave", pad="x" * 400) for _ in range(4)])

    def preempted(*args, **kwargs):   # the engine thread loses the CPU here; the async worker writes meanwhile
        other.start()
        other.join(timeout=0.5)       # with the cseq taken under the lock, the worker waits for it
        return real(*args, **kwargs)

    monkeypatch.setattr(trace_module, "collective_fields", preempted)
    trace.start_collective("all_reduce", group="ep")
    monkeypatch.setattr(trace_module, "collective_fields", real)
    other.join(timeout=30)
    assert not other.is_alive()
    trace.close()
    records, _ = read_trace(trace_path(tmp_path, 0))
    headers = [r for r in records if r.get("continued")]
    assert headers and trace.rotations >= 1
    for header in headers:
        starts = [r for r in records if r["seq"] > header["seq"] and r["event"] == "collective_start"]
        done = [r for r in records if r["seq"] < header["seq"] and r["event"] == "collective_start"]
        assert header["next_cseq"] == {"ep": len(done)}
        assert all(r["cseq"] >= header["next_cseq"]["ep"] for r in starts)
