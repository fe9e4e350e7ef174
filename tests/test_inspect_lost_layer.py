"""Lines lost across whole state changes that come back to the same state: lost_records, never a rank's fault.

Seen on a real healthy run whose trace folder was full for ~4 s (writes failed, then worked again; weights
bit-exact): one rank's lost lines ran from the middle of one rearrangement's ``transferring`` (layer 1) to
the middle of the next one's (layer 0), so the record after them agrees on the state but not the layer, and
was once an ``illegal_transition``; two ranks' lost lines held a whole rearrangement that the third rank's
trace kept, and the third rank was once the ``step_divergence`` culprit. Without a ``seq`` gap both stay what
they were.
"""

from __future__ import annotations

from eplb_fsm.inspect import Faults
from eplb_fsm.inspect.render import format_report
from eplb_fsm.inspect.replay import diagnose
from eplb_fsm.testing import SyntheticJob


def kinds(report) -> list[tuple[str, list[int]]]:
    return [(f.kind, f.culprits) for f in report.findings]


def seq_of(records: list[dict], step: int, trigger: str, layer: int | None = None) -> int:
    """The seq of the ``trigger`` transition at ``step`` (of ``layer``)."""
    return next(r["seq"] for r in records if r.get("trigger") == trigger and r["step"] == step
                and (layer is None or r.get("layer") == layer))


def across_two_rearrangements() -> dict[int, list[dict]]:
    """Rank 0 loses its lines from after step 9's layer-0 layer_done to before step 19's (seq gap): the record
    after them is transferring -> transferring at layer 0, where the walk stood at layer 1."""
    records = SyntheticJob(world=3).run(45).records()
    a, b = seq_of(records[0], 9, "layer_done", 0), seq_of(records[0], 19, "layer_done", 0)
    records[0] = [r for r in records[0] if not a < r["seq"] < b]
    return records


def test_lines_lost_from_one_rearrangement_into_the_next_are_lost_records_not_illegal():
    """Rank 0's record after the gap agrees on transferring but not on the layer: lost_records on rank 0, no
    illegal transition (was: illegal_transition, rank 0, 'event layer_done is not allowed ... (layer 1)')."""
    report = diagnose(across_two_rearrangements())
    assert report.illegal_transitions == [], format_report(report)
    assert kinds(report) == [("lost_records", [0])], format_report(report)
    assert "rank 0's trace lost" in report.summary
    assert "rank 0's lost lines held its state change(s) from transferring to transferring" in \
        report.findings[0].details
    assert any("lines lost before 1 record(s) held state changes" in w for w in report.warnings)


def test_the_same_layer_mismatch_without_lost_lines_is_still_illegal():
    """The same records with the seq renumbered (never written, no gap): the decision_divergence and the
    illegal_transition on rank 0 as before, no lost_records."""
    records = across_two_rearrangements()
    for n, rec in enumerate(records[0]):
        rec["seq"] = n
    report = diagnose(records)
    assert (report.verdict, report.culprit_ranks) == ("decision_divergence", [0]), format_report(report)
    assert ("illegal_transition", [0]) in kinds(report)
    assert not [f for f in report.findings if f.kind == "lost_records"]
    assert "not allowed in state 'transferring' (layer 1)" in report.illegal_transitions[0]["reason"]


def lost_rearrangement(ranks: tuple[int, ...], compact: bool = True) -> dict[int, list[dict]]:
    """``ranks`` lose every line from step 9's commit to step 29's due step (step 19's whole rearrangement)."""
    records = SyntheticJob(world=3, compact_steps=compact).run(45).records()
    for r in ranks:
        a, b = seq_of(records[r], 9, "committed"), seq_of(records[r], 29, "step")
        records[r] = [rec for rec in records[r] if not a < rec["seq"] < b]
    return records


def test_two_of_three_ranks_that_lost_a_whole_rearrangement_do_not_blame_the_third():
    """Ranks 1-2 lost step 19's rearrangement, rank 0 kept it: lost_records on ranks 1-2 (was: step_divergence,
    rank 0: 'ranks 1-2 at step 29, rank 0 at step 19')."""
    report = diagnose(lost_rearrangement((1, 2)))
    assert kinds(report)[0] == ("lost_records", [1, 2]), format_report(report)
    assert report.findings[0].details[0] == "read as it stands: step_divergence, culprit rank 0"
    assert not [f for f in report.findings if f.kind in ("step_divergence", "decision_divergence")]


def test_a_lone_rank_that_skipped_a_step_is_still_the_culprit_against_ranks_with_whole_traces():
    """Rank 0 skips a step (no lost lines anywhere): step_divergence on rank 0, as before."""
    records = SyntheticJob(world=3).run(45, Faults(skip_count={0: 12})).records()
    report = diagnose(records)
    assert (report.verdict, report.culprit_ranks) == ("step_divergence", [0]), format_report(report)
