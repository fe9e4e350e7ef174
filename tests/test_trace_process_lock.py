"""One writer per rank file across processes: a second process's EventTrace on the same file is refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import eplb_fsm
from eplb_fsm.inspect import replay_dir
from eplb_fsm.trace import EventTrace, read_trace, trace_path

pytest.importorskip("fcntl")

ROOT = str(Path(eplb_fsm.__file__).resolve().parents[1])   # the tree under test, for the child as well

HOLDER = r'''
import sys
from eplb_fsm.trace import EventTrace
trace = EventTrace(0, 1, sys.argv[1])
trace.set_context(state="collecting", step=0)
trace.header({}, run_id="a" * 16)
print("open", flush=True)
sys.stdin.readline()            # hold the file until the test says so
trace.end("closed")
trace.close()
print("closed", flush=True)
'''


def _holder(folder: Path) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env={"PYTHONPATH": ROOT, "PATH": "/usr/bin:/bin"})
    return child


def test_a_second_process_on_the_same_rank_file_is_refused(tmp_path):
    """While another process writes rank00000.jsonl, EventTrace on it raises ValueError naming the path and pid."""
    child = _holder(tmp_path)
    try:
        assert child.stdout.readline().strip() == "open"
        with pytest.raises(ValueError, match=f"rank00000.jsonl is already written by another process \\(pid "
                                             f"{child.pid}"):
            EventTrace(0, 1, tmp_path)
        report = replay_dir(tmp_path, jobs=1)   # the lock file of a running writer is not read as a trace
        assert report.summary.startswith("1 of 1 ranks") and report.warnings == [], report.summary
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "closed"
        assert child.wait(timeout=60) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
    records, _ = read_trace(trace_path(tmp_path, 0))
    assert [r["event"] for r in records] == ["header", "end"]   # nothing of the refused trace got in
    trace = EventTrace(0, 1, tmp_path)   # the first writer closed: the file is free again
    trace.emit("alive")
    trace.close()
    assert sorted(os.listdir(tmp_path)) == ["rank00000.jsonl"]   # close() removes the lock file


def test_a_killed_writer_does_not_block_the_next_one(tmp_path):
    """A writer killed with SIGKILL leaves its lock file unlocked: the next process opens the trace."""
    child = _holder(tmp_path)
    try:
        assert child.stdout.readline().strip() == "open"
    finally:
        child.kill()
        child.wait(timeout=30)
    assert (tmp_path / ".rank00000.jsonl.lock").exists()
    report = replay_dir(tmp_path, jobs=1)   # a stale lock file is not read as a trace either
    assert report.summary.startswith("1 of 1 ranks") and report.warnings == [], report.summary
    trace = EventTrace(0, 1, tmp_path)
    trace.close()
    assert not (tmp_path / ".rank00000.jsonl.lock").exists()


def test_exclusive_false_takes_no_lock(tmp_path):
    """A harness trace (exclusive=False) neither takes nor is refused by the lock."""
    child = _holder(tmp_path)
    try:
        assert child.stdout.readline().strip() == "open"
        EventTrace(0, 1, tmp_path, exclusive=False).close()
    finally:
        child.kill()
        child.wait(timeout=30)
