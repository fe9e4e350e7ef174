"""trace_file.py: a trace's bytes on disk; real write failures, torn lines, signals and kills during a roll.

The failures happen for real: a file-size limit (``RLIMIT_FSIZE``, the kernel's EFBIG on a
write, as a full disk gives ENOSPC), SIGTERM to a process busy writing, SIGKILL between two
renames of a roll. Every child process runs under a timeout.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import structlog

from eplb_fsm import trace_file, trace_segments
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
        # the killed writer's lock file (.rank00000.jsonl.lock) stays behind: not a segment
        on_disk = sum(1 for f in folder.iterdir() if not f.name.endswith(".lock") for _ in open(f))
        records, bad = read_trace(trace_path(folder, 0))
        assert bad == 0 and len(records) == on_disk and len(segment_paths(trace_path(folder, 0))) == 3
        seqs = [r["seq"] for r in records]
        assert seqs == sorted(seqs)
        report = replay_dir(folder)
        assert report.ranks[0]["records"] == on_disk


FULL_STDOUT = r'''
import json, os, sys, time
from eplb_fsm.liveness import Liveness
from eplb_fsm.trace import EventTrace
folder = sys.argv[1]
os.makedirs(folder)
os.symlink("/dev/full", os.path.join(folder, "rank00000.jsonl"))   # every trace write fails with ENOSPC
trace = EventTrace(0, 1, folder)
raised = []
for step in range(50):   # the engine's calls, each of whose writes fails while stdout (the log) fails too
    try:
        trace.set_context(state="collecting", step=step)
        trace.count_step()
        if step % 10 == 9:
            trace.transition("step", "collecting", "collecting", due=False)
            trace.emit("balancedness", value=0.5)
            trace.flush()
    except BaseException as exc:
        raised.append(repr(exc))
live = Liveness(trace, interval_s=0.01).start()
seq = trace.seq
deadline = time.monotonic() + 60
while trace.seq < seq + 5 and time.monotonic() < deadline:   # beats whose writes fail too
    time.sleep(0.01)
result = {"raised": raised, "running": live.running, "beats": trace.seq - seq, "write_errors": trace.write_errors}
live.stop()
try:
    trace.end("closed")
    trace.close()
except BaseException as exc:
    raised.append(repr(exc))
with open(sys.argv[2], "w") as fh:   # not stdout: it is /dev/full
    json.dump(result, fh)
'''


def test_a_failing_trace_whose_warning_fails_too_never_reaches_the_engine(tmp_path):
    """Trace writes and stdout both on /dev/full: no call raises, the liveness thread beats on, errors counted."""
    with open("/dev/full", "w") as full:
        out = subprocess.run([sys.executable, "-c", FULL_STDOUT, str(tmp_path / "t"), str(tmp_path / "out.json")],
                             stdout=full, stderr=subprocess.PIPE, text=True, timeout=120,
                             env={"PYTHONPATH": ROOT, "PATH": "/usr/bin:/bin"})
    assert out.returncode in (0, 120), out.stderr[-2000:]   # 120: the interpreter's own stdout flush at exit
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["raised"] == [] and result["running"] and result["beats"] >= 5
    assert result["write_errors"] >= 10


def _rotate_then_interrupt_the_open(monkeypatch):
    """The next roll moves the files, then a KeyboardInterrupt lands just after the new live file is opened."""
    real_rotate = trace_segments.rotate

    def open_then_interrupt(*args, **kwargs):
        monkeypatch.delattr(trace_file, "open")
        open(*args, **kwargs).close()
        raise KeyboardInterrupt   # as a signal handler raises it (Ctrl-C, SIGALRM)

    def rotate(path, max_segments):
        monkeypatch.setattr(trace_segments, "rotate", real_rotate)
        real_rotate(path, max_segments)
        monkeypatch.setattr(trace_file, "open", open_then_interrupt, raising=False)

    monkeypatch.setattr(trace_segments, "rotate", rotate)


def test_an_exception_inside_a_roll_does_not_end_the_trace(tmp_path, monkeypatch):
    """A signal's exception inside the roll's open: later records and `end` reach a new live file, under a header."""
    trace = EventTrace(0, 1, tmp_path, max_bytes=1024, max_segments=3)
    trace.header({"a": 1}, run_id="x")
    _rotate_then_interrupt_the_open(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        for i in range(1000):
            trace.emit("balancedness", value=float(i))
    for i in range(5):   # the host caught it and goes on
        trace.emit("after", i=i)
    trace.end("closed")
    trace.close()
    live, _ = read_trace(trace.path, segments=False)
    records, bad = read_trace(trace.path)
    assert live[0]["event"] == "header" and live[0]["continued"] is True and live[0]["run_id"] == "x"
    assert [r["i"] for r in records if r["event"] == "after"] == list(range(5)) and records[-1]["event"] == "end"
    assert bad == 0 and trace.write_errors == 0 and [r["seq"] for r in records] == sorted(r["seq"] for r in records)


class _Clock:
    """trace_file's clock, held still unless moved on: when the live file is checked is the test's choice."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_roll_whose_reopen_failed_is_opened_again_once_the_folder_is_back(tmp_path, monkeypatch):
    """Folder removed, a roll that cannot reopen: one error per dropped record, then the file back with the folder."""
    clock = _Clock()
    monkeypatch.setattr(trace_file, "clock", clock, raising=False)
    folder = tmp_path / "t"
    trace = EventTrace(0, 1, folder, max_bytes=1024, max_segments=2)
    trace.header({"a": 1}, run_id="x")
    shutil.rmtree(folder)   # a log cleaner
    for i in range(1000):
        if trace.rotations:
            break
        trace.emit("balancedness", value=float(i))   # to the removed file, until it rolls (and cannot reopen)
    assert trace.rotations == 1 and trace.write_errors > 0
    before = trace.write_errors
    for i in range(10):
        trace.emit("dropped", i=i)
    assert trace.write_errors == before + 10
    folder.mkdir()
    clock.now += 60.0
    for i in range(5):
        trace.emit("later", i=i)
    trace.end("closed")
    trace.close()
    records, bad = read_trace(trace.path)
    assert bad == 0 and records[0]["event"] == "header" and records[0]["continued"] is True
    assert [r["i"] for r in records if r["event"] == "later"] == list(range(5))
    assert records[-1]["event"] == "end" and records[-1]["write_errors"] == trace.write_errors


def test_an_unlinked_live_file_is_found_counted_and_opened_again(tmp_path, monkeypatch):
    """A live file unlinked under the writer: at the next check it is counted, logged and opened again at its path."""
    clock = _Clock()
    monkeypatch.setattr(trace_file, "clock", clock, raising=False)
    trace = EventTrace(0, 1, tmp_path)
    trace.header({"a": 1}, run_id="x")
    os.unlink(trace.path)
    trace.emit("unseen")   # a write to the unlinked file succeeds and reaches nothing
    clock.now += 60.0
    with structlog.testing.capture_logs() as logs:
        for i in range(3):
            trace.emit("after", i=i)
    trace.alive(1.0, None)
    trace.end("closed")
    trace.close()
    records, bad = read_trace(trace.path)
    assert bad == 0 and [r["event"] for r in records] == ["header", "after", "after", "after", "alive", "end"]
    assert records[0]["continued"] is True and records[0]["run_id"] == "x"
    assert trace.write_errors == 1 and records[-2]["write_errors"] == records[-1]["write_errors"] == 1
    assert [entry["log_level"] for entry in logs if "removed" in entry["event"]] == ["warning"]


def test_a_removed_folder_is_retried_until_it_is_back(tmp_path, monkeypatch):
    """Folder removed (no roll): found at the next check, each reopen that fails counted, the file back once it is."""
    clock = _Clock()
    monkeypatch.setattr(trace_file, "clock", clock, raising=False)
    folder = tmp_path / "t"
    trace = EventTrace(0, 1, folder)
    trace.header({"a": 1}, run_id="x")
    shutil.rmtree(folder)
    clock.now += 60.0
    trace.emit("lost")   # found removed; the reopen fails; the record is dropped
    errors = trace.write_errors
    folder.mkdir()
    clock.now += 60.0
    trace.emit("back")
    trace.end("closed")
    trace.close()
    records, _ = read_trace(trace.path)
    assert errors >= 3 and [r["event"] for r in records] == ["header", "back", "end"]


FSIZE_LIMIT = r'''
import json, resource, signal, sys
from eplb_fsm.trace import EventTrace
trace = EventTrace(0, 1, sys.argv[1])
trace.emit("first")
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # the write fails with EFBIG instead of killing the process
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (trace.path.stat().st_size + 1000, hard))
for i in range(40):
    trace.emit("while_full", i=i, pad="x" * 60)
failed = trace.write_errors
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))   # space is back
for i in range(3):
    trace.emit("after", i=i)
trace.end("closed")
trace.close()
print(json.dumps({"failed": failed, "write_errors": trace.write_errors}))
'''


def test_a_write_counted_as_failed_never_reaches_the_file_later(tmp_path):
    """A file-size limit hit, then lifted: the records missing from the file are exactly the write_errors."""
    out = _child(FSIZE_LIMIT, str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    records, bad = read_trace(trace_path(tmp_path, 0))
    seqs = {r["seq"] for r in records}
    missing = set(range(max(seqs) + 1)) - seqs
    assert result["failed"] > 0 and result["write_errors"] == result["failed"] and bad <= 1
    assert len(missing) == result["failed"] and len(seqs) == len(records)
    assert [r["event"] for r in records[-4:]] == ["after", "after", "after", "end"]
    assert records[-1]["write_errors"] == result["failed"]


def test_a_roll_whose_rename_fails_keeps_its_segment_and_tries_again_later(tmp_path, monkeypatch):
    """Renames refused (a read-only folder; as root only a patched os.replace refuses): the live file goes on with
    no continued header, no rotation and no record dropped, a truthful warning; tried again after CHECK_S or
    another max_bytes; once renames work the roll happens, its new segment opening with the header."""
    clock = _Clock()
    monkeypatch.setattr(trace_file, "clock", clock, raising=False)
    real_replace = os.replace

    def refuse(src, dst):
        raise PermissionError(13, "Permission denied", str(src), None, str(dst))

    monkeypatch.setattr(os, "replace", refuse)
    trace = EventTrace(0, 1, tmp_path, max_bytes=2048, max_segments=4)
    trace.set_context(state="collecting", step=0)
    trace.header({"window_size": 40}, run_id="r")
    with structlog.testing.capture_logs() as logs:
        while trace.write_errors == 0:                   # up to the first roll, which fails
            trace.emit("balancedness", value=0.9)
        failed_at = trace.path.stat().st_size
        while trace.path.stat().st_size <= failed_at + 2048:
            assert trace.write_errors == 1               # the clock stands still: no try before another max_bytes
            trace.emit("balancedness", value=0.9)
        assert trace.write_errors == 2                   # past another max_bytes: tried (and failed) again
        trace.emit("balancedness", value=0.9)
        assert trace.write_errors == 2
        clock.now += trace_file.CHECK_S                  # a second on: tried again at the next record
        trace.emit("balancedness", value=0.9)
        assert trace.write_errors == 3
    records, bad = read_trace(trace.path)
    events = [r["event"] for r in records]
    assert bad == 0 and events.count("header") == 1 and trace.rotations == 0
    assert [r["seq"] for r in records] == list(range(len(records)))   # nothing dropped
    assert segment_paths(trace.path) == [trace.path]
    warnings = [entry["event"] for entry in logs if entry["log_level"] == "warning"]
    assert warnings == [trace_file.ROLL_FAILED] and "no record is dropped" in warnings[0]
    monkeypatch.setattr(os, "replace", real_replace)     # the folder is writable again
    clock.now += trace_file.CHECK_S
    trace.emit("balancedness", value=0.5)
    trace.end("closed")
    trace.close()
    assert trace.rotations == 1 and [p.name for p in segment_paths(trace.path)] == ["rank00000.jsonl.1",
                                                                                    "rank00000.jsonl"]
    live = [json.loads(line) for line in trace.path.read_text().splitlines()]
    assert [r["event"] for r in live] == ["header", "end"] and live[0]["continued"] is True
    assert live[-1]["write_errors"] == 3
    records, _ = read_trace(trace.path)
    assert [r["seq"] for r in records] == list(range(len(records)))
