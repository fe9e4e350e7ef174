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


def repeated_layer_done(lose_alive: bool) -> dict[int, list[dict]]:
    """Rank 0 reports step 19's layer-0 layer_done a second time after layer 1 began (a genuine bug), with an
    ``alive`` line just before the repeat; ``lose_alive``: that one line is lost (a seq gap of 1, same step)."""
    records = SyntheticJob(world=3, num_layers=3).run(45).records()
    r0 = records[0]
    i0 = next(i for i, r in enumerate(r0) if r.get("trigger") == "layer_done" and r["step"] == 19 and r["layer"] == 0)
    i1 = next(i for i, r in enumerate(r0) if r.get("trigger") == "layer_done" and r["step"] == 19 and r["layer"] == 1)
    dup = dict(r0[i0], ts=r0[i1]["ts"] - 0.001)
    alive = {"ts": dup["ts"] - 0.001, "rank": 0, "world": 3, "event": "alive", "state": "transferring", "step": 19,
             "interval_s": 1.0, "steps_seen": 19, "waiting_on": None}
    new = r0[:i1] + [alive, dup] + r0[i1:]
    for n, rec in enumerate(new):
        rec["seq"] = n
    records[0] = [rec for rec in new if not (lose_alive and rec is alive)]
    return records


def test_one_lost_line_does_not_excuse_a_repeated_layer_done():
    """One lost alive line before rank 0's repeated layer_done(layer 0) cannot hold the state changes back into
    transferring at layer 0: illegal_transition, rank 0, as without the gap (was: lost_records, rank 0)."""
    for lose in (False, True):
        report = diagnose(repeated_layer_done(lose))
        assert kinds(report)[0] == ("illegal_transition", [0]), format_report(report)
        assert "not allowed in state 'transferring' (layer 1) with {'layer': 0}" in \
            report.illegal_transitions[0]["reason"]
        assert not [f for f in report.findings if f.kind == "lost_records"]


def lone_extra_rearrangement(lose_steps: bool) -> dict[int, list[dict]]:
    """Rank 0 alone runs a rearrangement at step 19 (ranks 1-2's step 19 is a quiet step: their records from
    step 9's commit to step 29's due step are one ``steps`` run); ``lose_steps``: ranks 1-2 each lost that one
    line (steps 10..28)."""
    records = SyntheticJob(world=3, compact_steps=True).run(45).records()
    for r in (1, 2):
        rs = records[r]
        a, b = seq_of(rs, 9, "committed"), seq_of(rs, 29, "step")
        middle = [x for x in rs if a < x["seq"] < b]
        runs = [x for x in middle if x["event"] == "steps"]
        dropped = [x for x in middle if x["step"] == 19 or x["event"] == "steps"]
        merged = dict(runs[0], count=sum(x["count"] for x in runs) + 1)
        gone: dict[str, set] = {}
        for x in dropped:
            if x["event"] == "collective_start":
                gone.setdefault(x["group"], set()).add(x["cseq"])
        new = ([x for x in rs if x["seq"] <= a] + [x for x in middle if x not in dropped] + [merged]
               + [x for x in rs if x["seq"] >= b])
        for n, x in enumerate(new):
            x["seq"] = n
            if x.get("cseq") is not None and x.get("group") in gone and x["step"] > 19:
                x["cseq"] -= sum(1 for c in gone[x["group"]] if c < x["cseq"])
        records[r] = [x for x in new if not (lose_steps and x is merged)]
    return records


def test_one_lost_steps_line_cannot_hold_the_rearrangement_a_lone_rank_shows():
    """Ranks 1-2 each lost one steps line over steps 10..28, where rank 0 alone rearranged at step 19: one line
    cannot hold that rearrangement's state changes, so rank 0 stays the step_divergence culprit (was:
    lost_records, ranks 1-2)."""
    for lose in (False, True):
        report = diagnose(lone_extra_rearrangement(lose))
        assert (report.verdict, report.culprit_ranks) == ("step_divergence", [0]), format_report(report)
        assert not [f for f in report.findings if f.kind == "lost_records"]
