"""The ``network`` finding (``inspect/stalled.py``) on hand-written traces: live ranks in the engine's collective."""

from __future__ import annotations

from test_inspect_liveness import WORLD, Rank, write

from eplb_fsm.inspect.render import format_report
from eplb_fsm.inspect.replay import replay_dir

ENGINE = {"engine_wait": "all_reduce", "engine_wait_group": "same"}


class Waiter(Rank):
    """A rank whose waits may name the engine's collective it sits in (``engine_wait``), as the liveness thread does."""

    def engine_wait(self, seconds: float, wait: dict | None = ENGINE) -> "Waiter":
        start = self.ts
        while self.ts < start + seconds:
            self.ts += 1.0
            self.emit("alive", interval_s=1.0, waiting_on=None, steps_seen=self.step, **(wait or {}))
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


def test_a_rank_that_ended_with_an_exception_leaves_it_to_the_other_rules(tmp_path):
    """A rank that gave up its wait ends the stall's reading: the exception rules speak, not `network`."""
    ranks = cut_job((1,))
    ranks[1].end("exception", error="RuntimeError: Timed out waiting 5000ms for recv operation to complete")
    report = replay_dir(write(tmp_path, ranks))
    assert report.verdict != "network", format_report(report)


def test_a_rank_without_a_trace_may_be_the_one_missing_so_no_network(tmp_path):
    """Ranks 0-2 sit in the collective and rank 3 has no trace file: it may never have joined, so no `network`."""
    ranks = cut_job(tuple(range(WORLD)))[:3]
    report = replay_dir(write(tmp_path, ranks))
    assert report.verdict != "network" and "network" not in [f.kind for f in report.findings], format_report(report)
