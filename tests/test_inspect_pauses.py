"""A pause of the whole job (every process SIGSTOPped together, then SIGCONT) is no freeze of one rank.

The records are laid out as real ranks write them (compact JSON, an ``alive`` record a second, one written
right after the SIGCONT), from three real runs (``eplb-fsm simulate`` with the job SIGSTOPped 8 s): every rank
is silent over the same window, and the first rank to resume writes its ``alive`` a fraction of a ms before the
others. Replay once read that record as "another rank kept writing" inside the later rank's silence and named
that rank ``frozen``. A single rank SIGSTOPped while its peers write stays ``frozen`` (the last cases).
"""

from __future__ import annotations

from eplb_fsm.inspect.render import format_report
from eplb_fsm.inspect.replay import diagnose

T0 = 1_796_586_000.0
HEADER = {"schema": 1, "run_id": "pause0000000001", "mode": "sync", "group": "ep", "transfer_group": "ep_transfer",
          "config": {"num_layers": 2}}


class Rank:
    """One rank's records: steps 0.1 s apart with an ``alive`` record every 10 steps (interval 1 s)."""

    def __init__(self, rank: int, world: int = 2) -> None:
        self.rank, self.world, self.step, self.t = rank, world, 0, 0.0
        self.records: list[dict] = []
        self.emit("header", **HEADER)

    def emit(self, event: str, **fields) -> None:
        rec = {"ts": round(T0 + self.t, 6), "rank": self.rank, "world": self.world, "event": event,
               "state": "collecting", "step": self.step, "seq": len(self.records)}
        rec.update(fields)
        self.records.append(rec)

    def alive(self, waiting_on=None) -> "Rank":
        self.emit("alive", interval_s=1.0, waiting_on=waiting_on, steps_seen=self.step)
        return self

    def steps(self, upto: int) -> "Rank":
        while self.step < upto:
            self.step += 1
            self.t += 0.1
            self.emit("step")
            if self.step % 10 == 0:
                self.alive()
        return self

    def stopped(self, until: float) -> "Rank":
        """SIGSTOP until ``until`` (s after T0), then SIGCONT: the liveness thread writes first on resuming."""
        self.t = until
        return self.alive()

    def wait(self, seconds: float, waiting_on=None) -> "Rank":
        """Alive records once a second, the step staying put (a wait for a peer)."""
        for _ in range(int(seconds)):
            self.t += 1.0
            self.alive(waiting_on)
        return self

    def end(self, how: str = "closed", **fields) -> dict[int, list[dict]]:
        self.t += 0.01
        self.emit("end", how=how, **fields)
        return self.records


def test_every_rank_paused_together_is_healthy_with_a_pause_warning():
    """Both ranks silent over the same 8 s, rank 0 resuming 0.4 ms first: healthy and a warning naming the window
    (was: frozen, rank 1, "while the other ranks kept writing")."""
    ranks = [Rank(r).steps(30) for r in range(2)]
    for rk in ranks:
        rk.stopped(11.0 + rk.rank * 0.0004).steps(60)
    report = diagnose({rk.rank: rk.end() for rk in ranks})
    assert (report.verdict, report.culprit_ranks) == ("healthy", []), format_report(report)
    pause = [w for w in report.warnings if "the whole job was paused" in w]
    assert len(pause) == 1 and pause[0].startswith("ranks 0-1 were all silent from t+3.0 s to t+11.0 s (8.0 s, "
                                                   "at step 30 in collecting)"), report.warnings


def test_a_pause_of_three_ranks_resuming_in_any_order_blames_none():
    """Three ranks paused together, each resuming a fraction of a ms apart in reverse order: no frozen finding."""
    ranks = [Rank(r, world=3).steps(20) for r in range(3)]
    for rk in ranks:
        rk.stopped(10.0 + (2 - rk.rank) * 0.0003).steps(40)
    report = diagnose({rk.rank: rk.end() for rk in ranks})
    assert report.verdict == "healthy" and not [f for f in report.findings if f.kind == "frozen"], \
        format_report(report)
    assert any(w.startswith("ranks 0-2 were all silent") for w in report.warnings), report.warnings


def test_a_collective_that_timed_out_across_the_pause_is_no_late_rank():
    """Rank 0 entered an all-reduce just before the pause, rank 1 only after it (8 s later by the clock): the
    pause, not rank 1, made the wait run out, so no ``lagging`` rank 1 (was: frozen rank 1)."""
    ranks = [Rank(r).steps(30) for r in range(2)]
    coll = {"op": "all_reduce", "group": "ep", "cseq": 0, "shape": [16], "dtype": "torch.float64",
            "parts": ["loads"]}
    ranks[0].t += 0.001
    ranks[0].emit("collective_start", **coll)
    ranks[0].stopped(11.0)
    ranks[0].emit("collective_error", error="RuntimeError: Operation timed out!", **coll)
    ranks[1].stopped(11.0004)
    ranks[1].t += 0.001
    ranks[1].emit("collective_start", **coll)
    ranks[1].emit("collective_error", error="RuntimeError: Connection closed by peer", **coll)
    for rk in ranks:
        rk.steps(50)
    report = diagnose({rk.rank: rk.end() for rk in ranks})
    assert report.verdict == "healthy", format_report(report)
    assert not [f for f in report.findings if f.kind in ("frozen", "lagging")]
    assert any("the whole job was paused" in w for w in report.warnings), report.warnings


def test_one_rank_stopped_while_its_peer_waits_is_still_frozen():
    """Rank 1 SIGSTOPped 8 s while rank 0 waits and writes an alive record every second: frozen, rank 1."""
    ranks = [Rank(r).steps(30) for r in range(2)]
    ranks[0].wait(8)
    ranks[1].stopped(11.5)
    for rk in ranks:
        rk.steps(50)
    report = diagnose({rk.rank: rk.end() for rk in ranks})
    assert (report.verdict, report.culprit_ranks) == ("frozen", [1]), format_report(report)
    assert not any("the whole job was paused" in w for w in report.warnings)


def test_a_rank_frozen_longer_than_a_pause_of_the_job_is_still_frozen():
    """Rank 1 stopped 12 s; the whole job (rank 0 too) paused for 4 s of them: rank 1 is frozen (rank 0 wrote
    for 8 s of its silence), and the 4 s rank 0 was silent read as a pause, not as rank 0's freeze."""
    ranks = [Rank(r).steps(30) for r in range(2)]
    ranks[0].wait(4)
    ranks[0].stopped(11.0).wait(4)
    ranks[1].stopped(15.0004)
    for rk in ranks:
        rk.steps(50)
    report = diagnose({rk.rank: rk.end() for rk in ranks})
    assert (report.verdict, report.culprit_ranks) == ("frozen", [1]), format_report(report)
    assert not [f for f in report.findings if f.kind == "frozen" and f.culprits != [1]], format_report(report)
