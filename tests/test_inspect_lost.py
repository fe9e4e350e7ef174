"""Collective findings whose evidence lies in a trace's lost lines (``lost``): told as lost_records, not as fact."""

from __future__ import annotations

import pytest

from eplb_fsm.inspect import replay as rp
from eplb_fsm.inspect.collective_checks import check_collectives
from eplb_fsm.inspect.elastic import build_cast
from eplb_fsm.inspect.model import Collective, CollectiveIndex, CollRun, RankSummary
from eplb_fsm.inspect.lost import held_around
from eplb_fsm.inspect.render import format_report
from eplb_fsm.testing import Faults, SyntheticJob, hang_faults
from eplb_fsm.trace import EventTrace

T0 = 1_700_000_000.0


def rolled_ranks(tmp_path) -> None:
    """Two ranks of 300 steps, an all-reduce every 10 steps, rolled into several small segments each, closed."""
    for rank in (0, 1):
        now = [T0]

        def clock() -> float:
            now[0] += 0.01
            return now[0]

        trace = EventTrace(rank, 2, tmp_path, clock=clock, max_bytes=2048, max_segments=5)
        trace.set_context(state="collecting", step=0)
        trace.header({"a": 1}, run_id="r" * 16)
        for step in range(300):
            trace.set_context(step=step)
            trace.count_step()
            if step % 10 == 0:
                with trace.collective("all_reduce", shape=[4], dtype="float32"):
                    pass
        trace.end("closed")
        trace.close()


@pytest.mark.parametrize("damage", ["removed", "emptied", "cut"])
def test_a_damaged_middle_segment_is_lost_records_not_a_culprit(tmp_path, damage):
    """Rank 1 lost a middle segment (removed, emptied, cut mid-line): no hang or mismatch blamed on it as fact."""
    rolled_ranks(tmp_path)
    seg = tmp_path / "rank00001.jsonl.2"
    assert (tmp_path / "rank00001.jsonl.4").exists() and rp.replay_dir(tmp_path).verdict == "healthy"
    if damage == "removed":
        seg.unlink()
    else:
        seg.write_bytes(b"" if damage == "emptied" else seg.read_bytes()[: seg.stat().st_size // 2])
    report = rp.replay_dir(tmp_path)
    text = format_report(report)
    assert (report.verdict, report.culprit_ranks) == ("lost_records", [1]), text
    assert "but rank 1's trace lost " in report.summary and "so this may be the gap, not the rank" in report.summary
    assert report.summary.endswith("rank 1 then ended in order (closed) at step 299")
    assert report.findings[0].details[0] in ("read as it stands: hang, culprit rank 1",
                                             "read as it stands: collective_mismatch, culprit rank 1")
    assert not any(f.kind in ("hang", "collective_mismatch") for f in report.findings), text


def drop_collective(records: list[dict], group: str, cseq: int) -> list[dict]:
    """``records`` without the start and end of (group, cseq), their seqs left as they were (lost lines)."""
    return [r for r in records if not (r.get("group") == group and r.get("cseq") == cseq)]


def test_a_collective_lost_from_the_records_is_not_a_skip():
    """Rank 1's lines of one transfer batch are lost (seq jumps there): lost_records, where seq running on is a skip."""
    records = SyntheticJob(world=4).run(45).records()
    records[1] = drop_collective(records[1], "ep_transfer", 1)
    report = rp.diagnose(records)
    assert (report.verdict, report.culprit_ranks, report.collective["cseq"]) == ("lost_records", [1], 1)
    assert "rank 1 never issued batch_isend_irecv" in report.summary and "rank 1's trace lost 2 record(s)" \
        in report.summary


def test_a_real_hang_after_lost_lines_is_still_the_verdict():
    """Lines lost early on rank 1 do not hide rank 2's hang later in the same group: the hang leads."""
    job = SyntheticJob(world=4)
    job.run(40, hang_faults(4, culprit=2, step=29))
    records = job.records()
    records[1] = drop_collective(records[1], "ep", 0)
    report = rp.diagnose(records)
    assert (report.verdict, report.culprit_ranks, report.step) == ("hang", [2], 29), format_report(report)
    lost = [f for f in report.findings if f.kind == "lost_records"]
    assert [(f.culprits, f.collective["group"], f.collective["cseq"]) for f in lost] == [([1], "ep", 0)]


def test_the_finding_stands_for_a_culprit_whose_trace_lost_nothing():
    """Ranks 1 and 2 lack one batch, only rank 1 by lost lines: the mismatch stays, on rank 2 alone."""
    records = SyntheticJob(world=4).run(45).records()
    records[1] = drop_collective(records[1], "ep_transfer", 1)
    records[2] = drop_collective(records[2], "ep_transfer", 1)
    for seq, rec in enumerate(records[2], records[2][0]["seq"]):
        rec["seq"] = seq    # rank 2 never wrote them: a real skip
    report = rp.diagnose(records)
    assert (report.verdict, report.culprit_ranks) == ("collective_mismatch", [2]), format_report(report)
    assert "so for rank 1 this may be the gap, not the rank" in report.summary


def session(rank: int, status: str, gap: bool, waiting: bool = False) -> RankSummary:
    """A closed session holding world#0 (started at seq 5, ``status``), maybe with lines lost after it."""
    s = RankSummary(rank=rank, records=20, last_step=10, final_state="collecting", world=2,
                    header={"world": 2}, end={"how": "closed", "step": 10, "ts": T0 + 1})
    index = s.collectives["world"] = CollectiveIndex()
    index[0] = Collective("all_reduce", "world", 0, [4], "float32", 3, "collecting", None, 5, status=status)
    if gap:
        s.gaps.append({"first": 7, "last": 9, "lost": 3, "from_step": 3, "from_ts": T0, "to_step": 5, "to_ts": T0})
    if waiting:
        s.alive.append((T0 + 1, 10, "collecting", {"op": "all_reduce", "group": "world", "cseq": 0}))
    return s


@pytest.mark.parametrize("gap, waiting, kind", [(False, False, "hang"), (True, False, "lost_records"),
                                                (True, True, "hang")], ids=["no-gap", "gap", "gap-but-alive-inside"])
def test_a_collective_never_finished_is_lost_records_only_when_its_end_may_be_lost(gap, waiting, kind):
    """Open on rank 1 with lines lost after its start: lost_records, unless its last alive record waited in it."""
    cast = build_cast({0: session(0, "ended", False), 1: session(1, "open", gap, waiting)}, None, [])
    found = check_collectives(cast)
    assert [(f.kind, f.culprits) for f in found] == [(kind, [1])]


@pytest.mark.parametrize("lost_at, kind", [(T0 + 1, "collective_mismatch"), (T0 + 49, "lost_records")],
                         ids=["long-before", "while-it-ran"])
def test_lines_lost_long_before_anyone_started_the_collective_cannot_hold_it(lost_at, kind):
    """Rank 1 lacks world#0 (started at t+50 by rank 0) and lost lines ending at ``lost_at``: only a late gap hedges."""
    parts = {r: session(r, "ended", False) for r in (0, 1)}
    for r, s in parts.items():
        s.collectives["world"][0].ts = T0 + 50
        s.collectives["world"][1] = Collective("all_reduce", "world", 1, [4], "float32", 8, "collecting", None, 30,
                                               ts=T0 + 80, status="ended")
    del parts[1].collectives["world"].one[0]
    parts[1].gaps.append({"first": 3, "last": 4, "lost": 2, "from_step": 0, "from_ts": T0, "to_step": 5,
                          "to_ts": lost_at})
    found = check_collectives(build_cast(parts, None, []))
    assert [(f.kind, f.culprits) for f in found] == [(kind, [1])]


def test_held_around_takes_bulk_runs_by_their_template():
    """The cseqs started before a gap: entries by their seq, a bulk run by its template's (it follows it)."""
    s = RankSummary(rank=0)
    index = s.collectives["ep"] = CollectiveIndex()
    template = Collective("all_reduce", "ep", 0, [4], None, 0, "collecting", None, 3, status="ended")
    index[0] = template
    index.runs.append(CollRun(1, 40, template, 1))
    index[45] = Collective("all_reduce", "ep", 45, [4], None, 50, "collecting", None, 200, status="ended")
    assert held_around(s, "ep", 150) == (40, 45)      # lines lost after the run: cseqs 41-44 would lie there
    assert held_around(s, "ep", 2) == (-1, 0)         # lost before anything
    assert held_around(s, "ep", 300) == (45, float("inf"))
    assert held_around(s, "other", 5) == (-1, float("inf"))


# --------------------------------------------------------------------------- state changes lost with the lines


def without(records: list[dict], lost) -> list[dict]:
    """``records`` without those ``lost`` picks, their seqs left as they were (lost lines)."""
    return [r for r in records if not lost(r)]


def plan_of_step(step: int):
    """The plan_ready transition record of ``step``."""
    return lambda r: r.get("trigger") == "plan_ready" and r["step"] == step


def kinds(report) -> list[tuple[str, list[int]]]:
    return [(f.kind, f.culprits) for f in report.findings]


def test_a_transition_lost_with_its_line_is_lost_records_not_a_divergence():
    """Rank 1's plan_ready line of step 9 is lost: one lost_records on rank 1, no illegal_transition or divergence."""
    records = SyntheticJob(world=4).run(45).records()
    records[1] = without(records[1], plan_of_step(9))
    report = rp.diagnose(records)
    assert kinds(report) == [("lost_records", [1])], format_report(report)
    assert report.illegal_transitions == [] and report.step == 9
    assert "rank 1 took layer_done: transferring -> transferring layer 0 at step 9 where ranks 0,2-3 took " \
           "plan_ready" in report.summary
    assert "but rank 1's trace lost 1 record(s) here (seq 14, step 9), so this may be the gap, not the rank" \
        in report.summary
    assert report.findings[0].details == [
        "read as it stands: decision_divergence, culprit rank 1",
        "rank 1's lost lines held its state change(s) from planning to transferring"]


def test_a_transition_never_written_is_still_illegal_and_a_divergence():
    """The same plan_ready never written (seq runs on, no gap): illegal_transition and decision_divergence as before."""
    records = SyntheticJob(world=4).run(45).records()
    gone = next(r for r in records[1] if plan_of_step(9)(r))
    records[1] = [dict(r, seq=r["seq"] - (r["seq"] > gone["seq"])) for r in records[1] if r is not gone]
    report = rp.diagnose(records)
    assert kinds(report)[:2] == [("illegal_transition", [1]), ("decision_divergence", [1])], format_report(report)
    assert not [f for f in report.findings if f.kind == "lost_records"]


def test_the_lower_of_two_ranks_that_lost_a_transition_is_named():
    """Two ranks, rank 0 lost a plan_ready line: lost_records on rank 0, not a divergence blamed on rank 1."""
    records = SyntheticJob(world=2).run(45).records()
    records[0] = without(records[0], plan_of_step(19))
    report = rp.diagnose(records)
    assert kinds(report) == [("lost_records", [0])], format_report(report)


def test_two_of_three_ranks_that_lost_the_same_transition_do_not_blame_the_third():
    """Ranks 1 and 2 both lost plan_ready's line of step 9: one lost_records naming both, rank 0 is no culprit."""
    records = SyntheticJob(world=3).run(45).records()
    for r in (1, 2):
        records[r] = without(records[r], plan_of_step(9))
    report = rp.diagnose(records)
    assert kinds(report) == [("lost_records", [1, 2])], format_report(report)
    assert "rank 1's trace lost 1 record(s) here" in report.summary and "rank 2's trace lost" in report.summary


@pytest.mark.parametrize("compact", [False, True], ids=["step-records", "steps-runs"])
def test_a_whole_rearrangement_lost_is_lost_records_not_a_step_divergence(compact):
    """Every record rank 1 wrote at step 29 but its steps is lost (planning and back): its later state changes are
    shifted, the walk sees nothing wrong; lost_records, not a step_divergence on rank 1."""
    records = SyntheticJob(world=4, compact_steps=compact).run(45).records()
    records[1] = without(records[1], lambda r: r["step"] == 29 and r["event"] not in ("step", "steps"))
    report = rp.diagnose(records)
    assert kinds(report) == [("lost_records", [1])], format_report(report)
    assert report.findings[0].details == ["read as it stands: step_divergence, culprit rank 1"]


def test_lost_state_changes_and_collectives_are_one_lost_records():
    """Rank 1 lost plan_ready and the collectives after it (one stretch): told once, by the order of state changes."""
    records = SyntheticJob(world=4).run(45).records()
    records[1] = without(records[1], lambda r: 14 <= r["seq"] <= 18)
    report = rp.diagnose(records)
    assert kinds(report) == [("lost_records", [1])], format_report(report)
    assert "seq 14..18" in report.summary and "state change #1" in report.summary


def test_a_real_divergence_on_another_rank_is_still_found_after_lost_records():
    """Rank 1 lost plan_ready at step 9; rank 2 skips a step later: its step_divergence is still the verdict."""
    records = SyntheticJob(world=4).run(45, Faults(skip_count={2: 25})).records()
    records[1] = without(records[1], plan_of_step(9))
    report = rp.diagnose(records)
    assert (report.verdict, report.culprit_ranks) == ("step_divergence", [2]), format_report(report)
    assert [k for k in kinds(report) if k[0] == "lost_records"] == [("lost_records", [1])]
    assert not [f for f in report.findings if f.kind in ("illegal_transition", "decision_divergence")]


@pytest.mark.parametrize("compact", [False, True], ids=["step-records", "steps-runs"])
def test_a_removed_segment_that_held_state_changes_is_lost_records(tmp_path, monkeypatch, compact):
    """Rank 1's rotated trace loses middle segments that held transitions: lost_records on rank 1 each time, never
    an illegal transition or a divergence."""
    import eplb_fsm.testing.ranks as ranks_mod

    monkeypatch.setattr(ranks_mod, "EventTrace", lambda rank, **kw: EventTrace(
        rank=rank, max_bytes=3000, max_segments=100, **kw))
    job = SyntheticJob(world=3, trace_dir=tmp_path, keep=False, compact_steps=compact)
    job.run(100)
    job.close()
    assert rp.replay_dir(tmp_path).verdict == "healthy"
    for n in (3, 5, 7):
        seg = tmp_path / f"rank00001.jsonl.{n}"
        held = seg.read_bytes()
        assert b'"event":"transition"' in held
        seg.unlink()
        report = rp.replay_dir(tmp_path)
        assert kinds(report) == [("lost_records", [1])], (n, format_report(report))
        assert report.illegal_transitions == [] and "rank 1's trace lost " in report.summary
        seg.write_bytes(held)
