"""A rank SIGKILLed at a scale's switch: replay names its death, not a rank without a trace.

A real ``eplb-fsm simulate`` run (3 gloo ranks scaling down to 2 at step 30; helpers of test_real_failures): rank 0
stays, and is killed the moment its trace shows the scale's rearrangement committed, before it switches groups.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from test_real_failures import BASE, _strike

from eplb_fsm.inspect.replay import replay_dir
from eplb_fsm.trace import read_trace

pytestmark = pytest.mark.multiprocess


def _committed_in_the_scale(log_dir: Path) -> int | None:
    """Rank 0's pid once its trace shows the scale's rearrangement committed (step 30), None before."""
    path = Path(log_dir) / "rank00000.jsonl"
    recs = read_trace(path)[0] if path.is_file() else []
    if any(r["event"] == "transition" and r.get("trigger") == "committed" and r.get("dest") == "scaling"
           for r in recs):
        return next(r["pid"] for r in recs if r["event"] == "header")
    return None


def test_a_staying_rank_killed_before_its_switch_died():
    """SIGKILL to rank 0 between its scale's commit and its switch: `rank_died` (or the hang of a collective it
    died in), rank 0, and no rank reported without a trace (was, in a red team's 3 of 3 runs: missing_ranks, 'no
    trace for rank 0 of g1 (not switched)', though its trace was there)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        argv = ["simulate", *BASE, "--ranks", "3", "--steps", "200", "--interval", "10", "--scale", "30:2",
                "--scale", "90:3", "--collective-timeout", "5", "--mode", "sync", "--log-dir", tmp, "--timeout",
                "120"]
        _strike(argv, Path(tmp), lambda: _committed_in_the_scale(Path(tmp)), signal.SIGKILL)
        report = replay_dir(tmp)
    assert report.verdict in ("rank_died", "hang") and report.culprit_ranks == [0], report.summary
    assert not report.missing_ranks and not [f for f in report.findings if f.kind == "missing_ranks"], report.summary
