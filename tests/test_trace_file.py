"""trace_file.py: a trace's bytes on disk; real write failures, torn lines, signals and kills during a roll.

The failures happen for real: a file-size limit (``RLIMIT_FSIZE``, the kernel's EFBIG on a
write, as a full disk gives ENOSPC), SIGTERM to a process busy writing, SIGKILL between two
renames of a roll. Every child process runs under a timeout.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from eplb_fsm.inspect import replay_dir
from eplb_fsm.trace import EventTrace, read_trace, trace_path
from eplb_fsm.trace_segments import segment_paths

ROOT = str(Path(__file__).resolve().parents[1])


def _child(code: str, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                          env={"PYTHONPATH": ROOT, "PATH": "/usr/bin:/bin"})


FULL_DISK = r'''
import json, resource, signal, sys, torch
from eplb_fsm import EplbController
from eplb_fsm.config import EplbConfig

class Model:
    num_moe_layers, num_logical_experts, num_redundant_experts = 2, 8, 4
    num_physical_experts = num_local_physical_experts = 12
    num_expert_groups = 1
    def __init__(self):
        self.expert_weights = [[torch.zeros(12, 2)] for _ in range(2)]
    def set_eplb_state(self, load_pass, log2phy, replica_count):
        self.load_pass = load_pass

ctl = EplbController(EplbConfig(window_size=8, step_interval=16, num_redundant_experts=4), trace_dir=sys.argv[1],
                     liveness_interval_s=None)
model = Model()
ctl.add_model(model, "main")
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # the write fails with EFBIG instead of killing the process
size = ctl.trace.path.stat().st_size
resource.setrlimit(resource.RLIMIT_FSIZE, (size + 3000, resource.RLIM_INFINITY))
raised = []
for s in range(300):
    g = torch.Generator().manual_seed(s)
    model.load_pass.add_(torch.randint(0, 50, model.load_pass.shape, generator=g).to(model.load_pass.dtype))
    try:
        ctl.step()
    except Exception as exc:
        raised.append(repr(exc))
ctl.close()
print(json.dumps({"raised": raised, "state": ctl.state, "rearrangements": len(ctl.history),
                  "write_errors": ctl.trace.write_errors}))
'''


def test_a_full_disk_never_reaches_the_engine(tmp_path):
    """Writes failing with EFBIG: no step raises, rearrangements go on in collecting, the errors are counted."""
    out = _child(FULL_DISK, str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["raised"] == [] and result["state"] == "collecting"
    assert result["rearrangements"] >= 15 and result["write_errors"] > 0
    records, _ = read_trace(trace_path(tmp_path, 0))
    assert records[0]["event"] == "header"  # what fitted is readable
    assert "eplb trace write failed" in out.stdout + out.stderr


def test_a_session_appended_after_a_torn_line_starts_on_its_own_line(tmp_path):
    """A restarted writer after a torn last line: its header is read, the torn line alone is unreadable."""
    first = EventTrace(0, 1, tmp_path)
    first.header({"a": 1}, run_id="run-1")
    first.emit("balancedness", value=0.5)
    first.close()
    path = trace_path(tmp_path, 0)
    path.write_text(path.read_text()[:-20])   # killed in the middle of its last line
    second = EventTrace(0, 1, tmp_path)
    second.header({"a": 1}, run_id="run-2")
    second.close()
    records, bad = read_trace(path)
    assert bad == 1 and [r.get("run_id") for r in records if r["event"] == "header"] == ["run-1", "run-2"]


def test_end_is_the_last_record_even_when_it_fills_the_segment(tmp_path):
    """The end record that passes max_bytes does not roll the file: nothing follows it."""
    trace = EventTrace(0, 1, tmp_path, clock=lambda: 1.5, max_bytes=1024)
    trace.header({"a": 1}, run_id="x")

    def size() -> int:
        return trace.path.stat().st_size

    while size() < 1024 - 300:   # records of ~100 bytes: no roll yet
        trace.emit("balancedness", value=0.5)
    before = size()
    trace.emit("note", pad="")
    bare = size() - before
    # fill the segment to 20 bytes under the cap (whatever the header's size), so that `end` passes it
    trace.emit("note", pad="x" * (1024 - 20 - size() - bare))
    assert 1024 - 25 <= size() <= 1024 and trace.rotations == 0
    trace.end("closed")
    trace.close()
    records, _ = read_trace(trace_path(tmp_path, 0))
    assert size() > 1024 and trace.rotations == 0 and records[-1]["event"] == "end"


def test_a_header_larger_than_max_bytes_does_not_roll_for_ever(tmp_path):
    """A header over the cap: each segment holds it and one record; no recursion, every record kept in order."""
    trace = EventTrace(0, 1, tmp_path, max_bytes=1024, max_segments=50)
    trace.header({"extra": "x" * 1200}, run_id="x")
    for i in range(5):
        trace.emit("balancedness", value=float(i))
    trace.close()
    records, bad = read_trace(trace_path(tmp_path, 0))
    assert bad == 0 and [r["value"] for r in records if r["event"] == "balancedness"] == [0.0, 1.0, 2.0, 3.0, 4.0]


SIGNAL_WRITER = r'''
import signal, sys
from eplb_fsm.trace import EventTrace
trace = EventTrace(0, 1, sys.argv[1])
trace.set_context(state="collecting")
trace.header({"a": 1}, run_id="x")

def on_term(signum, frame):   # as docs/events.md says an engine may: end, then leave
    trace.end("signal", signal="SIGTERM")
    raise SystemExit(143)

signal.signal(signal.SIGTERM, on_term)
print("ready", flush=True)
i = 0
while True:   # the engine thread writing: the signal lands inside a write sooner or later
    trace.emit("balancedness", value=0.5, tokens=float(i))
    i += 1
'''


def test_sigterm_to_a_writing_process_ends_its_trace_and_does_not_deadlock(tmp_path):
    """SIGTERM whose handler calls end() while the main thread writes: exit within the timeout, end written last."""
    for trial in range(3):
        folder = tmp_path / str(trial)
        proc = subprocess.Popen([sys.executable, "-c", SIGNAL_WRITER, str(folder)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env={"PYTHONPATH": ROOT, "PATH": "/usr/bin:/bin"})
        try:
            assert proc.stdout.readline().strip() == "ready"
            time.sleep(0.3)   # well into the loop of writes
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 143, proc.stderr.read()[-2000:]
        finally:
            proc.kill()
            proc.wait(10)
        records, _ = read_trace(trace_path(folder, 0))
        assert records[-1]["event"] == "end" and records[-1]["signal"] == "SIGTERM"


KILL_IN_ROLL = r'''
import os, signal, sys
from eplb_fsm import trace_segments
from eplb_fsm.trace import EventTrace
trace = EventTrace(0, 1, sys.argv[1], max_bytes=4096, max_segments=4)
trace.set_context(state="collecting")
trace.header({"a": 1}, run_id="x")
real_replace = os.replace

def replace(src, dst):   # SIGKILL between two renames of the third roll
    real_replace(src, dst)
    if trace.rotations == 2 and str(src).endswith(sys.argv[2]):
        os.kill(os.getpid(), signal.SIGKILL)

trace_segments.os.replace = replace
for i in range(10_000):
    trace.step = i
    trace.emit("balancedness", value=0.5, tokens=float(i))
'''


def test_a_writer_killed_while_it_rolls_the_file_loses_no_segment(tmp_path):
    """SIGKILL after .1 -> .2 (a hole at .1), or after live -> .1 (no live file): every segment is still read."""
    for after in (".jsonl.1", ".jsonl"):
        folder = tmp_path / after.strip(".")
        out = _child(KILL_IN_ROLL, str(folder), after)
        assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
        on_disk = sum(1 for f in folder.iterdir() for _ in open(f))
        records, bad = read_trace(trace_path(folder, 0))
        assert bad == 0 and len(records) == on_disk and len(segment_paths(trace_path(folder, 0))) == 3
        seqs = [r["seq"] for r in records]
        assert seqs == sorted(seqs)
        report = replay_dir(folder)
        assert report.ranks[0]["records"] == on_disk
