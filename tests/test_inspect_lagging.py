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

from eplb_fsm.inspect import engine_runs
from eplb_fsm.inspect.render import format_report
from eplb_fsm.inspect.replay import replay_dir
from eplb_fsm.trace import read_trace

SIDE = {**ENGINE, "engine_wait_main": False}   # a side thread waits in the collective, the main thread does not


@pytest.fixture(autouse=True)
def short_lags(monkeypatch):
    """The traces here hold waits of seconds: read them as a lag or deadlock of minutes would be read (the default
    floor, engine_runs.LAG_MIN_S, has tests of its own)."""
    monkeypatch.setattr(engine_runs, "LAG_MIN_S", 0.0)



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



def test_a_stall_the_job_stepped_on_from_is_no_lag(tmp_path):
    """Rank 2 computed at step 40 while the others waited, then every rank stepped on to 60 and was stopped: the
    stall passed, `signalled` (a red team's job that caught up read `lagging`)."""
    ranks = lag_job((2,))
    for rk in ranks:
        rk.steps(60, alive=False).end("signal", signal="SIGTERM")
    report = replay_dir(write(tmp_path, ranks))
    assert report.verdict == "signalled", format_report(report)


def stalls(*waits: tuple[int, float, tuple[int, ...]]) -> list[Waiter]:
    """For each (step, seconds, waiters) in turn, every rank steps to ``step`` and sits there ``seconds``, the
    ``waiters`` inside the engine's all-reduce, the others in their own work; then SIGTERM to every rank."""
    ranks = [Waiter(r) for r in range(WORLD)]
    for step, seconds, waiters in waits:
        for rk in ranks:
            rk.steps(step, alive=False).engine_wait(seconds, ENGINE if rk.rank in waiters else None)
    for rk in ranks:
        rk.end("signal", signal="SIGTERM")
    return ranks


@pytest.mark.parametrize("wait_s, verdict", [(6, "signalled"), (12, "lagging")])
def test_a_wait_no_longer_than_twice_the_ones_the_job_got_past_is_a_slow_step(tmp_path, wait_s, verdict):
    """At step 39 the others waited 4 s for rank 2 and the job went on; a wait of 6 s at step 40, then a stop, is
    a slow step (`signalled`; a red team's job with 4 s steps read `lagging`); one of 12 s is `lagging`."""
    report = replay_dir(write(tmp_path, stalls((39, 4, (0, 1, 3)), (40, wait_s, (0, 1, 3)))))
    assert report.verdict == verdict, format_report(report)
    if verdict == "lagging":
        assert report.culprit_ranks == [2] and "the longest wait the job got past before: 3.0 s" in report.summary


def test_waiters_in_an_uneven_all_to_all_wait_in_one_call(tmp_path):
    """Ranks 0-1,3 wait in an all-to-all whose input shape differs by rank (uneven splits), rank 2 computes: one
    call (one group), so `lagging` rank 2 (a red team's MoE dispatch read `signalled`)."""
    ranks = [Waiter(r).steps(40) for r in range(WORLD)]
    for rk in ranks:
        rk.engine_wait(6, None if rk.rank == 2 else dict(
            ENGINE, engine_wait="all_to_all_single", engine_wait_call=f"WORLD:[{3 * (rk.rank + 1)}]"))
    report = replay_dir(write(tmp_path, ranks))
    assert (report.verdict, report.culprit_ranks) == ("lagging", [2]), format_report(report)


def test_a_peer_waiting_in_its_subgroups_collective_still_waits(tmp_path):
    """Ranks 0-1 wait in the all-reduce of every rank, rank 2 in its tensor-parallel pair's (ranks 2-3), rank 3
    computes: `lagging` rank 3, rank 2 named as waiting in another group (a red team's job read `signalled`)."""
    tp = dict(ENGINE, engine_wait_group="other", engine_wait_call="3:[4]")
    ranks = [Waiter(r).steps(40) for r in range(WORLD)]
    for rk in ranks:
        rk.engine_wait(6, {0: ENGINE, 1: ENGINE, 2: tp, 3: None}[rk.rank])
    report = replay_dir(write(tmp_path, ranks))
    assert (report.verdict, report.culprit_ranks) == ("lagging", [3]), format_report(report)
    assert "rank 2 inside other collectives of the engine's (all_reduce (3:[4]))" in report.summary


def test_a_rank_inside_a_collective_a_step_behind_is_not_named_lagging(tmp_path):
    """Rank 3 sits in step 40's all-reduce, ranks 0-2 in an all-gather at step 41 (a red team's rank that skipped
    a collective): none is in its own work, so no rank is named lagging (the step rule once named rank 3)."""
    ranks = [Waiter(r).steps(40) for r in range(WORLD)]
    for rk in ranks:
        if rk.rank != 3:
            rk.steps(41, alive=False)
        rk.engine_wait(6, ENGINE if rk.rank == 3 else dict(ENGINE, engine_wait="all_gather"))
    report = replay_dir(write(tmp_path, ranks))
    assert "lagging" not in [f.kind for f in report.findings], format_report(report)


def test_a_wait_the_job_got_past_on_another_rank_counts_too(tmp_path):
    """At step 25 rank 1 waited 6 s for the others (their checkpoints) and the job went on; at step 35 ranks 0,2-3
    wait 6 s for rank 1, then the job is stopped: a slow step as before, `signalled` (a red team's checkpoints
    taken in turn read `lagging`: only the waiters' own past waits counted)."""
    report = replay_dir(write(tmp_path, stalls((25, 6, (1,)), (35, 6, (0, 2, 3)))))
    assert report.verdict == "signalled", format_report(report)


def test_a_warm_up_wait_does_not_hide_a_later_lag(tmp_path):
    """Ranks 0,2-3 waited 10 s at step 1 for rank 1's warm-up; at step 40 they wait 6 s for it, then the stop:
    `lagging` rank 1 (a red team's 10 s first step hid a hang for twice as long)."""
    report = replay_dir(write(tmp_path, stalls((1, 10, (0, 2, 3)), (40, 6, (0, 2, 3)))))
    assert (report.verdict, report.culprit_ranks) == ("lagging", [1]), format_report(report)


def test_a_subgroup_peer_a_step_behind_still_waits(tmp_path):
    """Rank 2 computes at step 40; rank 1 waits for it in their pair's all-reduce at step 40; ranks 0,3 went on to
    step 41's all-reduce of every rank: `lagging` rank 2 (a red team's tensor-parallel job read `signalled`)."""
    pair = dict(ENGINE, engine_wait_group="other", engine_wait_call="1:[4]")
    ranks = [Waiter(r).steps(40) for r in range(WORLD)]
    for rk in ranks:
        if rk.rank in (0, 3):
            rk.steps(41, alive=False)
        rk.engine_wait(6, {0: ENGINE, 1: pair, 2: None, 3: ENGINE}[rk.rank])
    report = replay_dir(write(tmp_path, ranks))
    assert (report.verdict, report.culprit_ranks) == ("lagging", [2]), format_report(report)


def test_a_main_thread_in_its_pairs_collective_beside_a_side_threads_wait_is_no_lag(tmp_path):
    """Rank 3's side thread waits in the all-reduce of every rank (named first as `engine_wait`), its main thread in
    its pair's (`main_wait`); rank 2 computes: `lagging` rank 2 alone (a red team's metrics thread made rank 3 a
    culprit too)."""
    three = dict(ENGINE, engine_wait_main=False, main_wait="all_reduce", main_wait_group="other",
                 main_wait_call="2:[4]")
    ranks = [Waiter(r).steps(40) for r in range(WORLD)]
    for rk in ranks:
        rk.engine_wait(6, {2: None, 3: three}.get(rk.rank, ENGINE))
    report = replay_dir(write(tmp_path, ranks))
    assert (report.verdict, report.culprit_ranks) == ("lagging", [2]), format_report(report)


@pytest.mark.parametrize("wait_s, verdict", [(6, "signalled"), (65, "lagging")])
def test_under_a_minute_a_lag_is_only_a_warning(tmp_path, monkeypatch, wait_s, verdict):
    """At the default floor (60 s) a rank in its own work for 6 s while the others wait, then a stop, is no cause
    (an idle server's request loop, a first checkpoint read the same in a red team's healthy jobs): `signalled`,
    with a warning naming the lag; for 65 s it is `lagging`."""
    monkeypatch.setattr(engine_runs, "LAG_MIN_S", 60.0)
    ranks = lag_job((2,), wait_s=wait_s)
    for rk in ranks:
        rk.end("signal", signal="SIGTERM")
    report = replay_dir(write(tmp_path, ranks))
    assert report.verdict == verdict, format_report(report)
    held = [w for w in report.warnings if w.startswith("not read as a cause (lagging, rank 2 has been in its own")]
    assert len(held) == (verdict == "signalled"), report.warnings

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
    '        if step >= 21 and rank == 1 and fault == "slow":\n'
    '            time.sleep(4)   # slow, not stuck: 4 s of its own work every step\n'
    '        if step == 21 and rank == 1 and fault == "gil":\n')


def stop_once_waiting(launcher, traces, copy_to, ranks: tuple[int, ...] = (0,), steps: int = 1) -> None:
    """Wait (bounded) until each of ``ranks`` has written four alive records inside an engine collective (a rooted
    one too) at one step (after waits at ``steps`` - 1 earlier steps), copy the traces as they stand (a read of the
    live job), then SIGTERM torchrun: an operator ending a stuck job."""
    def waiting(rank: int) -> bool:
        alive = [r for r in read_trace(traces / f"rank{rank:05d}.jsonl")[0] if r.get("event") == "alive"]
        inside = [a for a in alive if a.get("engine_wait") or a.get("main_wait")]
        return len(alive) >= 4 and len({a.get("step") for a in inside}) >= steps and all(
            a in inside and a.get("step") == alive[-1].get("step") for a in alive[-4:])

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(waiting(r) for r in ranks):
        time.sleep(0.1)
    shutil.copytree(traces, copy_to)
    launcher.send_signal(signal.SIGTERM)


@pytest.mark.multiprocess
@pytest.mark.parametrize("fault", ["sleep", "side"])
def test_a_real_rank_stuck_in_its_own_work_lags_before_and_after_the_stop(tmp_path, monkeypatch, fault):
    """Rank 1's main thread sleeps for good at step 21 (``side``: after starting a thread that waits in an
    all-reduce of another group nobody joins); rank 0 waits inside the engine's all-reduce. Read live, then after
    SIGTERM to torchrun: `lagging`, rank 1, both times (was: nothing found, then `signalled`); at the default
    floor of a minute, a warning naming it."""
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
    # at the default floor a lag of seconds is a warning only, naming the same rank
    monkeypatch.setattr(engine_runs, "LAG_MIN_S", 60.0)
    held = replay_dir(traces)
    assert held.verdict == "signalled" and any("(lagging, rank 1 has been in its own work" in w
                                               for w in held.warnings), format_report(held)


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


@pytest.mark.multiprocess
def test_a_real_job_with_slow_steps_stopped_inside_one_is_no_lag(tmp_path):
    """From step 21 rank 1 spends 4 s of its own work in every step while rank 0 waits for it; the operator stops
    the job inside the third such wait: read live, nothing found; after SIGTERM, `signalled` (a red team's job of
    this shape read `lagging` rank 1: a slow step, not a stuck rank)."""
    live = tmp_path / "live"
    stop = lambda pids, launcher, traces: stop_once_waiting(launcher, traces, live, steps=3)  # noqa: E731
    traces, code, out = torchrun_job(tmp_path, LAG, stop, ("slow", "60"), GRACE)
    assert code != 0, out
    assert replay_dir(live).verdict == "healthy", format_report(replay_dir(live))
    report = replay_dir(traces)
    assert (report.verdict, report.culprit_ranks) == ("signalled", [0, 1]), format_report(report)


# the engine's collective is an uneven all-to-all (a MoE dispatch: rank r sends r + 1 rows to each peer, so each
# rank's input has its own shape) on 3 ranks; rank 2 sleeps for good at step 21
DISPATCH = LAG.replace("num_redundant=2", "num_redundant=4").replace(   # 12 slots: 4 a rank
    "num_redundant_experts=2", "num_redundant_experts=4").replace(
    "        dist.all_reduce(torch.ones(4))\n",
    "        n = rank + 1\n"
    "        dist.all_to_all_single(torch.zeros(sum(r + 1 for r in range(world))), torch.ones(n * world),\n"
    "                               [r + 1 for r in range(world)], [n] * world)\n").replace(
    "step == 21 and rank == 1 and fault in", "step == 21 and rank == world - 1 and fault in")


def read_live_and_stopped(tmp_path, engine: str, waiters: tuple[int, ...], fault: str) -> list:
    """Run ``engine`` (argument ``fault``) on 3 ranks under torchrun, copy its traces once each of ``waiters`` waits
    (a live read), then SIGTERM torchrun: the reports of the live copy and of the stopped traces."""
    live = tmp_path / "live"
    stop = lambda pids, launcher, traces: stop_once_waiting(launcher, traces, live, waiters)  # noqa: E731
    traces, code, out = torchrun_job(tmp_path, engine, stop, (fault, "60"), GRACE, ranks=3)
    assert code != 0, out
    return [replay_dir(folder) for folder in (live, traces)]


@pytest.mark.multiprocess
def test_a_real_rank_stuck_before_an_uneven_all_to_all_lags(tmp_path):
    """3 ranks whose engine's collective is an uneven all-to-all; rank 2 sleeps for good at step 21, ranks 0-1 wait
    in the all-to-all with inputs of different shapes: one call all the same, so `lagging` rank 2, read live and
    after SIGTERM (a red team's job read healthy, then `signalled`)."""
    for report in read_live_and_stopped(tmp_path, DISPATCH, (0, 1), "sleep"):
        assert (report.verdict, report.culprit_ranks) == ("lagging", [2]), format_report(report)
        assert "ranks 0-1 waited for it inside the engine's all_to_all_single" in report.summary


def p2p(op: str, peer: int | None) -> dict:
    """What an alive record of a main thread blocked in the engine's ``send``/``recv`` says (``main_wait``)."""
    return {"main_wait": op, "main_wait_group": "same", "main_wait_call": "WORLD:[4]",
            **({} if peer is None else {"main_wait_peer": peer})}


def p2p_job(waits: dict[int, dict | None], wait_s: float = 6, steps: dict[int, int] | None = None) -> list[Waiter]:
    """Every rank steps to 40 (or its ``steps``) and then waits ``wait_s`` as ``waits`` says (None: its own work;
    ENGINE: the all-reduce)."""
    ranks = [Waiter(r).steps((steps or {}).get(r, 40)) for r in range(WORLD)]
    for rk in ranks:
        rk.engine_wait(wait_s, waits[rk.rank])
    return ranks


def test_a_pipeline_waits_through_its_stages_for_the_rank_in_its_own_work(tmp_path):
    """Rank 0 in recv from rank 1, rank 1 from 2, rank 2 from 3, rank 3 in its own work: `lagging` rank 3 alone,
    each stage named with its peer (was: nothing read, or every rank in its own work)."""
    report = replay_dir(write(tmp_path, p2p_job({0: p2p("recv", 1), 1: p2p("recv", 2), 2: p2p("recv", 3), 3: None})))
    assert (report.verdict, report.culprit_ranks, report.step) == ("lagging", [3], 40), format_report(report)
    assert "rank 0 waited for it inside the engine's recv from rank 1 (WORLD:[4]) at step 40" in report.summary
    assert "rank 2 inside the engine's recv from rank 3 (WORLD:[4])" in report.summary
    assert {p["rank"]: p["status"] for p in report.findings[0].ranks} == {0: "waiting", 1: "waiting", 2: "waiting",
                                                                            3: "lagging"}


def test_a_rank_in_recv_from_the_lagging_rank_is_no_culprit(tmp_path):
    """Rank 0 in recv from rank 1 (its own work), ranks 2-3 in the all-reduce: `lagging` rank 1 alone (was: ranks
    0-1, rank 0's recv reading as its own work)."""
    report = replay_dir(write(tmp_path, p2p_job({0: p2p("recv", 1), 1: None, 2: ENGINE, 3: ENGINE})))
    assert (report.verdict, report.culprit_ranks) == ("lagging", [1]), format_report(report)
    assert "ranks 2-3 waited for it inside the engine's all_reduce at step 40, and rank 0 inside the engine's " \
           "recv from rank 1" in report.summary


def test_the_rank_a_recv_waits_for_may_have_stopped_a_step_ahead(tmp_path):
    """Rank 1 stopped in its own work at step 41 (it went on after sending step 40's message), rank 0 in recv
    from it at step 40, ranks 2-3 in recv from rank 0: `lagging` rank 1 at step 41."""
    report = replay_dir(write(tmp_path, p2p_job({0: p2p("recv", 1), 1: None, 2: p2p("recv", 0), 3: p2p("recv", 0)},
                                                steps={1: 41})))
    assert (report.verdict, report.culprit_ranks, report.step) == ("lagging", [1], 41), format_report(report)


@pytest.mark.parametrize("waits", [
    {0: p2p("recv", None), 1: None, 2: p2p("recv", 1), 3: p2p("recv", 1)},
    {0: p2p("recv", 1), 1: None, 2: None, 3: p2p("recv", 1)},
    {0: p2p("recv", 1), 1: p2p("recv", 0), 2: None, 3: p2p("recv", 2)},
], ids=["any source", "a rank in its own work nobody waits for", "a cycle"])
def test_point_to_point_waits_that_lead_to_no_rank_in_its_own_work_are_no_lag(tmp_path, waits):
    """A recv from any source, a rank in its own work that no waiter waits for, a cycle of recvs: no `lagging`
    (the traces tie no rank in its own work to the waits)."""
    report = replay_dir(write(tmp_path, p2p_job(waits)))
    assert "lagging" not in [f.kind for f in report.findings], format_report(report)


# a pipeline of three stages: each step rank 0 sends its output to rank 1, which receives it and sends its own to
# rank 2; from step 21 rank 1 sleeps in its own work before receiving (12 slots: 4 a rank)
PIPE = ENGINE_OWN.replace("num_redundant=2", "num_redundant=4").replace(
    "num_redundant_experts=2", "num_redundant_experts=4").replace(
    "        dist.all_reduce(torch.ones(4))\n",
    '        if step == 21 and rank == 1:\n'
    '            time.sleep(3600)   # its own work, for good\n'
    '        if rank > 0:\n'
    '            dist.recv(torch.zeros(4096), src=rank - 1)\n'
    '        if rank < world - 1:\n'
    '            dist.send(torch.ones(4096), dst=rank + 1)\n')


@pytest.mark.multiprocess
def test_a_real_pipeline_stage_stuck_in_its_own_work_lags(tmp_path):
    """3 ranks in a pipeline of sends and recvs; rank 1 sleeps for good in its 22nd step (the controller's step 20):
    rank 0 blocks in its send to rank 1, rank 2 in its recv from rank 1. Read live and after SIGTERM to torchrun:
    `lagging` rank 1, both waiters named with their peer (was: nothing read live, `signalled` once stopped: every
    rank looked in its own work)."""
    for report in read_live_and_stopped(tmp_path, PIPE, (0, 2), "none"):
        assert (report.verdict, report.culprit_ranks, report.step) == ("lagging", [1], 20), format_report(report)
        assert "send to rank 1" in report.summary and "recv from rank 1" in report.summary, format_report(report)


def test_a_pipelines_stages_may_drift_a_step_a_link(tmp_path):
    """4 stages, the last one in its own work at step 40, rank 2 in send to it at 40, rank 1 in send to rank 2 at
    41, rank 0 in send to rank 1 at 42 (each link a step: a red team's real pipeline): `lagging` rank 3 (was:
    nothing, the waiters more than a step apart)."""
    waits = {0: p2p("send", 1), 1: p2p("send", 2), 2: p2p("send", 3), 3: None}
    report = replay_dir(write(tmp_path, p2p_job(waits, steps={0: 42, 1: 41})))
    assert (report.verdict, report.culprit_ranks, report.step) == ("lagging", [3], 40), format_report(report)


def test_a_link_two_steps_apart_is_no_chain(tmp_path):
    """The same with rank 0 two steps ahead of rank 1, whose send it waits on: no `lagging` (a wait two steps
    from its peer's is not on that peer's present call)."""
    waits = {0: p2p("send", 1), 1: p2p("send", 2), 2: p2p("send", 3), 3: None}
    report = replay_dir(write(tmp_path, p2p_job(waits, steps={0: 43, 1: 41})))
    assert "lagging" not in [f.kind for f in report.findings], format_report(report)


SUB = {**ENGINE, "engine_wait_group": "other", "engine_wait_call": "3:[4]"}   # a data-parallel pair's all-reduce
BROADCAST = {"main_wait": "broadcast", "main_wait_group": "same", "main_wait_call": "WORLD:[4]"}


@pytest.mark.parametrize("waits, culprit", [
    ({0: p2p("send", 1), 1: None, 2: SUB, 3: SUB}, 1),
    ({0: BROADCAST, 1: p2p("send", 2), 2: None, 3: p2p("recv", 2)}, 2),
], ids=["data parallel beside a pipeline", "a broadcast beside a pipeline"])
def test_other_collectives_beside_a_pipeline_are_waits(tmp_path, waits, culprit):
    """Pipelines 0->1 and 2->3 with data-parallel all-reduces on pairs (ranks 2-3 in theirs), rank 1 in its own
    work; or a pipeline whose rank 0 waits in a broadcast, rank 2 in its own work: `lagging` the rank in its own
    work (was: nothing, the ranks in those collectives counted neither as waiters nor as in their own work)."""
    report = replay_dir(write(tmp_path, p2p_job(waits)))
    assert (report.verdict, report.culprit_ranks) == ("lagging", [culprit]), format_report(report)
    assert re.search(r"while ranks? [-0-9,]+ waited for it inside", report.summary), report.summary


def test_a_pipelines_last_stage_steps_behind_is_not_dead_while_it_writes(tmp_path):
    """A healthy 4-stage pipeline read live: stage r at step 43 - r, each still writing alive records to the end
    (its waits in recv from the stage before): no `rank_died` (a red team's real pipeline read live named its last
    stage dead, three steps behind the first)."""
    ranks = [Waiter(r).steps(43 - r) for r in range(WORLD)]
    for rk in ranks:
        rk.engine_wait(3, None if rk.rank == 0 else p2p("recv", rk.rank - 1))
    report = replay_dir(write(tmp_path, ranks))
    assert "rank_died" not in [f.kind for f in report.findings], format_report(report)


def test_a_trace_that_stopped_writing_steps_behind_is_still_dead(tmp_path):
    """The same, but the last stage's trace stops 20 s before the others' (its last record three steps behind):
    `rank_died` rank 3, as before."""
    ranks = [Waiter(r).steps(43 - r) for r in range(WORLD)]
    for rk in ranks:
        rk.engine_wait(3 if rk.rank == 3 else 23, None if rk.rank == 0 else p2p("recv", rk.rank - 1))
    report = replay_dir(write(tmp_path, ranks))
    assert "rank_died" in [f.kind for f in report.findings] and 3 in report.culprit_ranks, format_report(report)
