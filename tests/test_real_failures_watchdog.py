"""A rank SIGSTOPped for good and SIGKILLed 5 s later, as a watchdog kills a hung process: replay says it froze.

Real ``eplb-fsm simulate`` runs (4 gloo ranks, helpers of test_real_failures): the signals come from this test,
by pid, at a point read from rank 1's trace. Its peers wait on it until the kill, then fail on the closed
connection; replay must read the wait that held before that failure ("froze for good"), not a death.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from test_real_failures import BASE, _rank_pids, _reaped, _run_in_thread

from eplb_fsm.inspect.replay import replay_dir
from eplb_fsm.trace import read_trace

pytestmark = pytest.mark.multiprocess


def _moment(log_dir: Path, where: str) -> int | None:
    """Rank 1's pid once its trace shows ``where`` after its first ``alive`` record (a rank whose liveness thread
    never wrote tells nothing by its silence): ``transfer`` (it entered transferring), ``ep`` (it started a
    collective of the controller's group that is not posted); None before."""
    path = Path(log_dir) / "rank00001.jsonl"
    recs = read_trace(path)[0] if path.is_file() else []
    recs = recs[next((i for i, r in enumerate(recs) if r["event"] == "alive"), len(recs)):]
    if where == "transfer":
        hit = any(r["event"] == "transition" and r.get("dest") == "transferring" for r in recs)
    else:
        hit = any(r["event"] == "collective_start" and r.get("group") == "ep" and not r.get("posted") for r in recs)
    recs = read_trace(path)[0] if hit else []
    return next(r["pid"] for r in recs if r["event"] == "header") if hit else None


@pytest.mark.parametrize("mode,where", [("async", "transfer"), ("async", "ep"), ("sync", "ep")])
def test_a_rank_frozen_then_killed_by_its_watchdog_froze(tmp_path, mode, where):
    """SIGSTOP, 5 s, SIGKILL: `frozen` rank 1, for good (was, in a red team's async runs: died, or a hang, when the
    peers' waits ended in the kill's lost connection or a peer's alive record fell between the kill and its
    failure)."""
    argv = ["simulate", *BASE, "--ranks", "4", "--steps", "100000", "--interval", "30", "--collective-timeout", "20",
            "--mode", mode, "--log-dir", str(tmp_path), "--timeout", "120"]
    thread, box = _run_in_thread(argv)
    pids: list[int] = []
    with _reaped(thread, pids):
        deadline = time.monotonic() + 90
        while (pid := _moment(tmp_path, where)) is None:
            assert thread.is_alive() and time.monotonic() < deadline, "the moment to stop rank 1 did not come"
            time.sleep(0.002)
        os.kill(pid, signal.SIGSTOP)
        pids += _rank_pids(tmp_path)
        time.sleep(5.0)
        os.kill(pid, signal.SIGKILL)
        thread.join(60)
        assert not thread.is_alive(), "simulate did not end within 60 s of the kill"
    assert box["code"] == 1
    report = replay_dir(str(tmp_path))
    assert (report.verdict, report.culprit_ranks) == ("frozen", [1]), report.summary
    assert "froze for good" in report.summary, report.summary
