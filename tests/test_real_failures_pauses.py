"""Real processes stopped from outside together: a pause of the whole job, a SIGTERM with a collective in flight.

Two real processes write their traces with the real ``EventTrace`` and ``Liveness`` thread, and turn SIGTERM
into ``end how=signal`` as simulated ranks do (``eplb_fsm.sim.signals``). The test, acting as an operator or a
launcher, signals them:

- SIGSTOP to both ranks, SIGCONT 3.5 s later, then they close in order: every rank is silent over the same
  window, the first to resume a moment before the other. That is a pause of the whole job, no rank's freeze
  (replay once named one rank ``frozen``).
- SIGSTOP to two of three ranks together while the third writes on: one freeze naming both.
- SIGTERM to both ranks a moment after rank 0 entered a collective rank 1 had not reached: the job was stopped
  from outside with a collective in flight (replay once named rank 1 the culprit of a ``hang``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import eplb_fsm
from eplb_fsm.inspect.render import format_report
from eplb_fsm.inspect.replay import replay_dir
from eplb_fsm.trace import read_trace

pytestmark = pytest.mark.multiprocess

ROOT = str(Path(eplb_fsm.__file__).resolve().parents[1])   # the tree under test, for the rank processes too

# argv: folder rank interval what. 12 quiet steps, "ready", then it waits (its liveness thread writing an alive
# record every interval) until the folder holds a file "close" (then it closes in order) or a signal stops it; if
# what is "collective", rank 0 enters an all-reduce (and prints "inside") once the folder holds a file "enter".
RANK = r'''
import os, sys, time
from eplb_fsm.sim import signals
signals.install()
from eplb_fsm.liveness import Liveness
from eplb_fsm.trace import EventTrace
d, rank, interval, what, world = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], int(sys.argv[5])
t = EventTrace(rank, world, d)
t.set_context(state="collecting", step=0)
t.header({"a": 1}, run_id="pauses0000000001", mode="sync", group="ep")
live = Liveness(t, interval).start_on(t)
for i in range(1, 13):
    t.set_context(step=i)
    t.count_step()
t.flush()
print("ready", flush=True)
deadline, entered = time.monotonic() + 60, False
while not os.path.exists(os.path.join(d, "close")) and time.monotonic() < deadline:
    if what == "collective" and rank == 0 and not entered and os.path.exists(os.path.join(d, "enter")):
        t.start_collective("all_reduce", group="ep", shape=[16], dtype="torch.float64")
        print("inside", flush=True)
        entered = True
    time.sleep(0.002)
live.stop()
t.end("closed")
t.close()
'''


def start(folder: Path, interval: float, what: str, world: int = 2) -> list[subprocess.Popen]:
    env = dict(os.environ, PYTHONPATH=ROOT)
    return [subprocess.Popen([sys.executable, "-c", RANK, str(folder), str(r), str(interval), what, str(world)],
                             env=env, text=True, stdout=subprocess.PIPE) for r in range(world)]


def last_ts(folder: Path, rank: int) -> float:
    """The ts of ``rank``'s last record on disk (its alive records are flushed as written)."""
    return read_trace(folder / f"rank{rank:05d}.jsonl")[0][-1]["ts"]


def pause(folder: Path, procs: list[subprocess.Popen], stopped: list[subprocess.Popen], resume_key=None) -> None:
    """After a couple of alive records, SIGSTOP ``stopped`` for 3.5 s (over replay's frozen limit: 2.5 intervals,
    at least 2 s), SIGCONT them (in that order, or sorted by ``resume_key`` then), then close every rank in order."""
    time.sleep(1.2)
    for p in stopped:
        os.kill(p.pid, signal.SIGSTOP)
    time.sleep(3.5)
    for p in sorted(stopped, key=resume_key) if resume_key else stopped:
        os.kill(p.pid, signal.SIGCONT)
    time.sleep(1.2)
    (folder / "close").write_text("")
    for p in procs:
        assert p.wait(timeout=30) == 0


def stop_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
            p.wait(timeout=10)


def test_both_ranks_sigstopped_together_read_as_a_pause_not_a_freeze(tmp_path):
    """SIGSTOP to both ranks for 3.5 s, SIGCONT (rank 0 first), then an orderly close: healthy, with a warning that
    the whole job was paused (was: frozen, the rank that resumed second)."""
    procs = start(tmp_path, 1.0, "wait")
    try:
        for p in procs:
            assert p.stdout.readline() == "ready\n"
        # the rank silent longer resumes first, as a paused host's would: its silence beyond its peer's then stays
        # under one interval (the other order adds the ms between the two SIGCONTs to the beats' offset, < 1 s)
        pause(tmp_path, procs, procs, resume_key=lambda p: last_ts(tmp_path, procs.index(p)))
    finally:
        stop_all(procs)
    report = replay_dir(tmp_path)
    assert (report.verdict, report.culprit_ranks) == ("healthy", []), format_report(report)
    assert any(w.startswith("ranks 0-1 were all silent") and "the whole job was paused" in w
               for w in report.warnings), format_report(report)


def test_two_of_three_ranks_sigstopped_together_are_one_freeze_naming_both(tmp_path):
    """SIGSTOP to ranks 1 and 2 together for 3.5 s while rank 0 writes on: one frozen finding naming ranks 1-2 (was:
    rank 1 frozen as the verdict, rank 2's identical silence only a later finding)."""
    procs = start(tmp_path, 1.0, "wait", world=3)
    try:
        for p in procs:
            assert p.stdout.readline() == "ready\n"
        pause(tmp_path, procs, procs[1:])
    finally:
        stop_all(procs)
    report = replay_dir(tmp_path)
    assert (report.verdict, report.culprit_ranks) == ("frozen", [1, 2]), format_report(report)
    assert [f.kind for f in report.findings].count("frozen") == 1, format_report(report)
    assert report.summary.startswith("ranks 1-2 froze for "), format_report(report)


def test_a_sigterm_with_a_collective_in_flight_is_signalled(tmp_path):
    """SIGTERM to both ranks right after rank 0 entered an all-reduce rank 1 had not reached: signalled, ranks 0-1,
    the collective named in a detail (was: hang, rank 1 "never joined")."""
    procs = start(tmp_path, 1.0, "collective")
    try:
        for p in procs:
            assert p.stdout.readline() == "ready\n"
        (tmp_path / "enter").write_text("")
        assert procs[0].stdout.readline() == "inside\n"
        for p in procs:   # a few ms into the collective: far under the 1 s liveness interval a hang needs
            p.send_signal(signal.SIGTERM)
        for p in procs:
            assert p.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        stop_all(procs)
    report = replay_dir(tmp_path)
    assert (report.verdict, report.culprit_ranks) == ("signalled", [0, 1]), format_report(report)
    assert any("a collective in flight, no hang" in d for d in report.findings[0].details), format_report(report)
