"""A freeze the job got past is no cause of what failed after it; one it did not get past stays the verdict.

Three ranks of one group on the ``Rank`` writer of test_inspect_liveness: rank 2 is silent 4 s (SIGSTOP) while
ranks 0-1 wait for it, then every rank finishes all-reduces again; rank 0 is then SIGKILLed (no end), and ranks
1-2 fail on the closed connection.
"""

from __future__ import annotations

from test_inspect_liveness import Rank, write

from eplb_fsm.inspect.replay import replay_dir

RESET = "RuntimeError: Read error [127.0.0.1]:4515: Connection reset by peer"


def job(went_on: bool) -> list[Rank]:
    ranks = [Rank(r, world=3).steps(30, collective_every=5) for r in range(3)]
    ranks[2].freeze(4.0)
    for rk in ranks[:2]:
        rk.wait(4.0)
    upto = 40 if went_on else 30    # with all-reduces every 5 steps: the job went on with rank 2, or not at all
    for rk in ranks:
        rk.steps(upto, alive=False, collective_every=5)
    # rank 0 is killed here; the others' next all-reduce fails on the connection it closed
    for rk in ranks[1:]:
        rk.emit("collective_start", op="all_reduce", group="ep", cseq=rk.cseq["ep"], shape=[16],
                dtype="torch.float64", parts=["loads"])
        rk.ts += 0.02
        rk.emit("collective_error", op="all_reduce", group="ep", cseq=rk.cseq["ep"], shape=[16],
                dtype="torch.float64", parts=["loads"], error=RESET)
        rk.end("exception", error=RESET)
    return ranks


def test_a_freeze_the_job_got_past_gives_way_to_the_later_death(tmp_path):
    """Every rank finished all-reduces after rank 2's silence: rank 0's death is the verdict, the freeze a finding."""
    report = replay_dir(write(tmp_path, job(went_on=True)))
    assert report.culprit_ranks == [0] and report.verdict in ("hang", "rank_died"), report.summary
    assert [f.culprits for f in report.findings if f.kind == "frozen"] == [[2]]


def test_a_freeze_the_job_did_not_get_past_stays_the_cause(tmp_path):
    """No collective finished after the silence before rank 0's trace stopped: the freeze is still the verdict."""
    report = replay_dir(write(tmp_path, job(went_on=False)))
    assert (report.verdict, report.culprit_ranks) == ("frozen", [2]), report.summary


def test_a_freeze_the_job_got_past_gives_way_to_a_later_hang(tmp_path):
    """After rank 2's silence every rank finished all-reduces; then rank 1 never joined one that ranks 0 and 2 waited
    in (a skipped step, as a red team's real run had): the hang names rank 1 (was: `frozen`, rank 2)."""
    ranks = [Rank(r, world=3).steps(30, collective_every=5) for r in range(3)]
    ranks[2].freeze(4.0)
    for rk in ranks[:2]:
        rk.wait(4.0)
    for rk in ranks:
        rk.steps(40, alive=False, collective_every=5)
    for rk in (ranks[0], ranks[2]):
        rk.emit("collective_start", op="all_reduce", group="ep", cseq=rk.cseq["ep"], shape=[16],
                dtype="torch.float64", parts=["loads"])
        rk.wait(5.0).end("exception", error="GroupBroken: all_reduce timed out after 5 s")
    ranks[1].steps(41, alive=False).wait(5.0).end("exception", error="GroupBroken: all_reduce timed out after 5 s")
    report = replay_dir(write(tmp_path, ranks))
    assert (report.verdict, report.culprit_ranks) == ("hang", [1]), report.summary
    assert [f.culprits for f in report.findings if f.kind == "frozen"] == [[2]]


CLOSED = "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:6064"


def test_a_rank_killed_in_a_freeze_is_named_when_every_survivor_failed_on_it(tmp_path):
    """Rank 1 silent 2.6 s, rank 2 killed 1 s into that wait; continued, rank 1 fails the all-reduce on the dead peer
    and so do ranks 0 and 3: the freeze is the verdict, and a later finding names rank 2 alone with its death (the
    shape of one CI run of test_real_failures)."""
    ranks = [Rank(r, world=4).steps(30, collective_every=5) for r in range(4)]
    ranks[1].freeze(2.6)
    waiting = {"op": "all_reduce", "group": "engine", "cseq": 0}
    for rk, seconds in ((ranks[0], 2.6), (ranks[2], 1.0), (ranks[3], 2.6)):
        rk.emit("collective_start", op="all_reduce", group="engine", cseq=0, shape=[48, 8], dtype="torch.float64")
        start = rk.ts
        while rk.ts + 1.0 <= start + seconds:
            rk.ts += 1.0
            rk.alive(waiting_on=waiting)
    ranks[1].alive()
    ranks[1].emit("collective_start", op="all_reduce", group="engine", cseq=0, shape=[48, 8], dtype="torch.float64")
    for rk in (ranks[1], ranks[0], ranks[3]):
        rk.ts = ranks[1].ts + 0.02
        rk.emit("collective_error", op="all_reduce", group="engine", cseq=0, shape=[48, 8], dtype="torch.float64",
                error=CLOSED)
        rk.end("exception", error=CLOSED)
    report = replay_dir(write(tmp_path, ranks))
    assert (report.verdict, report.culprit_ranks) == ("frozen", [1]), report.summary
    own = [f for f in report.findings if 2 in f.culprits]
    assert [f.culprits for f in own] == [[2]] and own[0].kind in ("rank_died", "hang"), report.summary
    assert own[0].kind == "rank_died" or own[0].details[0].startswith("rank 2 died"), own[0]
