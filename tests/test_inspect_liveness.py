"""Replay's verdicts from the liveness records (``end``, ``alive``) on small hand-written JSONL traces."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from eplb_fsm.cli import main
from eplb_fsm.inspect import engine_runs, liveness
from eplb_fsm.inspect.render import format_report
from eplb_fsm.inspect.replay import MixedRuns, replay_dir

T0 = 1_700_000_000.0
STEP_S = 0.1          # 10 steps a second
WORLD = 4


class Rank:
    """One rank's trace, written the way EventTrace writes it (compact JSON, one record a line)."""

    def __init__(self, rank: int, world: int = WORLD, run_id: str = "run-a") -> None:
        self.rank, self.world, self.seq, self.step, self.ts = rank, world, 0, 0, T0
        self.offset = 0.0     # time spent waiting or frozen: later steps come that much later
        self.state = "collecting"
        self.records: list[dict] = []
        self.cseq: dict[str, int] = {}
        self.emit("header", schema=1, run_id=run_id, config_hash="0123456789abcdef", mode="sync",
                  config={"num_layers": 2}, versions={"eplb_fsm": "test"}, group="ep", transfer_group="ep_transfer")

    def emit(self, event: str, **fields) -> dict:
        rec = {"ts": round(self.ts, 6), "rank": self.rank, "world": self.world, "event": event, "state": self.state,
               "step": self.step, "seq": self.seq}
        rec.update(fields)
        self.seq += 1
        self.records.append(rec)
        return rec

    def steps(self, upto: int, alive: bool = True, collective_every: int = 0) -> "Rank":
        """Engine steps up to ``upto`` (inclusive), an alive record every 10 steps (1 s)."""
        while self.step < upto:
            self.step += 1
            self.ts = T0 + self.offset + self.step * STEP_S
            self.emit("step")
            if collective_every and self.step % collective_every == 0:
                self.collective()
            if alive and self.step % 10 == 0:
                self.alive()
        return self

    def collective(self, op: str = "all_reduce", group: str = "ep", parts=("loads",)) -> None:
        c = self.cseq.get(group, 0)
        self.cseq[group] = c + 1
        info = {"op": op, "group": group, "cseq": c, "shape": [16], "dtype": "torch.float64", "parts": list(parts)}
        self.emit("collective_start", **info)
        self.emit("collective_end", duration_s=0.001, **info)

    def alive(self, waiting_on=None) -> None:
        self.emit("alive", interval_s=1.0, waiting_on=waiting_on, steps_seen=self.step)

    def wait(self, seconds: float) -> "Rank":
        """Alive records once a second for ``seconds`` while the step stays where it is (a wait)."""
        start = self.ts
        while self.ts < start + seconds:
            self.ts += 1.0
            self.alive()
        self.offset += self.ts - start
        return self

    def freeze(self, seconds: float) -> "Rank":
        self.ts += seconds
        self.offset += seconds
        return self

    def end(self, how: str = "closed", **fields) -> "Rank":
        self.ts += 0.01
        self.emit("end", how=how, **fields)
        return self


def write(tmp_path: Path, ranks: list[Rank], name: str = "rank{r:05d}.jsonl") -> Path:
    for rk in ranks:
        (tmp_path / name.format(r=rk.rank)).write_text(
            "".join(json.dumps(rec, separators=(",", ":")) + "\n" for rec in rk.records), encoding="utf-8")
    return tmp_path


def killed_job(victim: int = 2, at: int = 57) -> list[Rank]:
    """``victim`` is SIGKILLed at step ``at``; the others wait 20 s in the engine, then the launcher SIGTERMs them."""
    ranks = [Rank(r) for r in range(WORLD)]
    for rk in ranks:
        rk.steps(at)
    for rk in ranks:
        if rk.rank != victim:
            rk.steps(at + 1, alive=False).wait(20).end("signal", signal="SIGTERM")
    return ranks


def test_killed_rank_is_named_first_and_the_sigterms_are_consequences(tmp_path):
    """A rank with no end record, silent 20 s before the others, died; the SIGTERMed ranks are only consequences."""
    report = replay_dir(write(tmp_path, killed_job()))
    assert report.verdict == "rank_died" and report.culprit_ranks == [2] and report.step == 57
    assert report.summary.startswith("rank 2 died (SIGKILL?) at step 57 in collecting: no end record")
    assert "before the others' last record" in report.summary
    detail = report.to_dict()["verdict_detail"]
    assert detail["kind"] == "rank_died" and detail["culprits"] == [2] and detail["state"] == "collecting"
    sigterms = [c for c in detail["consequences"] if "SIGTERM" in c]
    assert len(sigterms) == 3 and all("after the cause" in c for c in sigterms)
    assert format_report(report).splitlines()[0].startswith("rank_died: rank 2 died (SIGKILL?) at step 57")


def test_rank_without_end_while_the_others_closed_died(tmp_path):
    """Killed right after its last step, before the others closed: no end record is still a death."""
    ranks = [Rank(r).steps(100) for r in range(WORLD)]
    for rk in ranks:
        if rk.rank != 0:
            rk.end()
    report = replay_dir(write(tmp_path, ranks))
    assert report.verdict == "rank_died" and report.culprit_ranks == [0] and report.step == 100
    assert "while every other rank wrote its end record" in report.summary


def test_json_output_carries_the_structured_verdict(tmp_path, capsys):
    """--json has verdict_detail (kind, culprits, step, state, reason, consequences); exit 1."""
    write(tmp_path, killed_job(victim=1, at=33))
    assert main(["replay", str(tmp_path), "--json"]) == 1
    detail = json.loads(capsys.readouterr().out)["verdict_detail"]
    assert detail["kind"] == "rank_died" and detail["culprits"] == [1] and detail["step"] == 33
    assert detail["reason"].startswith("rank 1 died") and len(detail["consequences"]) == 3


def test_help_documents_the_exit_codes(capsys):
    """replay --help lists exit statuses 0, 1 and 2."""
    with pytest.raises(SystemExit):
        main(["replay", "--help"])
    out = capsys.readouterr().out
    assert "exit status:" in out and "0  healthy" in out and "1  a problem" in out and "2  usage error" in out


def test_rank_that_died_inside_a_collective_its_peer_never_joined_is_not_the_cause(tmp_path):
    """Rank 0 dies inside an all-reduce rank 1 never issued (rank 1 lagged): the verdict names rank 1."""
    ranks = [Rank(r, world=2).steps(19) for r in range(2)]
    ranks[0].steps(20)
    c = ranks[0].cseq.get("ep", 0)
    ranks[0].emit("collective_start", op="all_reduce", group="ep", cseq=c, shape=[16], dtype="torch.float64",
                  parts=["loads"])
    ranks[1].steps(20, alive=False)    # one step behind: its engine step, no controller collective
    ranks[1].end("exception", error="RuntimeError: Read error: Connection reset by peer")
    report = replay_dir(write(tmp_path, ranks))
    assert report.verdict == "hang" and report.culprit_ranks == [1], format_report(report)
    assert any("rank 0 died" in d for d in report.findings[0].details)


def test_sigterm_before_any_failure_is_the_cause(tmp_path):
    """A rank stopped by SIGTERM while nothing had failed is named (signalled), not reported healthy."""
    ranks = [Rank(r).steps(30) for r in range(WORLD)]
    ranks[1].end("signal", signal="SIGTERM")
    for rk in ranks[:1] + ranks[2:]:
        rk.steps(31, alive=False).wait(10).end("exception", error="GroupBroken: all_reduce timed out")
    report = replay_dir(write(tmp_path, ranks))
    assert report.verdict == "signalled" and report.culprit_ranks == [1]
    assert sum("gave up waiting" in c for c in report.consequences) == 3


def test_frozen_rank_is_named_with_its_gap(tmp_path):
    """A 9 s silence of one rank while the others kept writing alive records is a freeze (SIGSTOP, SIGCONT)."""
    ranks = [Rank(r) for r in range(WORLD)]
    for rk in ranks:
        rk.steps(30)
    ranks[1].freeze(9.0)
    for rk in ranks:
        rk.wait(9.0 if rk.rank != 1 else 0.0).steps(60).end()
    report = replay_dir(write(tmp_path, ranks))
    assert report.verdict == "frozen" and report.culprit_ranks == [1] and report.step == 30
    # the silence from its last record before the 9 s stop to its next step 0.1 s after it
    assert "froze for 9.1 s" in report.summary and "SIGSTOP" in report.summary


def test_crash_with_exception_is_named(tmp_path):
    """An end with an exception that is no wait timing out is a crash; the others' timeouts follow from it."""
    ranks = [Rank(r).steps(40) for r in range(WORLD)]
    ranks[3].end("exception", error="ValueError: bad plan")
    for rk in ranks[:3]:
        rk.steps(41, alive=False).wait(8).end("exception", error="GroupBroken: all_reduce timed out after 5 s")
    report = replay_dir(write(tmp_path, ranks))
    assert report.verdict == "crashed" and report.culprit_ranks == [3] and "ValueError: bad plan" in report.summary


def test_lagging_rank_is_the_culprit_and_the_waiting_ranks_are_not(tmp_path, monkeypatch):
    """All ranks alive with stalled steps (no engine wait named): the one at the lower step lags, the others only
    wait; at the default floor of a minute a 6 s stall is a warning naming it, not a cause."""
    ranks = [Rank(r).steps(40) for r in range(WORLD)]
    for rk in ranks:
        if rk.rank != 3:
            rk.steps(41, alive=False)
        rk.wait(6)
    held = replay_dir(write(tmp_path, ranks))
    assert held.verdict == "healthy" and any("(lagging, rank 3 lags at step 40" in w for w in held.warnings), \
        format_report(held)
    monkeypatch.setattr(engine_runs, "LAG_MIN_S", 0.0)
    report = replay_dir(tmp_path)
    assert report.verdict == "lagging" and report.culprit_ranks == [3] and report.step == 40
    assert "ranks 0-2 wait at step 41" in report.summary


def test_a_stall_no_longer_than_twice_the_longest_one_before_is_no_lag(tmp_path, monkeypatch):
    """The same, but every rank sat 6 s at step 30 before (a slow step or stage, its waits unseen: a red team's
    healthy pipeline on isend/irecv handles): a stall of 6 s at step 40 is a warning even with the floor lowered;
    one of 13 s is `lagging`."""
    monkeypatch.setattr(engine_runs, "LAG_MIN_S", 0.0)
    verdicts = []
    for stall in (6, 13):
        ranks = [Rank(r).steps(30).wait(6).steps(40) for r in range(WORLD)]
        for rk in ranks:
            if rk.rank != 3:
                rk.steps(41, alive=False)
            rk.wait(stall)
        (tmp_path / str(stall)).mkdir()
        verdicts.append(replay_dir(write(tmp_path / str(stall), ranks)).verdict)
    assert verdicts == ["healthy", "lagging"], verdicts


def test_step_count_mismatch_is_a_finding(tmp_path):
    """Every rank closed in order but one ended a step short: a finding, not slack."""
    ranks = [Rank(r).steps(99 if r == 1 else 100).end() for r in range(WORLD)]
    report = replay_dir(write(tmp_path, ranks))
    assert report.verdict == "step_count_mismatch" and report.culprit_ranks == [1] and report.step == 99


def test_clean_job_with_liveness_is_healthy(tmp_path):
    """Every rank closed in order at the same step with steady alive records: healthy, exit 0."""
    ranks = [Rank(r).steps(100, collective_every=10).end() for r in range(WORLD)]
    report = replay_dir(write(tmp_path, ranks))
    assert report.verdict == "healthy", format_report(report)
    assert report.run_id == "run-a"


def test_extra_collective_blames_the_rank_that_issued_it(tmp_path):
    """One rank issues one controller collective more than the others: it is the culprit, not the three others."""
    ranks = [Rank(r) for r in range(WORLD)]
    for rk in ranks:
        rk.steps(10, collective_every=10)
        rk.steps(15)
        if rk.rank == 2:
            rk.collective()        # log_stats on rank 2 alone, same op and shape as the regular one
        rk.steps(40, collective_every=20).end()
    report = replay_dir(write(tmp_path, ranks))
    assert report.verdict == "collective_mismatch" and report.culprit_ranks == [2], format_report(report)
    assert "extra all_reduce" in report.summary and "ranks 0-1,3 never issued" in report.summary
    # the step where the sequences part: rank 2's second all-reduce came at step 15, the others' at 20
    assert report.step == 15 and "the sequences part at cseq 1" in report.summary


def test_traces_of_two_runs_are_refused_with_the_files_named(tmp_path, capsys):
    """Files of different run ids are refused (exit 2), naming which files belong to which run; --run-id picks one."""
    ranks = [Rank(r, run_id="run-a" if r < 2 else "run-b").steps(20).end() for r in range(WORLD)]
    write(tmp_path, ranks)
    with pytest.raises(MixedRuns, match=r"run run-a: rank files 0-1 .*run run-b: rank files 2-3"):
        replay_dir(tmp_path)
    assert main(["replay", str(tmp_path)]) == 2
    assert "rank00002.jsonl" in capsys.readouterr().err
    report = replay_dir(tmp_path, world=2, run_id="run-b")
    assert sorted(r["rank"] for r in report.ranks) == [2, 3]


def test_duplicate_rank_file_is_reported(tmp_path):
    """Two files claiming one rank give a duplicate_rank_file finding naming both files."""
    ranks = [Rank(r).steps(20).end() for r in range(WORLD)]
    write(tmp_path, ranks)
    write(tmp_path, ranks[2:3], name="rank{r}.jsonl")
    report = replay_dir(tmp_path)
    assert report.verdict == "duplicate_rank_file" and report.culprit_ranks == [2]
    assert "rank00002.jsonl" in report.summary and "rank2.jsonl" in report.summary


def test_swapped_rank_files_are_reported_and_the_culprit_keeps_its_rank(tmp_path):
    """Files whose names say another rank than their records are reported; the dead rank is still named right."""
    write(tmp_path, killed_job(victim=2))
    a, b = tmp_path / "rank00001.jsonl", tmp_path / "rank00002.jsonl"
    text_a, text_b = a.read_text(), b.read_text()
    a.write_text(text_b)
    b.write_text(text_a)
    report = replay_dir(tmp_path)
    assert report.verdict == "rank_died" and report.culprit_ranks == [2]
    swapped = [f for f in report.findings if f.kind == "swapped_rank_file"]
    assert swapped and "rank00001.jsonl holds the records of rank 2" in swapped[0].summary


def test_records_out_of_order_are_a_finding_with_file_and_line(tmp_path):
    """Two lines swapped (seq going back) give an out_of_order finding with file:line."""
    ranks = [Rank(r).steps(30, collective_every=10).end() for r in range(WORLD)]
    write(tmp_path, ranks)
    path = tmp_path / "rank00001.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    lines[20], lines[21] = lines[21], lines[20]
    path.write_text("".join(lines))
    report = replay_dir(tmp_path)
    found = [f for f in report.findings if f.kind == "out_of_order"]
    assert found and found[0].culprits == [1] and "rank00001.jsonl:22" in found[0].summary


def test_wrongly_typed_fields_are_warnings_with_file_and_line(tmp_path):
    """A well-formed record with "step": "x" is a warning naming file and line, never a traceback."""
    ranks = [Rank(r).steps(30, collective_every=10).end() for r in range(WORLD)]
    write(tmp_path, ranks)
    path = tmp_path / "rank00003.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    n = next(i for i, line in enumerate(lines) if '"collective_start"' in line)
    lines[n] = lines[n].replace('"step":10,', '"step":"x",').replace('"cseq":0,', '"cseq":[0],')
    path.write_text("".join(lines))
    report = replay_dir(tmp_path)
    warning = next(w for w in report.warnings if f"rank00003.jsonl:{n + 1}" in w)
    assert "field 'step' is str 'x', expected an integer" in warning and "'cseq'" in warning


def test_world_is_validated(tmp_path, capsys):
    """--world 0 and --jobs -1 are usage errors (exit 2); a --world that differs from the traces is reported."""
    write(tmp_path, [Rank(r).steps(20).end() for r in range(WORLD)])
    with pytest.raises(SystemExit) as exc:
        main(["replay", str(tmp_path), "--world", "0"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        main(["replay", str(tmp_path), "--jobs", "-1"])
    assert exc.value.code == 2
    with pytest.raises(ValueError, match="world must be an integer >= 1"):
        replay_dir(tmp_path, world=0)
    report = replay_dir(tmp_path, world=2)
    mismatch = [f for f in report.findings if f.kind == "world_mismatch"]
    assert mismatch and "--ranks 2 was given but the traces were written by a world of 4" in mismatch[0].summary


def test_traces_without_liveness_records_give_no_liveness_finding(tmp_path):
    """Older traces (no end, no alive) leave the liveness checks silent: the step checks judge them."""
    ranks = [Rank(r).steps(50, alive=False) for r in range(WORLD)]
    from eplb_fsm.inspect.elastic import build_cast
    from eplb_fsm.inspect.replay import load_dir

    cast = build_cast(load_dir(write(tmp_path, ranks)).summaries, None, [])
    assert not liveness.check_liveness(cast).aware
    assert replay_dir(tmp_path).verdict == "healthy"


def test_healthy_verdict_lists_aborted_rearrangements(tmp_path):
    """A rearrangement every rank rolled back keeps the verdict healthy but is listed with its step."""
    from eplb_fsm.testing import Faults, SyntheticJob

    job = SyntheticJob(world=WORLD, trace_dir=tmp_path)
    job.run(45, Faults(transfer_error={1: (19, 1)}))
    job.close()
    report = replay_dir(tmp_path)
    assert report.verdict == "healthy", format_report(report)
    assert [a["step"] for a in report.aborted] == [19]
    assert "1 aborted rearrangement(s): step 19: ranks 0-3 aborted the rearrangement" in report.summary
    assert "aborted rearrangements (1):" in format_report(report)



def test_a_hung_job_stopped_from_outside_is_a_hang_not_signalled(tmp_path):
    """Every rank SIGTERMed while ranks 0-2 wait inside an all-reduce rank 3 never joined: the hang names rank 3."""
    ranks = [Rank(r).steps(30) for r in range(WORLD)]
    for rk in ranks[:3]:
        c = rk.cseq.get("ep", 0)
        rk.emit("collective_start", op="all_reduce", group="ep", cseq=c, shape=[16], dtype="torch.float64",
                parts=["loads"])
        rk.wait(8)
    ranks[3].wait(8)                  # stuck in its own work, outside any collective
    for rk in ranks:
        rk.end("signal", signal="SIGTERM")
    report = replay_dir(write(tmp_path, ranks))
    assert report.verdict == "hang" and report.culprit_ranks == [3], format_report(report)
    assert "stopped from outside, not its cause" in report.findings[0].details[0]
    assert sum("while waiting inside all_reduce" in c for c in report.consequences) == 3


def test_a_job_stopped_while_every_rank_was_inside_one_collective_stays_signalled(tmp_path):
    """SIGTERM while all ranks sit in the same all-reduce (a live capture, no rank missing): signalled."""
    ranks = [Rank(r).steps(30) for r in range(WORLD)]
    for rk in ranks:
        rk.emit("collective_start", op="all_reduce", group="ep", cseq=rk.cseq.get("ep", 0), shape=[16],
                dtype="torch.float64", parts=["loads"])
        rk.end("signal", signal="SIGTERM")
    report = replay_dir(write(tmp_path, ranks))
    assert report.verdict == "signalled" and report.culprit_ranks == [0, 1, 2, 3], format_report(report)


# --------------------------------------------------------------------------- the real writer on a fake clock


class Clocked:
    """Ranks written by the real EventTrace, each with its Liveness beating, on one fake clock (ticks of 10 ms).

    Every ``step_ticks`` a rank counts a step; every ``coll_every`` steps it all-reduces on ``ep`` in
    lockstep (it waits until every rank not dead has started that cseq). A rank can be frozen (writes
    nothing, like SIGSTOP), stalled (no steps, the liveness thread still beats) or dead (nothing ever again).
    """

    def __init__(self, tmp_path: Path, world: int, interval: float = 1.0, step_ticks: int = 10,
                 coll_every: int = 0) -> None:
        from eplb_fsm.liveness import Liveness
        from eplb_fsm.trace import EventTrace

        self.tick, self.step_ticks, self.coll_every, self.interval = 0, step_ticks, coll_every, interval
        self.traces = [EventTrace(r, world, tmp_path, clock=self.now) for r in range(world)]
        for trace in self.traces:
            trace.set_context(state="collecting", step=0)
            trace.header({"num_layers": 2}, run_id="run-c", mode="async", group="ep", transfer_group="ep_transfer")
        self.lives = [Liveness(t, interval, clock=self.now) for t in self.traces]
        self.next_beat = [0] * world
        self.frozen_until = [0] * world
        self.stalled, self.dead = set(), set()
        self.opened: dict[int, dict] = {}       # cseq -> rank -> OpenCollective
        self.waiting: set[int] = set()

    def now(self) -> float:
        return T0 + self.tick * 0.01

    def run(self, seconds: float) -> "Clocked":
        end = self.tick + round(seconds * 100)
        while self.tick < end:
            self.tick += 1
            for r, trace in enumerate(self.traces):
                if r in self.dead or self.tick < self.frozen_until[r] or trace.ended:
                    continue
                if self.tick % self.step_ticks == 0 and r not in self.stalled and r not in self.waiting:
                    self._step(r, trace)
                if self.tick >= self.next_beat[r]:
                    self.lives[r].beat()
                    self.next_beat[r] = self.tick + round(self.lives[r].period() * 100)
        return self

    def _step(self, r: int, trace) -> None:
        trace.set_context(step=trace.step + 1)
        trace.count_step()
        if self.coll_every and trace.step % self.coll_every == 0:
            opened = trace.open_collective("all_reduce", "ep", [16], "torch.float64", parts=["loads"])
            joined = self.opened.setdefault(opened.start["cseq"], {})
            joined[r] = opened
            if len(joined) < len(self.traces):   # a dead rank never joins: the others wait for ever
                self.waiting.add(r)
                return
            for other, o in sorted(joined.items()):
                self.traces[other].close_collective(o)
                self.waiting.discard(other)

    def freeze(self, rank: int, seconds: float) -> "Clocked":
        self.frozen_until[rank] = self.tick + round(seconds * 100)
        return self

    def end(self, how: str = "closed", **fields) -> None:
        for r, trace in enumerate(self.traces):
            if r not in self.dead:   # a killed process flushes nothing: its counted steps are lost
                trace.end(how, **fields)
                trace.close()


def test_a_crash_while_a_posted_all_reduce_is_open_is_crashed_with_its_error(tmp_path):
    """Async rank 1 raises ValueError with its posted ready all-reduce still open (peers read it): crashed, not hang."""
    from eplb_fsm.trace import EventTrace

    now = [T0]
    traces = [EventTrace(r, 2, tmp_path, clock=lambda: now[0]) for r in range(2)]
    for trace in traces:
        trace.set_context(state="collecting", step=0)
        trace.header({"num_layers": 2}, run_id="run-p", mode="async", group="ep", transfer_group="ep_transfer")
        trace.alive(1.0, None)
    posted = []
    for trace in traces:
        trace.set_context(step=30)
        posted.append(trace.open_collective("all_reduce", "ep", [3], "torch.float64", posted=True, parts=["ready"]))
    now[0] += 0.1
    traces[1].set_context(step=31)
    traces[1].end("exception", error="ValueError: bad plan")   # before it reads its posted flags
    traces[0].set_context(step=31)
    traces[0].close_collective(posted[0])
    waiting = traces[0].open_collective("all_reduce", "ep", [3], "torch.float64", posted=True, parts=["ready"])
    for _ in range(10):
        now[0] += 1.0
        traces[0].alive(1.0, 31)
    traces[0].close_collective(waiting, RuntimeError("Operation timed out!"))
    traces[0].end("exception", error="RuntimeError: Operation timed out!")
    for trace in traces:
        trace.close()
    report = replay_dir(tmp_path)
    assert report.verdict == "crashed" and report.culprit_ranks == [1], format_report(report)
    assert "ValueError: bad plan" in report.summary
    assert any("rank 0 gave up waiting" in c for c in report.consequences)


def test_a_freeze_late_in_a_long_run_at_interval_2_is_found(tmp_path):
    """Liveness every 2 s: 3 s gaps between runs are normal; a 12 s SIGSTOP after 400 s is still a freeze."""
    job = Clocked(tmp_path, 2, interval=2.0).run(400)
    job.freeze(1, 12)
    job.stalled.add(0)                  # rank 0 waits on rank 1 meanwhile (its alive records go on)
    job.run(12)
    job.stalled.clear()
    job.run(10).end()
    frozen = [f for f in replay_dir(tmp_path).findings if f.kind == "frozen"]
    assert frozen and frozen[0].culprits == [1]
    assert 12 <= float(re.search(r"froze for ([0-9.]+) s", frozen[0].summary).group(1)) < 14


def test_a_freeze_after_a_run_of_steps_is_at_the_run_s_last_step(tmp_path):
    """100 steps/s, runs written every 1.5 s: a freeze after a `steps` run is placed at its last step, not its first."""
    job = Clocked(tmp_path, 3, interval=1.0, step_ticks=1, coll_every=400).run(16.9)   # the others wait at step 2000
    job.freeze(1, 8).run(12).end()
    runs = [json.loads(line) for line in trace_lines(tmp_path, 1) if '"event":"steps"' in line]
    before = max((r for r in runs if r["ts"] <= T0 + 16.9), key=lambda r: r["ts"])
    report = replay_dir(tmp_path)
    assert report.verdict == "frozen" and report.culprit_ranks == [1], format_report(report)
    assert report.step == before["step"] + before["count"] - 1 and before["count"] > 1


def trace_lines(tmp_path: Path, rank: int) -> list[str]:
    return (tmp_path / f"rank{rank:05d}.jsonl").read_text().splitlines()


def test_a_killed_rank_whose_last_steps_were_unwritten_is_the_hang_s_culprit(tmp_path):
    """Rank 1 killed at step 790 (its last run written at ~step 750); the others hang at step 800: one hang verdict."""
    job = Clocked(tmp_path, 3, interval=1.0, step_ticks=1, coll_every=200).run(7.9)
    job.dead.add(1)
    job.run(22).end("signal", signal="SIGTERM")
    last = json.loads(trace_lines(tmp_path, 1)[-1])
    assert last["event"] == "steps" and last["step"] + last["count"] - 1 < 798
    report = replay_dir(tmp_path)
    assert (report.verdict, report.culprit_ranks, report.step) == ("hang", [1], 800), format_report(report)
    assert report.findings[0].details[0].startswith("rank 1 died (SIGKILL?)")


def test_a_scale_abort_is_no_aborted_rearrangement():
    """A scale-up whose joiner never arrives ends in a fault from scaling: listed with the scales, not as a rollback."""
    from eplb_fsm.inspect.replay import diagnose
    from eplb_fsm.testing import SyntheticJob

    job = SyntheticJob(world=2, num_layers=2, interval=10)
    job.run(12)
    assert job.scale(3, absent=True)["outcome"] == "aborted"
    job.run(15)
    report = diagnose(job.records())
    assert report.verdict == "healthy" and report.scales[0]["outcome"] == "aborted", report.summary
    assert report.aborted == [] and "aborted rearrangement" not in report.summary


def test_an_aborted_rearrangement_names_the_rank_that_never_joined_when_it_never_rolled_back():
    """Rank 1 stops before layer 1's transfer the others time out in: the rollback names rank 1, as the hang does."""
    from eplb_fsm.inspect.replay import diagnose
    from eplb_fsm.testing import Faults, SyntheticJob

    job = SyntheticJob(world=WORLD)
    job.run(30, Faults(transfer_error={1: (19, 1)}))
    records = job.records()
    cut = next(i for i, rec in enumerate(records[1]) if rec.get("step") == 19 and rec.get("trigger") == "layer_done")
    records[1] = records[1][:cut + 1]
    report = diagnose(records)
    assert report.verdict == "hang" and report.culprit_ranks == [1], format_report(report)
    (aborted,) = report.aborted
    assert aborted["step"] == 19 and aborted["late_ranks"] == [1]
    assert aborted["text"].endswith("rank 1 never joined batch_isend_irecv (group ep_transfer, cseq 3)")


def test_json_consequences_are_the_text_s(tmp_path, capsys):
    """An input problem about the culprit (records out of order) is a later finding, never a consequence."""
    ranks = killed_job()
    recs = ranks[2].records
    recs[10]["seq"], recs[11]["seq"] = recs[11]["seq"], recs[10]["seq"]
    write(tmp_path, ranks)
    assert main(["replay", str(tmp_path), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["culprit_ranks"] == [2] and [f["kind"] for f in report["findings"]] == ["rank_died", "out_of_order"]
    consequences = report["verdict_detail"]["consequences"]
    assert len(consequences) == 3 and all("SIGTERM" in c for c in consequences)
    assert main(["replay", str(tmp_path)]) == 1
    text = capsys.readouterr().out.splitlines()
    at = text.index("  consequences (not culprits) (3):")
    assert [line.strip() for line in text[at + 1:at + 4]] == consequences


def test_each_aborted_rearrangement_names_its_own_late_rank():
    """Rollbacks at steps 19 (handled) and 39 (rank 2 never rolled back): step 39 names rank 2, not step 19's rank."""
    from eplb_fsm.inspect.replay import diagnose
    from eplb_fsm.testing import Faults, SyntheticJob

    job = SyntheticJob(world=WORLD)
    job.run(45, Faults(transfer_error={1: (19, 1), 2: (39, 1)}))
    records = job.records()
    cut = next(i for i, rec in enumerate(records[2]) if rec.get("step") == 39 and rec.get("trigger") == "layer_done")
    records[2] = records[2][:cut + 1]
    report = diagnose(records)
    assert report.verdict == "hang" and report.culprit_ranks == [2], format_report(report)
    assert [(a["step"], a["late_ranks"]) for a in report.aborted] == [(19, [1]), (39, [2])]
    assert report.aborted[1]["collective"] == report.collective


# the error texts gloo, torch and the controller write when a peer is gone or a wait ran out (from real runs)
GLOO_CLOSED = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
               "by peer [127.0.0.1]:20891. This is typically caused by a remote worker crashing.")
WAIT_TEXTS = [
    GLOO_CLOSED,
    "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:15261: Connection "
    "reset by peer. This is typically caused by a remote worker hanging or bugs in the application.",
    "TransferError: layer 1, wave 0/1: RuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:81] Timed out "
    "waiting 2000ms for recv operation to complete",
    "RuntimeError: Operation timed out!",
    "GroupBroken: all_reduce of ['ready'] failed: RuntimeError: Operation timed out!",
]
ENGINE_TEXTS = [
    "RuntimeError: KeyError: request_timeout missing from sampling params",
    "RuntimeError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error; Cuda failure: an illegal memory "
    "access was encountered",
    "ValueError: gloo_rank_map has no entry for expert 7",
]


def _ends(first: str, second: str) -> list[Rank]:
    """Rank 1 ends at step 40 with ``first``; rank 0 waits 5 s, then ends with ``second``."""
    ranks = [Rank(r, world=2).steps(40) for r in range(2)]
    ranks[1].end("exception", error=first)
    ranks[0].steps(41, alive=False).wait(5).end("exception", error=second)
    return ranks


@pytest.mark.parametrize("text", ENGINE_TEXTS, ids=["timeout-word", "nccl-word", "gloo-word"])
def test_an_engine_error_naming_timeout_nccl_or_gloo_is_a_crash(tmp_path, text):
    """An error that only mentions "timeout", "NCCL" or "gloo" is the engine's own crash, not a failed wait."""
    report = replay_dir(write(tmp_path, _ends(text, GLOO_CLOSED)))
    assert (report.verdict, report.culprit_ranks) == ("crashed", [1]), format_report(report)
    assert any(c.startswith("rank 0 gave up waiting") for c in report.consequences)


@pytest.mark.parametrize("text", WAIT_TEXTS, ids=["closed", "reset", "recv-timeout", "wait-timeout", "group-broken"])
def test_exceptions_that_are_all_failed_waits_name_the_first_rank_to_fail(tmp_path, capsys, text):
    """Every rank ended with a failed wait and nothing else explains it: not healthy; the first exception is named
    (crashed, exit 1) and the later one is printed as a consequence."""
    report = replay_dir(write(tmp_path, _ends(text, GLOO_CLOSED)))
    assert (report.verdict, report.culprit_ranks) == ("crashed", [1]), format_report(report)
    assert "the first rank to end with an exception" in report.summary and "no trace shows a cause" in report.summary
    assert report.consequences == [c for c in report.consequences if c.startswith("rank 0 gave up waiting")] != []
    assert main(["replay", str(tmp_path)]) == 1
    assert "consequences (not culprits)" in capsys.readouterr().out


def test_a_rank_that_closed_while_its_peer_still_ran_left_early(tmp_path):
    """Rank 1 closed in order at step 40 while rank 0 went on and then failed waiting: left_early rank 1."""
    ranks = [Rank(r, world=2).steps(40) for r in range(2)]
    ranks[1].end()
    ranks[0].steps(41, alive=False).wait(3).end("exception", error=GLOO_CLOSED)
    report = replay_dir(write(tmp_path, ranks))
    assert (report.verdict, report.culprit_ranks, report.step) == ("left_early", [1], 40), format_report(report)
    assert report.exit_code == 1 and any(c.startswith("rank 0 gave up waiting") for c in report.consequences)


def test_two_ranks_killed_together_are_one_death(tmp_path):
    """Ranks 2 and 3 stop at step 30 without an end; ranks 0-1 end 0.5 s later with failed waits: one rank_died
    finding naming ranks 2-3 (their traces stop before the survivors' first end), never the survivors."""
    ranks = [Rank(r).steps(30) for r in range(WORLD)]
    for rk in ranks[:2]:
        rk.ts += 0.5
        rk.end("exception", error=GLOO_CLOSED)
    report = replay_dir(write(tmp_path, ranks))
    assert (report.verdict, report.culprit_ranks, report.step) == ("rank_died", [2, 3], 30), format_report(report)
    assert report.summary.startswith("ranks 2-3 died (SIGKILL?) at step 30 in collecting: no end record on any")
    assert len(report.consequences) == 2


def test_a_crash_then_the_launcher_killing_the_others_blames_the_crash(tmp_path):
    """Rank 0 ends with an engine error at step 30; ranks 1-3 stop 0.2 s before without an end (the launcher killed
    them after the crash, their last records a moment older): crashed rank 0, never rank_died for the others."""
    ranks = [Rank(r).steps(30) for r in range(WORLD)]
    ranks[0].ts += 0.2
    ranks[0].end("exception", error="RuntimeError: engine bug: index out of range")
    report = replay_dir(write(tmp_path, ranks))
    assert (report.verdict, report.culprit_ranks, report.step) == ("crashed", [0], 30), format_report(report)
    assert "rank_died" not in format_report(report)


def test_waits_that_gloo_and_torch_end_with_read_as_failed_waits():
    """The pair closure, client-socket and store-key timeouts, a niced build that did not return and a write into a
    torn-down connection are waits."""
    from eplb_fsm.inspect.endings import WAIT_ERROR

    for text in ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Application timeout caused "
                 "pair closure", "DistStoreError: The client socket has timed out after 5000ms",
                 "RuntimeError: Timeout waiting for key: default_pg/0//cpu//0", "TimeoutError: niced call "
                 "'build' did not return within 15.0 s",
                 # a write into a connection the kernel tore down (a real `ss -K` of a rank's gloo sockets)
                 "RuntimeError: [../gloo/transport/tcp/pair.cc:339] writev [127.0.0.1]:28874: Software caused "
                 "connection abort"):
        assert WAIT_ERROR.search(text), text
    assert not WAIT_ERROR.search("KeyError: request_timeout missing from sampling params")


def test_freezes_that_start_together_are_one_finding_and_freezes_apart_are_two(tmp_path):
    """Ranks 1-2 frozen together (0.3 s apart) read as one freeze naming both; rank 3, stopped 2 s after them while
    they are still stopped, and rank 4 stopped later still, are freezes of their own."""
    job = Clocked(tmp_path, 5).run(10)
    job.stalled |= {0, 2, 3, 4}         # the others wait on the frozen ranks meanwhile (their alive records go on)
    job.freeze(1, 6).run(0.3)
    job.freeze(2, 6).run(1.7)           # rank 3 writes ~2 s into rank 1's silence (once inside 2.5 intervals)
    job.freeze(3, 5).run(6)
    job.stalled = {0, 1, 2, 3}
    job.run(0.3).freeze(4, 5).run(5)
    job.stalled.clear()
    job.run(5).end()
    report = replay_dir(tmp_path)
    frozen = [f for f in report.findings if f.kind == "frozen"]
    assert [f.culprits for f in frozen] == [[1, 2], [3], [4]], format_report(report)
    assert report.verdict == "frozen" and report.culprit_ranks == [1, 2]
    assert frozen[0].summary.startswith("ranks 1-2 froze for ")
    assert sorted(p["rank"] for p in frozen[0].ranks) == [1, 2]


def test_a_rank_that_gave_up_waiting_is_said_to_wait_where_its_wait_failed_not_where_it_last_beat(tmp_path):
    """Its last alive record names all-reduce cseq 0, which it then finished; it failed in cseq 1 when its peer
    died: the consequence names cseq 1 (was: cseq 0, a second old)."""
    info = {"op": "all_reduce", "group": "ep", "shape": [16], "dtype": "torch.float64", "parts": ["loads"]}
    reset = "RuntimeError: Read error [127.0.0.1]:4515: Connection reset by peer"
    ranks = [Rank(r, world=2).steps(40) for r in range(2)]
    for rk in ranks:
        rk.emit("collective_start", cseq=0, **info)
    ranks[1].alive(waiting_on=dict(info, cseq=0))
    for rk in ranks:
        rk.emit("collective_end", cseq=0, duration_s=0.3, **info)
        rk.steps(42, alive=False)
    # rank 0 is SIGKILLed here; rank 1's next all-reduce fails on the closed connection
    ranks[1].emit("collective_start", cseq=1, **info)
    ranks[1].ts += 0.02
    ranks[1].emit("collective_error", cseq=1, error=reset, **info)
    ranks[1].end("exception", error=reset)
    report = replay_dir(write(tmp_path, ranks))
    assert report.culprit_ranks == [0], report.summary
    (said,) = [c for c in report.to_dict()["verdict_detail"]["consequences"] if c.startswith("rank 1 gave up")]
    assert "waiting in all_reduce (group ep, cseq 1" in said, said


def _timed_out_on_a_ticking_rank(error: str, last_alive_s: float) -> list[Rank]:
    """Rank 1 stalls in its engine at step 16 (alive records from 1 s into rank 0's wait up to ``last_alive_s``);
    rank 0 waits in step 17's all-reduce, whose wait fails after 3 s with ``error``, and ends with it. Rank 1 has no
    end record (its launcher stopped it later, and it traced no signal)."""
    info = {"op": "all_reduce", "group": "ep", "cseq": 0, "shape": [16], "dtype": "torch.float64", "parts": ["loads"]}
    ranks = [Rank(r, world=2).steps(16) for r in range(2)]
    ranks[0].steps(17, alive=False)
    ranks[0].emit("collective_start", **info)
    start = ranks[0].ts
    ranks[1].ts = start
    ranks[1].wait(int(last_alive_s))
    ranks[1].ts = start + last_alive_s
    ranks[1].alive()
    for t in (1.0, 2.0):   # a waiting rank ticks every interval
        ranks[0].ts = start + t
        ranks[0].alive(waiting_on=info)
    ranks[0].ts = start + 3.0
    ranks[0].emit("collective_error", error=error, **info)
    ranks[0].end("exception", error="RuntimeError: controller failed at step 17")
    return ranks


def test_a_rank_that_ticked_until_its_peer_timed_out_on_it_is_the_hangs_culprit_not_dead(tmp_path):
    """Rank 1 wrote alive records until 0.1 s before rank 0 timed out waiting for it: alive then (stalled in its
    engine), so a hang naming rank 1, with no 'died' reading (was: 'rank 1 died (SIGKILL?) ... while every other
    rank wrote its end record', from a red team's torchrun runs)."""
    timeout = "RuntimeError: Timed out waiting 3000ms for recv operation to complete"
    report = replay_dir(write(tmp_path, _timed_out_on_a_ticking_rank(timeout, 2.9)))
    text = format_report(report)
    assert (report.verdict, report.culprit_ranks) == ("hang", [1]), text
    assert "never joined all_reduce" in report.summary and "died" not in text, text


@pytest.mark.parametrize("error, last_alive_s", [
    ("RuntimeError: Read error [127.0.0.1]:4515: Connection reset by peer", 2.9),   # its sockets closed: gone
    ("RuntimeError: Timed out waiting 3000ms for recv operation to complete", 1.5),  # it missed a tick
])
def test_a_rank_gone_before_its_peer_gave_up_still_died(tmp_path, error, last_alive_s):
    """The same wait, but rank 0 lost its connection to rank 1, or rank 1's last alive is 1.5 s (over an interval)
    before rank 0 gave up: rank 1 died, as before."""
    report = replay_dir(write(tmp_path, _timed_out_on_a_ticking_rank(error, last_alive_s)))
    assert report.culprit_ranks == [1] and "rank 1 died (SIGKILL?)" in format_report(report), format_report(report)


@pytest.mark.parametrize("senders, culprits", [
    ({1: False, 0: True, 2: True}, [1]),       # an operator's kill of rank 1, then the launcher's reaction
    ({1: True, 0: True, 2: True}, [0, 1, 2]),  # the launcher stopped them all (a stop sent to it)
    ({}, [0, 1, 2]),                           # no sender recorded (an engine's own handler): as before
])
def test_a_rank_signalled_from_outside_then_its_peers_by_their_launcher(tmp_path, senders, culprits):
    """Rank 1 is SIGTERMed first, ranks 0 and 2 13 ms later: with the senders recorded (stop_signals), ranks stopped
    by their launcher after a rank stopped from outside are consequences (was: signalled, ranks 0-2)."""
    ranks = [Rank(r, world=3).steps(30) for r in range(3)]
    base = max(rk.ts for rk in ranks)
    for rk in ranks:
        rk.ts = base + (0.0 if rk.rank == 1 else 0.013)
        sender = {"sender": {"pid": 4242, "parent": senders[rk.rank]}} if senders else {}
        rk.end("signal", signal="SIGTERM", **sender)
    report = replay_dir(write(tmp_path, ranks))
    assert (report.verdict, report.culprit_ranks) == ("signalled", culprits), format_report(report)
    reacted = [c for c in report.consequences if "from its launcher" in c]
    assert len(reacted) == (2 if culprits == [1] else 0), report.consequences
