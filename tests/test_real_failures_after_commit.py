"""A rank stopped right after an async rearrangement committed is placed where it stopped, not at the due step.

In async mode the ``rearrangement`` summary a rank writes as the attempt ends carries the step the attempt was
due (``step``) and the step it ended in (``end_step``), often tens of steps apart. Real ``eplb-fsm simulate``
runs (3 gloo ranks, helpers of test_real_failures): rank 1 is SIGSTOPped (for good, then SIGKILLed, as a
watchdog would) or SIGKILLed while that summary is its last record. A red team's runs read "froze ... at step
36" for a rank frozen at step 45 (7 of 7).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from test_real_failures import BASE, _rank_pids, _reaped, _run_in_thread

from eplb_fsm.inspect.replay import replay_dir
from eplb_fsm.trace import read_trace

pytestmark = pytest.mark.multiprocess


def _after_commit(path: Path) -> dict | None:
    """Rank 1's header, once its last whole line is a committed ``rearrangement`` that ended after its due step."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    lines = data[:data.rfind(b"\n")].split(b"\n")
    try:
        last = json.loads(lines[-1])
    except ValueError:
        return None
    if last.get("event") != "rearrangement" or last.get("outcome") != "committed" \
            or last.get("end_step", 0) <= last.get("step", 0) or not any(b'"alive"' in line for line in lines):
        return None
    return json.loads(lines[0])


@pytest.mark.parametrize("fault,verdict", [("freeze", "frozen"), ("kill", "rank_died")])
def test_a_rank_stopped_after_an_async_commit_is_placed_at_its_last_step(tmp_path, fault, verdict):
    """SIGSTOP (then SIGKILL 4 s later) or SIGKILL as the summary is written: the finding is where the rank stopped."""
    argv = ["simulate", *BASE, "--ranks", "3", "--steps", "100000", "--interval", "30", "--collective-timeout", "20",
            "--mode", "async", "--log-dir", str(tmp_path), "--timeout", "120"]
    path = tmp_path / "rank00001.jsonl"
    thread, box = _run_in_thread(argv)
    pids: list[int] = []
    with _reaped(thread, pids):
        deadline = time.monotonic() + 90
        while (header := _after_commit(path)) is None:
            assert thread.is_alive() and time.monotonic() < deadline, "rank 1 never committed a rearrangement"
            time.sleep(0.002)
        os.kill(header["pid"], signal.SIGSTOP if fault == "freeze" else signal.SIGKILL)
        pids += _rank_pids(tmp_path)
        if fault == "freeze":
            time.sleep(4.0)
            os.kill(header["pid"], signal.SIGKILL)
        thread.join(60)
        assert not thread.is_alive(), "simulate did not end within 60 s of the kill"
    assert box["code"] == 1
    last = read_trace(path)[0][-1]
    # nearly always the summary; a rank that wrote on before the signal landed stopped where that record says
    stopped_at = {"rearrangement": last.get("end_step"), "steps": last["step"] + last.get("count", 1) - 1}.get(
        last["event"], last["step"])
    report = replay_dir(str(tmp_path))
    first = report.findings[0]
    where = f"at step {stopped_at} in {last['state']}"
    if fault == "kill" and first.kind == "hang":
        # told by the collective the survivors waited in (they reached it as rank 1 died), its death first
        assert first.culprits == [1] and first.details[0].startswith(f"rank 1 died (SIGKILL?) {where}"), report.summary
    else:
        assert (report.verdict, report.culprit_ranks) == (verdict, [1]), report.summary
        assert where in report.summary, (last, report.summary)
    assert first.step == stopped_at, (last, report.summary)
