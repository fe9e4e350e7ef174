"""A session's own step numbers (``stepseq``): a skipped or reused number breaks them and decides a tie."""

from __future__ import annotations

import json

import pytest

from eplb_fsm.inspect import summary as sm
from eplb_fsm.inspect.model import Transition
from eplb_fsm.inspect.replay import diagnose, load_dir, replay_dir
from eplb_fsm.inspect.stepseq import StepSeq, own_steps_broken, step_break_text
from eplb_fsm.testing import Faults, SyntheticJob
from eplb_fsm.trace import EventTrace

T0 = 1_700_000_000.0
SKIP = list(range(50)) + list(range(51, 101))    # 100 engine steps, numbered 0..49 then 51..100
BACK = list(range(61)) + list(range(55, 94))     # 100 engine steps, the counter set back from 60 to 55


def write_ranks(tmp_path, numbers: dict[int, list[int]], flush_each: bool = False) -> None:
    """Ranks written by the real EventTrace, each counting steps with its own numbers, closed in order."""
    for rank, steps in numbers.items():
        now = [T0]
        trace = EventTrace(rank, len(numbers), tmp_path, clock=lambda: now[0])
        trace.set_context(state="collecting", step=0)
        trace.header({"num_layers": 2}, run_id="run-s")
        for step in steps:
            now[0] += 0.01
            trace.set_context(step=step)
            trace.count_step()
            if flush_each:
                trace.flush()     # every step its own `step` line (the classic layout)
        trace.end("closed")
        trace.close()


@pytest.mark.parametrize("flush_each", [False, True], ids=["steps-runs", "step-lines"])
def test_of_two_ranks_the_one_whose_step_numbers_skip_is_the_culprit(tmp_path, flush_each):
    """Rank 1's steps jump 49 -> 51 (same count as rank 0): the tie goes against rank 1, not the lower rank 0."""
    write_ranks(tmp_path, {0: list(range(100)), 1: SKIP}, flush_each)
    report = replay_dir(tmp_path)
    assert (report.verdict, report.culprit_ranks, report.step) == ("step_count_mismatch", [1], 100)
    assert any(d.startswith("rank 1: its own step numbers skip") for d in report.findings[0].details), report.summary


def test_the_skip_is_found_in_records_given_in_memory(tmp_path):
    """The same traces read as records (the per-record path, not the file reader) name rank 1 too."""
    write_ranks(tmp_path, {0: list(range(100)), 1: SKIP}, flush_each=True)
    records = {r: sm.read_records(p)[0] for r, p in sm.find_trace_files(tmp_path).items()}
    report = diagnose(records)
    assert (report.verdict, report.culprit_ranks) == ("step_count_mismatch", [1])


def test_a_counter_set_back_is_still_the_culprit(tmp_path):
    """Rank 1's steps go back from 60 to 55 and end lower: it stays the culprit, with its own numbers as evidence."""
    write_ranks(tmp_path, {0: list(range(100)), 1: BACK})
    report = replay_dir(tmp_path)
    assert (report.verdict, report.culprit_ranks, report.step) == ("step_count_mismatch", [1], 93)
    assert "go back: step 55 where step 61 was due" in report.findings[0].details[0]


def test_a_rank_that_counted_fewer_steps_is_still_the_lower_one(tmp_path):
    """Both numberings run on by one and rank 1 counted one step fewer: no break, the lower final step is odd."""
    write_ranks(tmp_path, {0: list(range(100)), 1: list(range(99))})
    report = replay_dir(tmp_path)
    assert (report.verdict, report.culprit_ranks, report.findings[0].details) == ("step_count_mismatch", [1], [])


@pytest.mark.parametrize("compact", [False, True], ids=["per-step", "compact"])
def test_intact_traces_have_no_break(tmp_path, compact):
    """Rearrangements (due step transitions) and a transfer fault leave every numbering whole, in files or records."""
    job = SyntheticJob(world=3, trace_dir=tmp_path, compact_steps=compact, interval=7)
    job.run(60, Faults(transfer_error={1: (13, 0)}))
    job.close()
    from_files = load_dir(tmp_path).summaries.values()
    from_records = [sm.summarize_rank(recs, r) for r, recs in job.records().items()]
    assert [s.step_breaks for s in [*from_files, *from_records]] == [[]] * 6


def step_lines(skip_at: int | None) -> str:
    """A rank that all-reduces every step (the bulk reader's stretches), optionally skipping one step number."""
    lines, seq, number = [], 0, 0

    def emit(event: str, **fields) -> None:
        nonlocal seq
        rec = {"ts": round(T0 + seq * 0.01, 6), "rank": 0, "world": 1, "event": event, "state": "collecting",
               "step": number, "seq": seq, **fields}
        lines.append(json.dumps(rec, separators=(",", ":")))
        seq += 1

    emit("header", schema=1, run_id="r", mode="sync", config={"num_layers": 2})
    for i in range(2400):
        number = i + 1 if skip_at is not None and i >= skip_at else i
        emit("step")
        coll = {"op": "all_reduce", "group": "ep", "cseq": i, "shape": [8], "dtype": "torch.float64"}
        emit("collective_start", **coll)
        emit("collective_end", duration_s=0.0001, **coll)
    emit("end", how="closed")
    return "\n".join(lines) + "\n"


def test_a_skip_inside_a_bulk_stretch_is_found():
    """A jump inside the stretches the bulk reader takes whole is a break; the same file without it is none."""
    assert sm.summarize_text(step_lines(None), 0).step_breaks == []
    breaks = sm.summarize_text(step_lines(1500), 0).step_breaks
    assert [(b["step"], b["expected"]) for b in breaks] == [(1501, 1500)]


def seq_with(runs: list[tuple[int, int]], transitions: list[Transition] | None = None) -> StepSeq:
    """A StepSeq told ``runs`` of (first step, count) in order, after ``transitions``."""
    seq, counted = StepSeq([]), 0
    for first, count in runs:
        seq.run(first, first + count - 1, count, counted, transitions or [])
        counted += count
    return seq


def test_runs_that_follow_on_are_no_break():
    """Runs 0-9, 10-14, 15: the numbers go on by one per counted step."""
    assert seq_with([(0, 10), (10, 5), (15, 1)]).breaks == []


def test_a_skipped_and_a_reused_number_are_breaks():
    """A run starting one number late is a skip, one starting earlier than due goes back."""
    assert seq_with([(0, 10), (11, 5)]).breaks == [{"after": 9, "step": 11, "expected": 10, "within": False}]
    assert seq_with([(0, 10), (8, 5)]).breaks == [{"after": 9, "step": 8, "expected": 10, "within": False}]


def test_a_step_transition_may_take_a_number_of_its_own():
    """A due step transition is an engine step (one number more); a forced one is not (no number more)."""
    step = [Transition(10, "step", "collecting", "planning", 0, 11)]
    due, forced = StepSeq([]), StepSeq([])
    due.run(0, 9, 10, 0, [])
    due.run(11, 20, 10, 10, step)          # step 10 was the transition
    forced.run(0, 9, 10, 0, [])
    forced.run(10, 19, 10, 10, step)       # rearrange() wrote it with the next step's number
    assert due.breaks == [] and forced.breaks == []


def test_a_stretch_whose_last_number_does_not_fit_its_count_broke_inside():
    """Lines read in bulk: 100 step records from step 0 to step 100 skipped a number somewhere inside."""
    seq = StepSeq([])
    seq.run(0, 100, 100, 0, [])
    assert seq.breaks == [{"after": 0, "step": 100, "expected": 99, "within": True}]


def test_breaks_in_a_trace_that_lost_lines_are_no_evidence():
    """A session whose trace lost lines (or holds lines out of order) breaks by that: not its own numbering."""
    s = sm.RankSummary(rank=1, step_breaks=[{"after": 49, "step": 51, "expected": 50, "within": False}])
    assert own_steps_broken(s) and "skip: step 51 where step 50 was due (after step 49)" in step_break_text(s)
    s.gaps.append({"first": 10, "last": 12, "lost": 3})
    assert not own_steps_broken(s) and step_break_text(s) is None
