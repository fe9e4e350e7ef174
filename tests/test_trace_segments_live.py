"""trace_segments.py: rolling into a reused folder, and reading a trace while its writer, another process, rolls it.

The writers are real processes; a roll that must come between a reader's listing and its
reads is asked of the writer from inside the reader's ``open`` and waited for (with a
timeout), so where it lands does not depend on timing. No timing is asserted.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

import eplb_fsm
from eplb_fsm import trace_segments
from eplb_fsm.inspect import replay_dir
from eplb_fsm.trace import EventTrace, read_trace, trace_path
from eplb_fsm.trace_segments import read_rank_text, segment_paths

ROOT = str(Path(eplb_fsm.__file__).resolve().parents[1])   # the children import the package this test imports
ENV = {"PYTHONPATH": ROOT, "PATH": "/usr/bin:/bin"}
WAIT_S = 120.0


def _line(proc: subprocess.Popen) -> str:
    readable, _, _ = select.select([proc.stdout], [], [], WAIT_S)
    assert readable, "the writer did not answer in time"
    return proc.stdout.readline()


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


def _seqs(text: str) -> list[int]:
    return [json.loads(line)["seq"] for line in text.splitlines() if line.strip()]


def _session(folder: Path, run_id: str, max_segments: int, rank: int) -> None:
    trace = EventTrace(rank, 2, folder, max_bytes=1024, max_segments=max_segments)
    trace.set_context(state="collecting", step=0)
    trace.header({}, run_id=run_id)
    for i in range(60):
        trace.set_context(step=i)
        trace.count_step()
        with trace.collective("all_reduce", group="ep", shape=[4], dtype="float32"):
            pass
    trace.set_context(step=60)
    trace.end("closed")
    trace.close()


def test_a_folder_reused_with_fewer_segments_keeps_only_the_new_cap(tmp_path):
    """Run A keeps 6 segments, run B (same folder) 2: B's rolls delete A's .2-.5, and replay reads B in order."""
    for run_id, max_segments in (("A", 6), ("B", 2)):
        for rank in (0, 1):
            _session(tmp_path, run_id, max_segments, rank)
    for rank in (0, 1):
        path = trace_path(tmp_path, rank)
        assert [p.name for p in segment_paths(path)] == [f"{path.name}.1", path.name]
        records, bad = read_trace(path)
        seqs = [r["seq"] for r in records]
        assert bad == 0 and seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    report = replay_dir(tmp_path)
    assert report.verdict == "healthy" and report.run_id == "B", report.summary


def test_rotate_deletes_every_numbered_segment_from_the_cap_on_and_nothing_else(tmp_path):
    """rotate(max_segments=3): .2 and every higher .n go (the live file moves to .1, .1 to .2); other names stay."""
    live = tmp_path / "rank00000.jsonl"
    for name in ("", ".1", ".2", ".3", ".7", ".10", ".old", ".2.gz", "x"):
        Path(f"{live}{name}").write_text(name or "live")
    (tmp_path / "rank00000.jsonl.9").mkdir()   # not a segment: left alone, and the roll does not fail on it
    trace_segments.rotate(live, 3)
    left = {p.name: (p.read_text() if p.is_file() else "dir") for p in tmp_path.iterdir()}
    assert left == {"rank00000.jsonl.1": "live", "rank00000.jsonl.2": ".1", "rank00000.jsonl.old": ".old",
                    "rank00000.jsonl.2.gz": ".2.gz", "rank00000.jsonlx": "x", "rank00000.jsonl.9": "dir"}
    trace_segments.rotate(tmp_path / "rank00000.jsonl.1", 1)   # one segment: every numbered one goes, and itself
    assert not (tmp_path / "rank00000.jsonl.1").exists() and (tmp_path / "rank00000.jsonl.2").exists()


# keeps .2, .1 and a live file; at each "roll" on stdin writes until the file has rolled once more, then says so
ROLL_ON_DEMAND = r'''
import sys
from eplb_fsm.trace import EventTrace
trace = EventTrace(0, 1, sys.argv[1], max_bytes=1024, max_segments=3)
trace.set_context(state="collecting", step=0)
trace.header({}, run_id="R")

def roll():
    rotations = trace.rotations
    while trace.rotations == rotations:
        trace.emit("balancedness", value=0.5)

roll()
roll()
print("ready", flush=True)
for line in sys.stdin:
    if line.strip() != "roll":
        break
    roll()
    print("rolled", flush=True)
trace.end("closed")
trace.close()
'''


@pytest.mark.parametrize("reader", ["read_trace", "read_rank_text"])
@pytest.mark.parametrize("roll_at_open", [1, 2, 3])
def test_a_roll_between_listing_and_reading_is_read_again(tmp_path, monkeypatch, reader, roll_at_open):
    """The writer rolls right before the reader's n-th open: the read is the trace as it stands after, no gap."""
    proc = subprocess.Popen([sys.executable, "-c", ROLL_ON_DEMAND, str(tmp_path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        assert _line(proc) == "ready\n", proc.stderr.read()[-2000:] if proc.poll() is not None else ""
        path = trace_path(tmp_path, 0)
        assert len(segment_paths(path)) == 3
        opens = []
        real_open = open

        def open_after_a_roll(file, *args, **kwargs):
            opens.append(file)
            if len(opens) == roll_at_open:
                proc.stdin.write("roll\n")
                proc.stdin.flush()
                assert _line(proc) == "rolled\n"
            return real_open(file, *args, **kwargs)

        monkeypatch.setattr(trace_segments, "open", open_after_a_roll, raising=False)
        if reader == "read_trace":
            records, bad = read_trace(path)
            got, seqs = records, [r["seq"] for r in records]
        else:
            got = read_rank_text(path)
            bad, seqs = 0, _seqs(got)
        monkeypatch.undo()
        truth = read_trace(path)[0] if reader == "read_trace" else read_rank_text(path)   # the writer waits now
        assert bad == 0 and seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        assert got == truth
        proc.stdin.close()   # the writer ends its trace and exits
        assert proc.wait(WAIT_S) == 0, proc.stderr.read()[-2000:]
    finally:
        _stop(proc)


# writes without pause but a short sleep, rolling a 2 KiB file with 3 segments kept, until it has rolled argv[2] times
ROLLING_WRITER = r'''
import sys, time
from eplb_fsm.trace import EventTrace
trace = EventTrace(0, 1, sys.argv[1], max_bytes=2048, max_segments=3)
trace.set_context(state="collecting", step=0)
trace.header({}, run_id="R")
while trace.rotations < 2:
    trace.emit("balancedness", value=0.5)
print("ready", flush=True)
while trace.rotations < int(sys.argv[2]):
    trace.emit("balancedness", value=0.5)
    time.sleep(0.0005)
trace.end("closed")
trace.close()
'''


def test_reading_a_trace_while_its_writer_rolls_it_never_misses_a_segment(tmp_path):
    """Reads while a real writer rolls 40 times: none fails, none has a seq gap (each is one moment's segments)."""
    proc = subprocess.Popen([sys.executable, "-c", ROLLING_WRITER, str(tmp_path), "40"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)
    path = trace_path(tmp_path, 0)
    failures, reads = [], 0
    try:
        assert _line(proc) == "ready\n"
        deadline = time.monotonic() + WAIT_S   # a guard on the loop, not a measurement
        while proc.poll() is None and time.monotonic() < deadline:
            reads += 1
            try:
                if reads % 2:
                    records, bad = read_trace(path)
                    seqs = [r["seq"] for r in records]
                else:   # what replay reads (load_rank_file): the joined text; a torn last line is left out
                    text = read_rank_text(path)
                    lines = [line for line in text.split("\n") if line.strip()]
                    bad = int(bool(lines) and not text.endswith("\n"))
                    seqs = _seqs("\n".join(lines[:len(lines) - bad]))
            except OSError as exc:
                failures.append(repr(exc))
                continue
            if bad > 1 or not seqs or seqs != list(range(seqs[0], seqs[0] + len(seqs))):
                failures.append(f"bad lines {bad}, seqs {seqs}")
        assert proc.wait(WAIT_S) == 0, proc.stderr.read()[-2000:]
    finally:
        _stop(proc)
    assert reads and failures == [], f"{len(failures)} of {reads} reads: {failures[:3]}"
