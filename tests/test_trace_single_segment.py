"""max_segments=1: the roll comes before the write that would pass max_bytes, so that write is never deleted."""

from __future__ import annotations

import os

from eplb_fsm.trace import EventTrace, encode_record, read_trace, record_steps, trace_path


def test_the_collective_start_that_brings_the_roll_stays_on_disk(tmp_path):
    """With one segment, the collective_start whose write rolled the file is in the new file (a hang stays visible)."""
    trace = EventTrace(0, 1, tmp_path, max_bytes=1024, max_segments=1)
    trace.set_context(state="collecting", step=0)
    trace.header({}, run_id="r" * 16)
    for step in range(200):
        trace.step = step
        before = trace.rotations
        start = trace.start_collective("all_reduce", group="ep", shape=(4,), dtype="torch.float64")
        if trace.rotations > before:
            break   # this rank now hangs inside that collective: its start must be on disk
        trace.emit("collective_end", op="all_reduce", group="ep", cseq=start["cseq"])
    assert trace.rotations == 1
    records, bad = read_trace(trace_path(tmp_path, 0))
    assert bad == 0 and records[-1] == start
    assert records[0]["continued"] is True and records[0]["next_cseq"] == {"ep": start["cseq"]}
    assert [name for name in os.listdir(tmp_path) if not name.endswith(".lock")] == ["rank00000.jsonl"]
    trace.close()


def test_one_segment_keeps_its_cap_and_seq_order_with_runs(tmp_path):
    """Many rolls of one segment: each file stays under max_bytes plus one write; lines in seq order; steps kept."""
    trace = EventTrace(0, 1, tmp_path, max_bytes=2048, max_segments=1, keep=True)
    trace.set_context(state="collecting", step=0)
    trace.header({}, run_id="r" * 16)
    largest = 0
    for step in range(400):
        trace.step = step
        trace.count_step()
        record = trace.emit("wave", pad="y" * (step % 50))
        largest = max(largest, 2 * len(encode_record(record)) + 2)   # a write: the record, and a run as long
        size = trace_path(tmp_path, 0).stat().st_size
        assert size <= 2048 + largest
    trace.close()
    records, bad = read_trace(trace_path(tmp_path, 0))
    seqs = [r["seq"] for r in records]
    assert bad == 0 and trace.rotations > 5 and seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert records[0]["continued"] is True
    last_steps = sorted(s for r in records for s in record_steps(r))
    assert last_steps == list(range(last_steps[0], 400))
