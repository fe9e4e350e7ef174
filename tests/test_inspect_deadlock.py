"""A deadlock of the engine's: every rank waits inside a collective of the engine's, not one (``inspect/deadlock.py``).

Hand-written traces pin the rule's edges; real 4-rank torchrun jobs give it the traces it was made for: from step 22
rank 1's engine all-gathers where the others all-reduce, or all-reduces on another group of the same ranks. The tree
before this rule read both as healthy while they hung, and as stopped from outside (`signalled`) once stopped.
"""

from __future__ import annotations

import pytest
from conftest import torchrun_job
from test_inspect_held import ENGINE_OWN, GRACE
from test_inspect_lagging import p2p, p2p_job, stop_once_waiting
from test_inspect_liveness import WORLD, write
from test_inspect_stalled import ENGINE, Waiter

from eplb_fsm.inspect import engine_runs
from eplb_fsm.inspect.render import format_report
from eplb_fsm.inspect.replay import replay_dir

GATHER = {**ENGINE, "engine_wait": "all_gather", "engine_wait_call": "WORLD:[4]"}
OTHER_GROUP = {**ENGINE, "engine_wait_call": "2:[48, 8]"}


@pytest.fixture(autouse=True)
def short_lags(monkeypatch):
    """The traces here hold waits of seconds: read them as a lag or deadlock of minutes would be read (the default
    floor, engine_runs.LAG_MIN_S, has tests of its own)."""
    monkeypatch.setattr(engine_runs, "LAG_MIN_S", 0.0)



def deadlocked(odd: dict[int, dict], wait_s: float = 6, odd_step: int = 40) -> list[Waiter]:
    """Every rank steps to 40 and waits ``wait_s`` inside the engine's all-reduce, but the ranks of ``odd`` inside
    the collective it maps them to (at ``odd_step``)."""
    ranks = [Waiter(r).steps(40) for r in range(WORLD)]
    for rk in ranks:
        if rk.rank in odd:
            rk.steps(odd_step, alive=False)
        rk.engine_wait(wait_s, odd.get(rk.rank, ENGINE))
    return ranks


@pytest.mark.parametrize("odd", [GATHER, OTHER_GROUP], ids=["op", "group"])
def test_a_rank_in_another_engine_collective_is_the_mismatch(tmp_path, odd):
    """Rank 3 waits in an all-gather (or another group's all-reduce) while ranks 0-2 wait in the all-reduce:
    `collective_mismatch`, rank 3 (was: healthy)."""
    report = replay_dir(write(tmp_path, deadlocked({3: odd})))
    assert (report.verdict, report.culprit_ranks, report.step) == ("collective_mismatch", [3], 40), \
        format_report(report)
    assert "ranks 0-2 in all_reduce (WORLD:[48, 8])" in report.summary and "deadlock of the engine's" in report.summary


def test_two_against_two_is_a_tie(tmp_path):
    """Ranks 2-3 in an all-gather, ranks 0-1 in the all-reduce: every rank is a culprit, undecided."""
    report = replay_dir(write(tmp_path, deadlocked({2: GATHER, 3: GATHER})))
    assert (report.verdict, report.culprit_ranks) == ("collective_mismatch", list(range(WORLD))), format_report(report)
    assert report.summary.endswith("a tie, undecided")


def test_a_stop_after_the_deadlock_is_its_consequence(tmp_path):
    """The same, then SIGTERM to every rank: still the mismatch, the other ranks' signals its consequences."""
    ranks = deadlocked({3: GATHER})
    for rk in ranks:
        rk.end("signal", signal="SIGTERM")
    report = replay_dir(write(tmp_path, ranks))
    assert (report.verdict, report.culprit_ranks) == ("collective_mismatch", [3]), format_report(report)
    assert sum("was stopped by SIGTERM" in c for c in report.consequences) == WORLD - 1, format_report(report)


@pytest.mark.parametrize("case", ["one collective", "two steps", "short", "own work", "missing"])
def test_what_is_no_deadlock_of_the_engines(tmp_path, case):
    """Left to the other rules: every rank in one collective (the network), the odd rank a step further in one op
    (the network), two records (under three intervals), a rank in its own work (lagging), a rank without a trace."""
    odd = {"one collective": {}, "two steps": {3: {**ENGINE, "engine_wait_call": "WORLD:[4]"}}, "short": {3: GATHER},
           "own work": {3: None}, "missing": {3: GATHER}}[case]
    ranks = deadlocked(odd, wait_s=2 if case == "short" else 6, odd_step=41 if case == "two steps" else 40)
    report = replay_dir(write(tmp_path, ranks[:-1] if case == "missing" else ranks))
    assert "deadlock of the engine's" not in " ".join(f.summary for f in report.findings), format_report(report)



def test_an_uneven_all_to_all_is_one_collective(tmp_path):
    """Every rank in one all-to-all whose input shape differs by rank (uneven splits): one collective, so no
    deadlock; every rank inside it is the network's reading (a red team saw this read as a mismatch in the code)."""
    a2a = {r: dict(ENGINE, engine_wait="all_to_all_single", engine_wait_call=f"WORLD:[{3 * (r + 1)}]")
           for r in range(WORLD)}
    report = replay_dir(write(tmp_path, deadlocked(a2a)))
    assert (report.verdict, report.culprit_ranks) == ("network", list(range(WORLD))), format_report(report)


ROOTED = {"main_wait": "broadcast", "main_wait_group": "same", "main_wait_call": "WORLD:[4]"}   # a rooted one


@pytest.mark.parametrize("odd", [{3: ROOTED}, {0: ROOTED, 1: ROOTED, 2: ROOTED}], ids=["one", "three"])
def test_a_rank_in_a_rooted_collective_is_in_a_collective_not_its_own_work(tmp_path, odd):
    """Rank 3 in a broadcast while ranks 0-2 all-reduce (its alive records name it as `main_wait`): the
    mismatch names rank 3, not `lagging` (it read as a rank in its own work). Ranks 0-2 in the broadcast and rank 3
    in the all-reduce: rank 3 again, the one off the largest share."""
    report = replay_dir(write(tmp_path, deadlocked(odd)))
    assert (report.verdict, report.culprit_ranks) == ("collective_mismatch", [3]), format_report(report)
    assert "in broadcast (WORLD:[4])" in report.summary


def test_a_rank_in_its_subgroups_collective_leaves_the_mismatch_undecided(tmp_path):
    """Rank 2 waits in its pair's all-reduce, ranks 0-1,3 in the all-reduce of every rank (a red team's rank 3 that
    skipped the pair's and went on): `collective_mismatch` with every rank named, undecided, since the pair's
    missing member sits in the others' collective (was: nothing found)."""
    pair = dict(ENGINE, engine_wait_group="other", engine_wait_call="2:[4]")
    report = replay_dir(write(tmp_path, deadlocked({2: pair})))
    assert (report.verdict, report.culprit_ranks) == ("collective_mismatch", list(range(WORLD))), format_report(report)
    assert "subgroup's collective" in report.summary and report.summary.endswith("a tie, undecided")


@pytest.mark.parametrize("wait_s, found", [(6, False), (65, True)])
def test_under_a_minute_a_mismatch_is_only_a_warning(tmp_path, monkeypatch, wait_s, found):
    """At the default floor (60 s) ranks in different collectives for 6 s are no cause (a red team's side thread
    broadcast a config 7 s late, and the job went on): a warning; for 65 s, `collective_mismatch`."""
    monkeypatch.setattr(engine_runs, "LAG_MIN_S", 60.0)
    report = replay_dir(write(tmp_path, deadlocked({3: GATHER}, wait_s=wait_s)))
    assert (report.verdict == "collective_mismatch") == found, format_report(report)
    assert any(w.startswith("not read as a cause (collective_mismatch") for w in report.warnings) != found

# -- real jobs: from step 22 rank 1's engine issues another collective than its peers' -------------------------------

MISMATCH = ENGINE_OWN.replace("num_redundant=2", "num_redundant=4").replace(   # 12 slots: 3 a rank
    "num_redundant_experts=2", "num_redundant_experts=4").replace(
    "rank, world = dist.get_rank(), dist.get_world_size()\n",
    "rank, world = dist.get_rank(), dist.get_world_size()\nside = dist.new_group(list(range(world)))\n").replace(
    "        dist.all_reduce(torch.ones(4))\n",
    '        if step >= 22 and rank == 1 and fault == "gather":\n'
    '            dist.all_gather([torch.ones(4) for _ in range(world)], torch.ones(4))\n'
    '        elif step >= 22 and rank == 1 and fault == "group":\n'
    '            dist.all_reduce(torch.ones(4), group=side)\n'
    '        elif step >= 22 and rank == 1 and fault == "broadcast":\n'
    '            dist.broadcast(torch.ones(4), src=1)\n'
    '        elif step >= 22 and rank == 1 and fault == "recv":\n'
    '            dist.recv(torch.zeros(4), src=0)\n'
    '        else:\n'
    '            dist.all_reduce(torch.ones(4))\n')


@pytest.mark.multiprocess
@pytest.mark.parametrize("fault", ["gather", "group", "broadcast", "recv"])
def test_a_real_engine_deadlock_names_the_rank_that_left_the_others_collective(tmp_path, fault):
    """4 ranks; from step 22 rank 1 all-gathers (or all-reduces on a second group of the same ranks, broadcasts from
    itself, receives from rank 0) where ranks 0,2-3 all-reduce: read live and after SIGTERM to torchrun,
    `collective_mismatch` naming rank 1 (was: healthy, then `signalled`; the broadcast, a rooted collective, and the
    recv read as rank 1 in its own work)."""
    live = tmp_path / "live"
    stop = lambda pids, launcher, traces: stop_once_waiting(launcher, traces, live, range(4))  # noqa: E731
    traces, code, out = torchrun_job(tmp_path, MISMATCH, stop, (fault, "60"), GRACE, ranks=4)
    assert code != 0, out
    for folder in (live, traces):
        report = replay_dir(folder)
        assert (report.verdict, report.culprit_ranks) == ("collective_mismatch", [1]), format_report(report)
        assert "ranks 0,2-3 in all_reduce" in report.summary, format_report(report)


def test_a_rank_in_recv_while_the_others_all_reduce_is_the_mismatch(tmp_path):
    """Rank 3 blocked in recv from rank 0 while ranks 0-2 all-reduce: `collective_mismatch` rank 3 (was: `lagging`
    rank 3, its recv reading as its own work)."""
    report = replay_dir(write(tmp_path, p2p_job({0: ENGINE, 1: ENGINE, 2: ENGINE, 3: p2p("recv", 0)})))
    assert (report.verdict, report.culprit_ranks) == ("collective_mismatch", [3]), format_report(report)
    assert "rank 3 in recv from rank 0 (WORLD:[4])" in report.summary and "matching call" in report.summary


def test_a_ring_of_recvs_is_a_tie(tmp_path):
    """Each rank in recv from the next (0 from 1, ..., 3 from 0): a cycle of point-to-point waits,
    `collective_mismatch` with every rank, undecided (was: nothing read)."""
    ring = {r: p2p("recv", (r + 1) % WORLD) for r in range(WORLD)}
    report = replay_dir(write(tmp_path, p2p_job(ring)))
    assert (report.verdict, report.culprit_ranks) == ("collective_mismatch", list(range(WORLD))), \
        format_report(report)
    assert report.summary.endswith("a tie, undecided")


def test_a_send_and_the_recv_it_meets_are_no_mismatch(tmp_path):
    """Rank 0 in send to rank 1, rank 1 in recv from rank 0 (the pair meet; their link stalled), ranks 2-3 in the
    all-reduce: no `collective_mismatch` (the pair's calls agree)."""
    report = replay_dir(write(tmp_path, p2p_job({0: p2p("send", 1), 1: p2p("recv", 0), 2: ENGINE, 3: ENGINE})))
    assert "collective_mismatch" not in [f.kind for f in report.findings], format_report(report)


def test_a_cycle_of_sends_and_recvs_across_two_steps_is_a_deadlock(tmp_path):
    """Rank 3 in recv from rank 0 (the wrong peer), rank 2 in send to 3, rank 1 in send to 2 at step 40, rank 0 in
    send to 1 at step 41 (it went on): the waits close a cycle, `collective_mismatch`, every rank, undecided (was:
    nothing, the ranks at two steps)."""
    waits = {0: p2p("send", 1), 1: p2p("send", 2), 2: p2p("send", 3), 3: p2p("recv", 0)}
    report = replay_dir(write(tmp_path, p2p_job(waits, steps={0: 41})))
    assert (report.verdict, report.culprit_ranks) == ("collective_mismatch", list(range(WORLD))), \
        format_report(report)
    assert "at steps 40..41" in report.summary


def test_a_chain_of_recvs_that_ends_outside_the_traced_ranks_is_no_deadlock(tmp_path):
    """Ranks 0-2 in recv from the next, rank 3 in recv from a rank outside the controller's (no peer named: a red
    team's controller on a subgroup, its pipeline fed by an untraced rank): no `collective_mismatch` (was: a tie)."""
    waits = {0: p2p("recv", 1), 1: p2p("recv", 2), 2: p2p("recv", 3), 3: p2p("recv", None)}
    report = replay_dir(write(tmp_path, p2p_job(waits)))
    assert "collective_mismatch" not in [f.kind for f in report.findings], format_report(report)


def test_a_send_and_a_recv_whose_tags_differ_do_not_meet(tmp_path):
    """Rank 0 in send to rank 1 with tag 1, rank 1 in recv from rank 0 with tag 0 (the call names the tag), ranks
    2-3 in the all-reduce: `collective_mismatch`, ranks 0-1, each in a call of its own (a red team's pair hung so
    and read as meeting: no finding)."""
    tagged = {**p2p("send", 1), "main_wait_call": "WORLD:[4] tag 1"}
    report = replay_dir(write(tmp_path, p2p_job({0: tagged, 1: p2p("recv", 0), 2: ENGINE, 3: ENGINE})))
    assert (report.verdict, report.culprit_ranks) == ("collective_mismatch", [0, 1]), format_report(report)
    assert "rank 0 in send to rank 1 (WORLD:[4] tag 1); rank 1 in recv from rank 0 (WORLD:[4])" in report.summary


def test_only_the_ranks_on_a_cycle_of_sends_are_named(tmp_path):
    """Ranks 1 and 2 each in send to the other (a cycle), rank 0 in send to rank 1 and rank 3 in recv from rank 2
    (they only feed it): `collective_mismatch` naming ranks 1-2, the others waiting (a red team's 1F1B stage that
    sent first read as a tie of all four)."""
    waits = {0: p2p("send", 1), 1: p2p("send", 2), 2: p2p("send", 1), 3: p2p("recv", 2)}
    report = replay_dir(write(tmp_path, p2p_job(waits)))
    assert (report.verdict, report.culprit_ranks) == ("collective_mismatch", [1, 2]), format_report(report)
    assert {p["rank"]: p["status"] for p in report.findings[0].ranks} == {0: "waiting", 1: "mismatch", 2: "mismatch",
                                                                            3: "waiting"}
