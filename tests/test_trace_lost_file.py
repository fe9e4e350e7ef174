"""A live trace file removed from under a running rank, at the moments where a record could be lost or doubled;
and no ``continued`` header before the header it would copy.

The removals are real (``os.unlink`` by the parent) and the writers are real processes of a
world of 2. Each child holds :data:`eplb_fsm.trace_file.clock` still, so that whether the
writer's once-a-second look at its file has come round is decided by the test, not by how
fast the machine is: no timing is asserted, and every wait has a timeout.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from pathlib import Path

import eplb_fsm
from eplb_fsm.inspect import replay_dir
from eplb_fsm.trace import EventTrace, read_trace, trace_path
from eplb_fsm.trace_segments import segment_paths

ROOT = str(Path(eplb_fsm.__file__).resolve().parents[1])   # the children import the package this test imports
WAIT_S = 120.0

# rank 1's file is removed while both wait on stdin; then each ends in order (the end less than CHECK_S after the
# removal: the clock is held still, so the rate-limited look never comes round before the end)
END_AFTER_REMOVAL = r'''
import sys
from eplb_fsm import trace_file
from eplb_fsm.trace import EventTrace
trace_file.clock = lambda: 0.0
folder, rank, max_bytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
trace = EventTrace(rank, 2, folder, max_bytes=max_bytes, max_segments=3)
trace.set_context(state="collecting", step=0)
trace.header({"w": 1}, run_id="R")
for i in range(3):
    trace.set_context(step=i)
    trace.count_step()
    with trace.collective("all_reduce", group="ep", shape=[4], dtype="float32"):
        pass
trace.set_context(step=3)
print("ready", flush=True)
sys.stdin.readline()
trace.end("closed")
print(trace.write_errors, flush=True)
trace.close()
'''

# the file is opened, then (as a controller waits on its run-identity all-reduces) removed before the header; the
# clock then moves past CHECK_S, so the header's own look at the file finds it gone and opens it again
REMOVED_BEFORE_HEADER = r'''
import sys
from eplb_fsm import trace_file
from eplb_fsm.trace import EventTrace
now = [0.0]
trace_file.clock = lambda: now[0]
folder, rank = sys.argv[1], int(sys.argv[2])
trace = EventTrace(rank, 2, folder)
trace.set_context(state="collecting", step=0)
print("ready", flush=True)
sys.stdin.readline()
now[0] += 60.0
trace.header({"w": 1}, run_id="R")
for i in range(5):
    trace.set_context(step=i)
    trace.count_step()
trace.set_context(step=5)
trace.end("closed")
print(trace.write_errors, flush=True)
trace.close()
'''

# a rank closed without `end` (its pending steps are its last write) right after its file was removed
CLOSE_AFTER_REMOVAL = r'''
import sys
from eplb_fsm import trace_file
from eplb_fsm.trace import EventTrace
trace_file.clock = lambda: 0.0
trace = EventTrace(0, 1, sys.argv[1])
trace.set_context(state="collecting", step=0)
trace.header({"w": 1}, run_id="R")
for i in range(4):
    trace.set_context(step=i)
    trace.count_step()
print("ready", flush=True)
sys.stdin.readline()
trace.close()
print(trace.write_errors, flush=True)
'''


def _ready(proc: subprocess.Popen) -> None:
    readable, _, _ = select.select([proc.stdout], [], [], WAIT_S)
    assert readable, "the child did not get ready in time"
    line = proc.stdout.readline()
    assert line == "ready\n", line + proc.stderr.read()[-2000:]


def _run_ranks(code: str, folder: Path, args_of, remove: list[Path]) -> list[str]:
    """Start one child per entry of ``args_of``, remove ``remove`` once all are ready, let them finish: their output."""
    env = {"PYTHONPATH": ROOT, "PATH": "/usr/bin:/bin"}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(folder), *args], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for args in args_of]
    try:
        for proc in procs:
            _ready(proc)
        for path in remove:
            os.unlink(path)
        outs = []
        for proc in procs:
            out, err = proc.communicate("go\n", timeout=WAIT_S)
            assert proc.returncode == 0, err[-2000:]
            outs.append(out.strip().splitlines()[-1])   # the last line: structlog's warning goes to stdout too
        return outs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def test_the_end_record_reaches_a_live_file_removed_just_before_the_end(tmp_path):
    """A file removed < CHECK_S before `end` is opened again at the end: the rank replays as ended, not as dead."""
    for max_bytes in (1024, 1 << 26):   # a rotated trace (its older segments stay) and a single live file
        folder = tmp_path / str(max_bytes)
        outs = _run_ranks(END_AFTER_REMOVAL, folder, [("0", str(max_bytes)), ("1", str(max_bytes))],
                          remove=[trace_path(folder, 1)])
        assert outs == ["0", "1"]   # rank 1's loss is counted
        records, bad = read_trace(trace_path(folder, 1))
        assert bad == 0 and records[-1]["event"] == "end" and records[-1]["how"] == "closed"
        assert records[-1]["write_errors"] == 1
        with open(trace_path(folder, 1)) as fh:
            first = json.loads(fh.readline())
        assert first["event"] == "header" and first["continued"] is True and first["run_id"] == "R"
        report = replay_dir(folder)
        assert report.verdict == "healthy", report.summary
        assert not any(f.kind in ("rank_died", "missing_ranks") for f in report.findings)


def test_a_close_after_the_file_was_removed_writes_its_pending_steps_to_the_path(tmp_path):
    """close() without `end`: its pending steps (the last write) go to the file at the path, not the removed one."""
    outs = _run_ranks(CLOSE_AFTER_REMOVAL, tmp_path, [()], remove=[trace_path(tmp_path, 0)])
    assert outs == ["1"]
    records, bad = read_trace(trace_path(tmp_path, 0))
    assert bad == 0 and [r["event"] for r in records] == ["header", "steps"]
    assert records[0]["continued"] is True and (records[1]["step"], records[1]["count"]) == (0, 4)


def test_a_file_removed_before_the_header_gets_no_continued_header(tmp_path):
    """A file lost before the first header is only opened again: its first line is the real header, one run."""
    outs = _run_ranks(REMOVED_BEFORE_HEADER, tmp_path, [("0",), ("1",)], remove=[trace_path(tmp_path, 1)])
    assert outs == ["0", "1"]
    records, bad = read_trace(trace_path(tmp_path, 1))
    assert bad == 0 and [r["event"] for r in records] == ["header", "steps", "end"]
    assert "continued" not in records[0] and records[0]["seq"] == 0 and records[-1]["write_errors"] == 1
    report = replay_dir(tmp_path)
    assert report.verdict == "healthy", report.summary
    assert not any("runs" in warning for warning in report.warnings), report.warnings


def test_a_roll_before_the_header_starts_its_segment_without_a_copy_of_a_header(tmp_path):
    """Segments rolled before the header hold no `continued` header; every segment after the real one starts with it."""
    trace = EventTrace(0, 1, tmp_path, max_bytes=1024, max_segments=10)
    while trace.rotations < 2:
        trace.emit("early", pad="x" * 50)
    trace.header({"w": 1}, run_id="R")
    rotations = trace.rotations
    while trace.rotations < rotations + 2:
        trace.emit("late", pad="x" * 50)
    trace.end("closed")
    trace.close()
    firsts, real = [], None
    for i, segment in enumerate(segment_paths(trace.path)):
        records = [json.loads(line) for line in segment.read_text().splitlines()]
        firsts.append(records[0])
        if any(r["event"] == "header" and "continued" not in r for r in records):
            real = i
    assert real is not None and real >= 2
    assert not any(r["event"] == "header" for r in firsts[:real])
    assert all(r["event"] == "header" and r["continued"] and r["run_id"] == "R" for r in firsts[real + 1:])
