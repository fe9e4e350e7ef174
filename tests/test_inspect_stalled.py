"""The ``network`` finding (``inspect/stalled.py``) on hand-written traces: live ranks in the engine's collective."""

from __future__ import annotations

import pytest
from test_inspect_liveness import WORLD, Rank, write

from eplb_fsm.inspect import engine_runs
from eplb_fsm.inspect.render import format_report
from eplb_fsm.inspect.replay import replay_dir

ENGINE = {"engine_wait": "all_reduce", "engine_wait_group": "same", "engine_wait_call": "WORLD:[48, 8]",
          "engine_wait_main": True}


@pytest.fixture(autouse=True)
def short_lags(monkeypatch):
    """The traces here hold waits of seconds: read them as a lag or deadlock of minutes would be read (the default
    floor, engine_runs.LAG_MIN_S, has tests of its own)."""
    monkeypatch.setattr(engine_runs, "LAG_MIN_S", 0.0)



class Waiter(Rank):
    """A rank whose waits may name the engine's collective it sits in (``engine_wait``), as the liveness thread does."""

    def engine_wait(self, seconds: float, wait: dict | None = ENGINE, waiting_on: dict | None = None) -> "Waiter":
        start = self.ts
        while self.ts < start + seconds:
            self.ts += 1.0
            self.emit("alive", interval_s=1.0, waiting_on=waiting_on, steps_seen=self.step, **(wait or {}))
        self.offset += self.ts - start
        return self


def cut_job(behind: tuple[int, ...], wait_s: float = 6, inside: dict | None = ENGINE) -> list[Waiter]:
    """Every rank steps to 40; the ``behind`` ones stay inside step 40's collective, the rest finish it and wait in
    step 41's, all for ``wait_s`` (``inside``: what the behind ones' alive records say they sit in)."""
    ranks = [Waiter(r).steps(40) for r in range(WORLD)]
    for rk in ranks:
        if rk.rank in behind:
            rk.engine_wait(wait_s, inside)
        else:
            rk.steps(41, alive=False).engine_wait(wait_s)
    return ranks


def test_a_rank_still_inside_a_collective_its_peers_finished_is_the_network_not_lagging(tmp_path):
    """Rank 1 sits in step 40's all-reduce that ranks 0,2-3 finished: `network` naming rank 1, the others waiting."""
    report = replay_dir(write(tmp_path, cut_job((1,))))
    assert (report.verdict, report.culprit_ranks, report.step) == ("network", [1], 40), format_report(report)
    assert "rank 1 is still inside the engine's all_reduce at step 40, which ranks 0,2-3 finished" in report.summary
    assert {p["status"] for p in report.findings[0].ranks if p["rank"] != 1} == {"waiting"}


def test_every_rank_inside_one_collective_names_them_all(tmp_path):
    """Every rank in step 40's all-reduce, none finished: `network` with every rank as culprit."""
    report = replay_dir(write(tmp_path, cut_job(tuple(range(WORLD)))))
    assert (report.verdict, report.culprit_ranks) == ("network", list(range(WORLD))), format_report(report)
    assert "none finished it" in report.summary


def test_a_rank_behind_in_its_own_work_stays_lagging(tmp_path):
    """The same shape, but rank 1's alive records name no engine collective (it computes): `lagging`, as before."""
    report = replay_dir(write(tmp_path, cut_job((1,), inside=None)))
    assert (report.verdict, report.culprit_ranks) == ("lagging", [1]), format_report(report)


def test_a_stall_the_job_was_stopped_in_keeps_the_signals_as_consequences(tmp_path):
    """SIGTERMs after the stall: `network`, each signalled rank a consequence, no `signalled` finding."""
    ranks = cut_job((1,))
    for rk in ranks:
        rk.end("signal", signal="SIGTERM")
    report = replay_dir(write(tmp_path, ranks))
    assert report.verdict == "network" and "signalled" not in [f.kind for f in report.findings]
    assert sum("was stopped by SIGTERM" in c for c in report.consequences) == 3, format_report(report)


def test_too_short_a_wait_is_no_stall(tmp_path):
    """Two alive records inside the collective (under three intervals): not yet a stall, so no `network`."""
    report = replay_dir(write(tmp_path, cut_job((1,), wait_s=2)))
    assert report.verdict != "network", format_report(report)


def test_a_crash_leaves_it_to_the_other_rules(tmp_path):
    """A rank that ended with an error of its own (no failed wait) is `crashed`, not a stall of the network."""
    ranks = cut_job((1,))
    ranks[1].end("exception", error="ValueError: bad batch")
    report = replay_dir(write(tmp_path, ranks))
    assert (report.verdict, report.culprit_ranks) == ("crashed", [1]), format_report(report)


def test_waits_that_ran_out_after_the_stall_are_its_consequences(tmp_path):
    """Every rank's bounded wait runs out after the stall (gloo then closes the pairs): `network`, the errors after."""
    ranks = cut_job(tuple(range(WORLD)))
    for rk in ranks:
        rk.end("exception", error="RuntimeError: Application timeout caused pair closure")
    report = replay_dir(write(tmp_path, ranks))
    assert (report.verdict, report.culprit_ranks) == ("network", list(range(WORLD))), format_report(report)


def test_a_rank_without_a_trace_may_be_the_one_missing_so_no_network(tmp_path):
    """Ranks 0-2 sit in the collective and rank 3 has no trace file: it may never have joined, so no `network`."""
    ranks = cut_job(tuple(range(WORLD)))[:3]
    report = replay_dir(write(tmp_path, ranks))
    assert report.verdict != "network" and "network" not in [f.kind for f in report.findings], format_report(report)


def test_posted_ready_flags_hold_nobody_so_the_stall_still_reads_as_the_network(tmp_path):
    """Async: each rank's alive records also name its posted ready all-reduce (`waiting_on`), which nobody waits
    in; with the engine's collective stalled on every rank it is `network` (a red team's real 8 s cut: was a hang)."""
    flags = {"op": "all_reduce", "group": "ep", "cseq": 0}
    ranks = [Waiter(r).steps(40) for r in range(WORLD)]
    for rk in ranks:
        rk.emit("collective_start", shape=[4], dtype="torch.float64", parts=["ready"], posted=True, **flags)
        rk.engine_wait(6, waiting_on=flags)
        rk.end("exception", error="RuntimeError: Application timeout caused pair closure")
    report = replay_dir(write(tmp_path, ranks))
    assert (report.verdict, report.culprit_ranks) == ("network", list(range(WORLD))), format_report(report)
    unposted, loads = tmp_path / "unposted", dict(flags, cseq=1)   # the same, in a controller all-reduce it waits in
    unposted.mkdir()
    ranks = [Waiter(r).steps(40) for r in range(WORLD)]
    for rk in ranks:
        rk.emit("collective_start", shape=[4], dtype="torch.float64", parts=["loads"], **loads)
        rk.engine_wait(6, waiting_on=loads)
    report = replay_dir(write(unposted, ranks))
    assert report.verdict != "network", format_report(report)


def ended(errors: dict[int, tuple[float, str]]) -> list[Waiter]:
    """Every rank steps to 40 and waits in the engine (no `engine_wait` seen), then ends with ``errors[r]``:
    (seconds after the first, error)."""
    ranks = [Waiter(r).steps(40) for r in range(WORLD)]
    for rk in ranks:
        rk.steps(41, alive=False).engine_wait(5, wait=None)
    start = max(rk.ts for rk in ranks)
    for rk in ranks:
        rk.ts = start + errors[rk.rank][0]
        rk.emit("end", how="exception", error=errors[rk.rank][1])
    return ranks


RESET_BY_PEER = "RuntimeError: Read error [127.0.0.1]:3283: Connection reset by peer"
ABORT = "RuntimeError: Read error [127.0.0.1]:35226: Software caused connection abort"
CLOSED = "RuntimeError: Connection closed by peer [127.0.0.1]:653"
RAN_OUT = "RuntimeError: Timed out waiting 60000ms for recv operation to complete"


def test_two_waits_torn_down_first_name_the_connection_between_them(tmp_path):
    """Ranks 2 and 1 fail by a reset 0.5 ms apart, ranks 0,3 later: `network` naming ranks 1-2; one end reading a
    close (a real `ss -K`) reads the same."""
    report = replay_dir(write(tmp_path, ended({2: (0, ABORT), 1: (0.0005, RESET_BY_PEER), 0: (0.05, CLOSED),
                                                3: (0.06, RESET_BY_PEER)})))
    assert (report.verdict, report.culprit_ranks) == ("network", [1, 2]), format_report(report)
    assert "ranks 1-2 lost their connection to each other" in report.summary
    assert "ranks 0,3 failed after them" in report.summary
    closed = tmp_path / "closed"
    closed.mkdir()
    report = replay_dir(write(closed, ended({2: (0, CLOSED), 1: (0.0008, ABORT), 0: (0.05, CLOSED),
                                             3: (0.05, CLOSED)})))
    assert (report.verdict, report.culprit_ranks) == ("network", [1, 2]), format_report(report)


def test_waits_that_all_ran_out_together_are_not_read_as_the_network(tmp_path):
    """Rank 0's wait closes 1 us before rank 1's runs out, the rest within 5 ms: a late rank, an engine deadlock or a
    paused job end so too (a red team's real runs, 6 of 6), so the first to fail is named, not `network`."""
    report = replay_dir(write(tmp_path, ended({0: (0, CLOSED), 1: (0.000001, RAN_OUT), 2: (0.003, RAN_OUT),
                                                3: (0.005, RAN_OUT)})))
    assert (report.verdict, report.culprit_ranks) == ("crashed", [0]), format_report(report)


def test_failures_that_do_not_fit_the_shape_keep_the_first_exception(tmp_path):
    """A reset whose other end fails 0.5 s later, or waits run out 3 s apart: no `network`; the first is named."""
    for name, errors in (("reset_then_closed", {1: (0, ABORT), 2: (0.5, CLOSED), 0: (0.52, CLOSED),
                                                 3: (0.53, CLOSED)}),
                         ("apart", {0: (0, RAN_OUT), 1: (1.5, RAN_OUT), 2: (3.0, RAN_OUT), 3: (3.1, RAN_OUT)})):
        folder = tmp_path / name
        folder.mkdir()
        report = replay_dir(write(folder, ended(errors)))
        assert report.verdict == "crashed", (name, format_report(report))


def test_ranks_in_different_calls_or_a_side_thread_are_no_network(tmp_path):
    """Every rank inside an engine collective at one step, but rank 3 in another op, or in another group's call, or
    its wait on a side thread while its main thread computes (a red team's real deadlocks and lag, 6 of 6): no
    `network`."""
    for name, odd in (("op", dict(ENGINE, engine_wait="all_gather")),
                      ("group", dict(ENGINE, engine_wait_call="2:[48, 8]")),
                      ("thread", dict(ENGINE, engine_wait_main=False))):
        folder = tmp_path / name
        folder.mkdir()
        ranks = [Waiter(r).steps(40) for r in range(WORLD)]
        for rk in ranks:
            rk.engine_wait(6, odd if rk.rank == 3 else ENGINE)
        report = replay_dir(write(folder, ranks))
        assert report.verdict != "network", (name, format_report(report))
    same = tmp_path / "same"   # the same records with rank 3 in the others' call: `network`
    same.mkdir()
    ranks = [Waiter(r).steps(40) for r in range(WORLD)]
    for rk in ranks:
        rk.engine_wait(6)
    assert replay_dir(write(same, ranks)).verdict == "network"
