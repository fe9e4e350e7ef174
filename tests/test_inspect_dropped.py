"""A rank with no ``end`` whose peers lost their connection to it and went on: it died there, not the peers.

The shape of a real run (``eplb-fsm simulate --ranks 2 --scale 30:3``, the joiner SIGKILLed in its scale's
transfer): the survivors' wait failed with "Connection reset by peer" right after the dead rank's last record,
they rolled back and served on, and the launcher stopped them with SIGTERM 1.5 s later. Replay once read that
as ``signalled`` naming the survivors ("no rank had failed before"). Here, three ranks of one group: rank 2's
trace stops inside an all-reduce; what ranks 0-1 then saw decides the reading.
"""

from __future__ import annotations

from conftest import timeline

from eplb_fsm.inspect.dropped import Dropped
from eplb_fsm.inspect.elastic import build_cast
from eplb_fsm.inspect.render import format_report
from eplb_fsm.inspect.replay import diagnose, summarize_rank

T0 = 1_796_606_000.0
RESET = "RuntimeError: [../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:37292: Connection reset by peer"
TIMEOUT = "RuntimeError: Timed out waiting 2000ms for recv operation to complete"
COLL = {"op": "all_reduce", "group": "ep", "cseq": 0, "shape": [4], "dtype": "torch.float64", "parts": ["loads"]}


def records(rank: int, tail: list[tuple[float, str, dict]]) -> list[dict]:
    """Header, 20 quiet steps, the all-reduce's start at step 21 (t+1.0 s), then ``tail`` ((t, event, fields))."""
    head = [(0.0, "header", {"schema": 1, "run_id": "d0a1b2c3d4e5f607", "mode": "sync", "group": "ep",
                             "transfer_group": "ep_transfer", "config": {"num_layers": 2}, "step": 0}),
            (0.5, "steps", {"count": 20, "dummy": 0, "step": 1}),
            (1.0, "collective_start", dict(COLL, step=21))]
    return timeline(rank, 3, T0, head + tail, state="collecting", step=21)


def survived(error: str, end: dict | None = None) -> list[tuple[float, str, dict]]:
    """The wait fails at t+1.01 s with ``error``; the rank serves 60 more steps; then ``end`` at t+2.5 s
    (a SIGTERM when None)."""
    return [(1.01, "collective_error", dict(COLL, step=21, error=error)),
            (1.8, "steps", {"count": 60, "dummy": 0, "step": 22}),
            (2.5, "end", end or {"how": "signal", "signal": "SIGTERM", "step": 82})]


def job(error: str = RESET, rank1_end: dict | None = None, rank1_t: float | None = None) -> dict[int, list[dict]]:
    one = survived(error, rank1_end)
    if rank1_t is not None:   # rank 1 ended (in order) at rank1_t, before rank 0's wait failed
        one = [(rank1_t, "end", rank1_end)]
    return {0: records(0, survived(error)), 1: records(1, one), 2: records(2, [])}


def dropped_of(traces: dict[int, list[dict]], key: int):
    cast = build_cast({r: summarize_rank(recs, r) for r, recs in traces.items()}, None, [])
    return Dropped(cast).first_after(next(k for k in cast.parts if k[0] == key))


def test_a_rank_whose_peers_lost_their_connection_to_it_and_served_on_died():
    """Rank 2 without an end, ranks 0-1's wait reset right after its last record, their SIGTERM 1.5 s later: rank 2
    is the culprit (was: signalled, ranks 0-1, 'no rank had failed before')."""
    report = diagnose(job())
    text = format_report(report)
    assert report.verdict != "signalled" and report.culprit_ranks == [2], text
    # the death is told with the hang it caused (rank 2 never finished the all-reduce)
    assert "rank 2 died (SIGKILL?) at step 21 in collecting: no end record, rank 0 lost its connection to it 0.01 s " \
        "after its last record" in text
    assert any(c.startswith("rank 0 was stopped by SIGTERM") for c in report.consequences)


def test_the_first_lost_connection_after_the_last_record_is_the_one_named():
    """Dropped.first_after gives the earliest peer collective that failed with a lost connection."""
    ts, peer, coll = dropped_of(job(), 2)
    assert (round(ts - T0, 2), peer[0], coll.group, coll.cseq) == (1.01, 0, "ep", 0)


def test_a_timeout_is_no_lost_connection():
    """A wait that timed out (a frozen peer closes nothing) is left to the silence rules."""
    assert dropped_of(job(error=TIMEOUT), 2) is None


def test_a_member_that_had_ended_explains_the_lost_connection():
    """Rank 1 ended in order before rank 0's wait failed: its exit closed the sockets, so rank 2 is not named."""
    traces = job(rank1_end={"how": "closed", "step": 21}, rank1_t=1.005)
    assert dropped_of(traces, 2) is None


def test_a_lost_connection_before_the_last_record_is_not_its_death():
    """A peer's error earlier than the rank's own last record tells nothing of where the rank stopped."""
    traces = job()
    traces[2] = records(2, [(1.5, "steps", {"count": 5, "dummy": 0, "step": 22})])
    assert dropped_of(traces, 2) is None


SIGTERM = {"how": "signal", "signal": "SIGTERM", "step": 21}


def test_ranks_signalled_after_their_peers_lost_a_signalled_rank_are_the_launcher_s_reaction():
    """Rank 2 SIGTERMed inside the all-reduce, ranks 0-1 lose their connection to it and serve on, and are SIGTERMed
    1.5 s later: signalled names rank 2 alone, ranks 0-1 are consequences (was: signalled, ranks 0-2)."""
    traces = job()
    traces[2] = records(2, [(1.005, "end", SIGTERM)])
    report = diagnose(traces)
    assert (report.verdict, report.culprit_ranks) == ("signalled", [2]), format_report(report)
    assert sorted(c.split(" was stopped")[0] for c in report.consequences) == ["rank 0", "rank 1"]


def test_ranks_signalled_one_by_one_with_no_lost_connection_are_all_stopped_from_outside():
    """The same stops 1.5 s apart, but ranks 0-1 lost no connection (a timeout): one stop from outside, ranks 0-2."""
    traces = job(error=TIMEOUT)
    traces[2] = records(2, [(1.005, "end", SIGTERM)])
    report = diagnose(traces)
    assert (report.verdict, report.culprit_ranks) == ("signalled", [0, 1, 2]), format_report(report)
