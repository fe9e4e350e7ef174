"""A real SIGKILL, then a launcher's SIGTERM to the survivors: replay names the killed rank, not the survivors.

Three real processes write their traces with the real ``EventTrace`` and ``Liveness`` thread, and turn
SIGTERM into ``end how=signal`` as simulated ranks do (``eplb_fsm.sim.signals``). Ranks 1-2 then wait
outside any collective (as for a scale-up's joiner), rank 0 SIGKILLs itself, and the test, acting as the
launcher, SIGTERMs ranks 1-2 once it sees rank 0 gone and their liveness threads ticked after it. Nothing in
ranks 1-2's traces tells of rank 0's death (no collective with it failed): only the order of the stops does, with
the tick rank 0 missed.
"""

from __future__ import annotations

import json
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

pytestmark = pytest.mark.multiprocess

ROOT = str(Path(eplb_fsm.__file__).resolve().parents[1])   # the tree under test, for the rank processes too

# argv: folder rank. It prints "ready" after 12 quiet steps, then waits for a line: rank 0 writes one more record
# and SIGKILLs itself; the others wait (sleeping) until they are stopped.
RANK = r'''
import sys, time
from eplb_fsm.sim import signals
signals.install()
from eplb_fsm.liveness import Liveness
from eplb_fsm.trace import EventTrace
d, rank = sys.argv[1], int(sys.argv[2])
t = EventTrace(rank, 3, d)
t.set_context(state="collecting", step=0)
t.header({"a": 1}, run_id="sigdeath00000001", mode="sync", group="ep")
live = Liveness(t, 0.5).start_on(t)   # replay's missed tick is one interval: the survivors tick past it in 0.5 s
for i in range(1, 13):
    t.set_context(step=i)
    t.count_step()
t.emit("balancedness", value=0.5)
print("ready", flush=True)
sys.stdin.readline()
if rank == 0:
    t.emit("balancedness", value=0.6)
    signals.kill_self()
while True:
    time.sleep(0.05)
'''


def records(path: Path) -> list[dict]:
    """The whole JSON lines of a trace written so far (a line being written is skipped)."""
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def test_a_rank_sigkilled_then_the_survivors_sigtermed_is_rank_died(tmp_path):
    """Rank 0 SIGKILLed, then ranks 1-2 SIGTERMed by the launcher: rank_died, rank 0; ranks 1-2 are consequences
    (was: signalled, ranks 1-2, "stopped from outside")."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(tmp_path), str(r)], env=env, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE) for r in range(3)]
    try:
        for p in procs:
            assert p.stdout.readline() == "ready\n"
        procs[0].stdin.write("go\n")
        procs[0].stdin.flush()
        assert procs[0].wait(timeout=30) == -signal.SIGKILL
        # the launcher notices the dead rank within its poll period, by when the survivors' liveness threads
        # ticked past rank 0's last record (what names rank 0: it missed that tick)
        last0 = records(tmp_path / "rank00000.jsonl")[-1]["ts"]
        deadline = time.monotonic() + 30
        while not all(any(r["event"] == "alive" and r["ts"] > last0 + r.get("interval_s", 1.0)
                          for r in records(tmp_path / f"rank{k:05d}.jsonl")) for k in (1, 2)):
            assert time.monotonic() < deadline, "the survivors wrote no alive record after rank 0's death"
            time.sleep(0.1)
        for p in procs[1:]:    # the launcher stops the survivors once a rank is gone
            p.send_signal(signal.SIGTERM)
        for p in procs[1:]:
            assert p.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    report = replay_dir(tmp_path)
    assert (report.verdict, report.culprit_ranks) == ("rank_died", [0]), format_report(report)
    assert "were stopped by SIGTERM" in report.summary
    assert sorted(c.split(" was ")[0] for c in report.consequences) == ["rank 1", "rank 2"]
