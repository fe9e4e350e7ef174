"""lagging: a rank in its own work while its peers wait for it in the engine's collective is the one behind.

Hand-written traces pin the rule's edges (``inspect/lagging.py``); real torchrun jobs give it the traces it was
made for: an engine whose ranks meet in an all-reduce of their own every step, where rank 1's main thread stops
in its own work (a sleep: a hung data loader, a lock, a slow kernel) at the same step, and rank 0 waits for it
inside the all-reduce; the operator then stops the job. The tree before this rule read that job as `signalled`
(nothing wrong) once stopped, and as nothing at all while it still ran.
"""

from __future__ import annotations

import re
import shutil
import signal
import time

import pytest
from conftest import torchrun_job
from test_inspect_held import ENGINE_OWN, GRACE
from test_inspect_liveness import WORLD, write
from test_inspect_stalled import ENGINE, Waiter

from eplb_fsm.inspect.render import format_report
from eplb_fsm.inspect.replay import replay_dir
from eplb_fsm.trace import read_trace

SIDE = {**ENGINE, "engine_wait_main": False}   # a side thread waits in the collective, the main thread does not


def lag_job(behind: tuple[int, ...], wait_s: float = 6, ahead: bool = False, behind_wait: dict | None = None,
            waiting_on: dict | None = None) -> list[Waiter]:
    """Every rank steps to 40; the ``behind`` ones stay in their own work there (``behind_wait``: what their alive
    records name), the rest wait inside the engine's all-reduce of step 40 (``ahead``: of step 41), all for
    ``wait_s`` (``waiting_on``: the controller collective the waiters' records name)."""
    ranks = [Waiter(r).steps(40) for r in range(WORLD)]
    for rk in ranks:
        if rk.rank in behind:
            rk.engine_wait(wait_s, behind_wait)
        else:
            if ahead:
                rk.steps(41, alive=False)
            rk.engine_wait(wait_s, waiting_on=waiting_on)
    return ranks


def test_a_rank_in_its_own_work_at_the_step_its_peers_wait_in_lags(tmp_path):
    """Rank 2 computes at step 40 while ranks 0-1,3 wait in step 40's all-reduce: `lagging`, rank 2 (was: nothing
    found, the steps being equal)."""
    report = replay_dir(write(tmp_path, lag_job((2,))))
    assert (report.verdict, report.culprit_ranks, report.step) == ("lagging", [2], 40), format_report(report)
    assert "ranks 0-1,3 waited for it inside the engine's all_reduce at step 40" in report.summary
    assert {p["status"] for p in report.findings[0].ranks if p["rank"] != 2} == {"waiting"}
    # each waiter's consequence line says where it waits: the engine's collective, not "its own work"
    assert sum("in no controller collective, inside the engine's all_reduce" in c for c in report.consequences) == 3


def test_the_job_stopped_during_the_lag_keeps_the_signals_as_consequences(tmp_path):
    """The same, then SIGTERM to every rank: `lagging` rank 2, each signal a consequence (was: `signalled`)."""
    ranks = lag_job((2,))
    for rk in ranks:
        rk.end("signal", signal="SIGTERM")
    report = replay_dir(write(tmp_path, ranks))
    assert (report.verdict, report.culprit_ranks) == ("lagging", [2]), format_report(report)
    assert "signalled" not in [f.kind for f in report.findings]
    assert sum("was stopped by SIGTERM" in c for c in report.consequences) == WORLD - 1, format_report(report)


def test_a_rank_a_step_behind_lags_after_a_stop_too(tmp_path):
    """Rank 1 computes at step 40, the others wait at step 41, then SIGTERM: `lagging` rank 1 (was: `signalled`)."""
    ranks = lag_job((1,), ahead=True)
    for rk in ranks:
        rk.end("signal", signal="SIGTERM")
    report = replay_dir(write(tmp_path, ranks))
    assert (report.verdict, report.culprit_ranks, report.step) == ("lagging", [1], 40), format_report(report)


def test_a_rank_whose_side_thread_waits_still_lags(tmp_path):
    """Rank 2's alive records name a collective a side thread sits in, not its main thread: it still lags."""
    report = replay_dir(write(tmp_path, lag_job((2,), behind_wait=SIDE)))
    assert (report.verdict, report.culprit_ranks) == ("lagging", [2]), format_report(report)
    assert "a side thread" in report.summary


@pytest.mark.parametrize("case", ["short", "no waiter", "waiters apart", "controller", "missing", "crash"])
def test_what_is_no_lag_of_the_engines(tmp_path, case):
    """Each of these is left to the other rules: two records (under three intervals), every rank in its own work,
    the waiters at two steps, the waiters in a controller collective, a rank without a trace, a rank's own error."""
    if case == "short":
        ranks = lag_job((2,), wait_s=2)
    elif case == "no waiter":
        ranks = lag_job(tuple(range(WORLD)))
    elif case == "waiters apart":
        ranks = lag_job((2,))
        ranks[3].steps(41, alive=False).engine_wait(4)
    elif case == "controller":
        ranks = lag_job((2,), waiting_on={"op": "all_reduce", "group": "ep", "cseq": 0})
    elif case == "missing":
        ranks = lag_job((2,))[1:]
    else:
        ranks = lag_job((2,))
        ranks[2].end("exception", error="ValueError: bad batch")
    report = replay_dir(write(tmp_path, ranks))
    lag = [f for f in report.findings if f.kind == "lagging" and re.search(r"own work at steps? ", f.summary)]
    assert not lag, format_report(report)


# -- real jobs: rank 1 stops in its own work at step 21 -------------------------------------------------------------

LAG = ENGINE_OWN.replace(
    "rank, world = dist.get_rank(), dist.get_world_size()\n",
    "rank, world = dist.get_rank(), dist.get_world_size()\nside = dist.new_group([0, 1])\nimport threading\n").replace(
    '        if step == 21 and rank == 1 and fault == "gil":\n',
    '        if step == 21 and rank == 1 and fault == "side":   # a side thread waits on a collective nobody joins\n'
    '            threading.Thread(target=dist.all_reduce, args=(torch.ones(2),), kwargs={"group": side},\n'
    '                             daemon=True).start()\n'
    '        if step == 21 and rank == 1 and fault in ("sleep", "side"):\n'
    '            time.sleep(3600)   # its own work, for good: a hung data loader, a lock, a slow kernel\n'
    '        if step == 21 and rank == 1 and fault == "gil":\n')


def stop_once_waiting(launcher, traces, copy_to, ranks: tuple[int, ...] = (0,)) -> None:
    """Wait (bounded) until each of ``ranks`` has written four alive records inside an engine collective at one step,
    copy the traces as they stand (a read of the live job), then SIGTERM torchrun: an operator ending a stuck job."""
    def waiting(rank: int) -> bool:
        alive = [r for r in read_trace(traces / f"rank{rank:05d}.jsonl")[0] if r.get("event") == "alive"]
        return len(alive) >= 4 and all(a.get("engine_wait") and a.get("step") == alive[-1].get("step")
                                       for a in alive[-4:])

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(waiting(r) for r in ranks):
        time.sleep(0.1)
    shutil.copytree(traces, copy_to)
    launcher.send_signal(signal.SIGTERM)


@pytest.mark.multiprocess
@pytest.mark.parametrize("fault", ["sleep", "side"])
def test_a_real_rank_stuck_in_its_own_work_lags_before_and_after_the_stop(tmp_path, fault):
    """Rank 1's main thread sleeps for good at step 21 (``side``: after starting a thread that waits in an
    all-reduce of another group nobody joins); rank 0 waits inside the engine's all-reduce. Read live, then after
    SIGTERM to torchrun: `lagging`, rank 1, both times (was: nothing found, then `signalled`)."""
    live = tmp_path / "live"
    stop = lambda pids, launcher, traces: stop_once_waiting(launcher, traces, live)  # noqa: E731
    traces, code, out = torchrun_job(tmp_path, LAG, stop, (fault, "60"), GRACE)
    assert code != 0, out
    for folder in (live, traces):
        report = replay_dir(folder)
        assert (report.verdict, report.culprit_ranks) == ("lagging", [1]), format_report(report)
        assert "rank 0 waited for it inside the engine's all_reduce" in report.summary, format_report(report)
    stopped = replay_dir(traces)
    assert sum("was stopped by SIGTERM" in c for c in stopped.consequences) == 1, format_report(stopped)
    assert ("a side thread" in stopped.summary) == (fault == "side"), format_report(stopped)


def test_waits_that_ran_out_after_the_lag_are_its_consequences(tmp_path):
    """The waiters' bounded waits run out after the lag and they end with the error; the lagging rank is then
    SIGTERMed by its launcher: still `lagging` rank 2, the failed waits and the signal after it."""
    ranks = lag_job((2,))
    for rk in ranks:
        if rk.rank == 2:
            rk.ts += 1.0
            rk.end("signal", signal="SIGTERM")
        else:
            rk.end("exception", error="RuntimeError: Application timeout caused pair closure")
    report = replay_dir(write(tmp_path, ranks))
    assert (report.verdict, report.culprit_ranks) == ("lagging", [2]), format_report(report)
    assert sum("gave up waiting" in c for c in report.consequences) == WORLD - 1, format_report(report)
