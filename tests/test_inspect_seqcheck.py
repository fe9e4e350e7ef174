"""A rank's seq counter (``SeqCheck``): lost lines, foreign lines, records out of order, swaps."""

from __future__ import annotations

import json

from eplb_fsm.inspect.replay import replay_dir
from eplb_fsm.inspect.seqcheck import MAX_GAPS, SeqCheck
from eplb_fsm.testing import SyntheticJob


def feed(seqs: list, steps_after: dict[int, int] | None = None) -> SeqCheck:
    """A SeqCheck told ``seqs`` as records read one by one; ``steps_after[i]``: steps counted after the i-th."""
    check, n_steps = SeqCheck(), 0
    for i, seq in enumerate(seqs):
        check.check(seq, n_steps, lambda i=i: (f"rank00000.jsonl:{i + 1}", i + 1), "alive")
        n_steps += (steps_after or {}).get(i, 0)
    return check


def test_lost_lines_are_counted_from_where_they_went_missing():
    """A jump forward that the next records go on from is lost lines, counted with the seqs either side."""
    check = feed([18, 19, 23, 24, 25])
    assert (check.lost, check.odd, check.disorder) == (3, 0, [])
    assert check.warnings() == ["3 record(s) missing by seq (lost lines), the first between seq 19 and seq 23"]


def test_one_record_with_a_foreign_seq_is_a_warning_not_disorder():
    """An inserted line (the next record goes on from before it) and a mislabelled one are foreign lines."""
    inserted = feed([18, 19, 57, 20, 21, 22])
    mislabelled = feed([18, 19, 57, 21, 22])
    for check in (inserted, mislabelled):
        assert (check.lost, check.odd, check.disorder) == (0, 1, [])
        assert check.warnings() == ["1 record(s) carry a seq outside the rank's sequence (foreign lines?)"]


def test_two_swapped_records_are_disorder_at_the_one_that_went_back():
    """Seqs 19, 21, 20, 22: one swap, reported where seq 20 stands, not a lost line and a foreign one."""
    check = feed([18, 19, 21, 20, 22, 23])
    assert (check.lost, check.odd) == (0, 0) and check.warnings() == []
    assert [(d["seq"], d["expected"], d["line"]) for d in check.disorder] == [(20, 22, 4)]


def test_a_swap_next_to_lost_lines_keeps_the_loss():
    """Seqs 19, 23, 20, 24: seq 20 came late (disorder there) and 21-22 are lost."""
    check = feed([18, 19, 23, 20, 24])
    assert [d["seq"] for d in check.disorder] == [20] and (check.lost, check.odd) == (2, 0)
    assert check.warnings() == ["2 record(s) missing by seq (lost lines), the first between seq 19 and seq 23"]


def test_the_last_two_records_swapped_are_disorder():
    """Nothing follows the record that went back: one seq ahead then back is the last two lines swapped."""
    check = feed([18, 19, 21, 20])
    assert check.warnings() == [] and [d["seq"] for d in check.disorder] == [20]


def test_a_step_swapped_with_the_record_before_it_is_disorder():
    """A step record that went back after a jump is read for its seq: disorder at the step, nothing lost."""
    check = SeqCheck()
    locate = lambda: ("rank00000.jsonl:3", 3)   # noqa: E731
    check.check(1, 0, locate, "model_added")
    check.check(3, 0, locate, "collective_start")   # seq 2 was due: the step with seq 2 comes after it
    check.check(2, 0, locate, "step", step=True)
    check.check(4, 1, locate, "collective_end")
    assert (check.lost, check.odd) == (0, 0)
    assert [(d["seq"], d["expected"], d["event"]) for d in check.disorder] == [(2, 4, "step")]


def test_a_step_after_an_inserted_line_stays_a_foreign_line():
    """A step carrying the seq due before a jump, then records going on from it: the jumped record was foreign."""
    check = SeqCheck()
    locate = lambda: ("rank00000.jsonl:3", 3)   # noqa: E731
    check.check(1, 0, locate, "model_added")
    check.check(40, 0, locate, "alive")
    check.check(2, 0, locate, "step", step=True)
    check.check(3, 1, locate, "alive")
    assert (check.lost, check.odd, check.disorder) == (0, 1, [])


def test_a_copied_line_is_disorder_and_loses_nothing():
    """An old line copied further down: disorder at the copy, and the records after it are not lost lines."""
    check = feed([18, 19, 20, 21, 12, 22, 23])
    assert (check.lost, check.odd, check.gaps) == (0, 0, [])
    assert [(d["seq"], d["expected"], d["line"]) for d in check.disorder] == [(12, 22, 5)]
    assert check.warnings() == []


def test_a_copied_step_line_takes_no_seq():
    """A copied step record (counted as a step) leaves the seq due to the next record as it was."""
    check, locate = SeqCheck(), (lambda: ("rank00000.jsonl:4", 4))
    check.check(5, 0, locate, "alive")
    check.check(6, 0, locate, "step", step=True)
    check.check(2, 1, locate, "step", step=True)   # a copy of an old step line
    check.check(7, 2, locate, "alive")
    assert (check.lost, check.odd, [d["seq"] for d in check.disorder]) == (0, 0, [2])


def test_a_line_written_late_fills_its_place_among_the_lost_lines():
    """Seq 20 jumped over, then read three records later: disorder there, and no line is lost."""
    check = feed([18, 19, 21, 22, 23, 20, 24])
    assert [d["seq"] for d in check.disorder] == [20]
    assert (check.lost, check.gaps, check.warnings()) == (0, [], [])


def test_every_adjacent_swap_of_a_real_trace_is_out_of_order(tmp_path):
    """Swapping any two adjacent records of a healthy trace never reads healthy or as a hang: out_of_order is found."""
    job = SyntheticJob(world=2, trace_dir=str(tmp_path / "src"), keep=False, interval=4)
    job.run(10)
    job.close()
    lines = (tmp_path / "src" / "rank00001.jsonl").read_text().splitlines()
    other = (tmp_path / "src" / "rank00000.jsonl").read_text()
    wrong = []
    for i in range(1, len(lines) - 1):
        swapped = lines[:i] + [lines[i + 1], lines[i]] + lines[i + 2:]
        work = tmp_path / f"swap{i}"
        work.mkdir()
        (work / "rank00000.jsonl").write_text(other)
        (work / "rank00001.jsonl").write_text("\n".join(swapped) + "\n")
        report = replay_dir(work)
        if report.verdict in ("healthy", "hang") or "out_of_order" not in [f.kind for f in report.findings]:
            wrong.append((i + 1, json.loads(lines[i])["event"], json.loads(lines[i + 1])["event"], report.verdict))
    assert wrong == []


def feed_around(seqs: list[int]) -> SeqCheck:
    """A SeqCheck told ``seqs``, record i written at step 10 * i and ts 100 + i."""
    check = SeqCheck()
    for i, seq in enumerate(seqs):
        before = (100.0 + i - 1, 10 * (i - 1), "collecting") if i else None
        check.check(seq, 0, lambda i=i: (f"rank00000.jsonl:{i + 1}", i + 1), "alive", (before, 10 * i, 100.0 + i))
    check.warnings()
    return check


def test_lost_lines_are_kept_as_a_gap_with_the_records_either_side():
    """Seqs 19, 23: the gap holds the seqs lost (20-22) and the step and ts of the records before and after."""
    assert feed_around([18, 19, 23, 24]).gaps == [{"first": 20, "last": 22, "lost": 3, "from_step": 10,
                                                   "from_ts": 101.0, "to_step": 20, "to_ts": 102.0}]


def test_a_foreign_line_or_a_swap_leaves_no_gap():
    """A jump taken back (an inserted line, a mislabelled one, two records swapped) is no stretch of lost lines."""
    for seqs in ([18, 19, 57, 20, 21], [18, 19, 57, 21, 22], [18, 19, 21, 20, 22], [18, 19, 21, 20]):
        assert feed_around(seqs).gaps == [], seqs


def test_a_swap_next_to_lost_lines_narrows_the_gap():
    """Seqs 19, 23, 20, 24: seq 20 came late, so only 21-22 are lost."""
    gap = feed_around([18, 19, 23, 20, 24]).gaps
    assert [(g["first"], g["last"], g["lost"]) for g in gap] == [(21, 22, 2)]


def test_past_max_gaps_the_last_gap_widens():
    """More stretches than MAX_GAPS: the last kept one grows to cover the rest, so no lost line goes untold."""
    check = feed_around([2 * i for i in range(MAX_GAPS + 11)])
    assert len(check.gaps) == MAX_GAPS and sum(g["lost"] for g in check.gaps) == check.lost == MAX_GAPS + 10
    assert (check.gaps[-1]["first"], check.gaps[-1]["last"]) == (2 * MAX_GAPS - 1, 2 * (MAX_GAPS + 10) - 1)


def test_a_copied_line_in_a_real_trace_is_out_of_order_not_lost_records(tmp_path):
    """Rank 1's first collective_start copied further down: out_of_order at the copy, no lost records, no hang."""
    job = SyntheticJob(world=2, trace_dir=str(tmp_path), keep=False)
    job.run(30)
    job.close()
    path = tmp_path / "rank00001.jsonl"
    lines = path.read_text().splitlines()
    src = next(i for i, line in enumerate(lines) if '"event":"collective_start"' in line)
    at = src + 20
    path.write_text("\n".join(lines[:at] + [lines[src]] + lines[at:]) + "\n")
    report = replay_dir(tmp_path)
    assert [(f.kind, f.culprits) for f in report.findings] == [("out_of_order", [1])], report.summary
    assert f"rank00001.jsonl:{at + 1}:" in report.summary
    assert not any("missing by seq" in w for w in report.warnings)
