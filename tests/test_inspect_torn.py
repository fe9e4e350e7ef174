"""Traces whose writing stopped for good (full disk, file-size limit): every rank's file ends in a half-written line.

A real healthy run under ``ulimit -f`` (or on a disk that stayed full) left every rank's trace cut mid-line,
with no ``end`` record, while the engine served on and exited 0. Replay read the cut as a ``hang`` with every
rank "still inside" a transfer (or, cut elsewhere, as ``healthy`` with no word about it). These build the same
files from a synthetic job: each rank's records up to a point, then the first bytes of its next record.
"""

from __future__ import annotations

from pathlib import Path

from eplb_fsm.inspect.render import format_report
from eplb_fsm.inspect.replay import replay_dir
from eplb_fsm.testing import SyntheticJob, write_traces
from eplb_fsm.trace_fields import encode_record

CUT_HINT = "every rank's trace stops in a half-written last line with no end record"


def coll_seq(records: list[dict], event: str, group: str, step: int, layer: int) -> int:
    """The seq of ``event`` (collective_start/_end) of ``group``'s collective at ``step`` for ``layer``."""
    return next(r["seq"] for r in records if r["event"] == event and r.get("group") == group and r["step"] == step
                and r.get("layer") == layer)


def write_cut(tmp_path: Path, cut: dict[int, int], torn: tuple[int, ...] = (0, 1, 2),
              extra: dict[int, list[dict]] | None = None) -> Path:
    """A 3-rank job's traces, rank r's kept up to seq ``cut[r]`` (then ``extra[r]``), and for the ``torn`` ranks
    the first 40 bytes of the record after it, with no newline (a write cut short)."""
    records = SyntheticJob(world=3).run(45).records()
    kept = {r: [rec for rec in recs if rec["seq"] <= cut[r]] + (extra or {}).get(r, []) for r, recs in records.items()}
    paths = write_traces(kept, tmp_path)
    for r in torn:
        nxt = next(rec for rec in records[r] if rec["seq"] == cut[r] + 1)
        with open(paths[r], "a", encoding="utf-8") as fh:
            fh.write(encode_record(nxt)[:40])
    return tmp_path


def starts(tmp_path: Path) -> dict[int, int]:
    """Every rank's seq of the layer-1 transfer's collective_start at step 19."""
    records = SyntheticJob(world=3).run(45).records()
    return {r: coll_seq(recs, "collective_start", "ep_transfer", 19, 1) for r, recs in records.items()}


def test_every_rank_cut_inside_a_transfer_is_lost_records_not_a_hang(tmp_path):
    """Every trace ends after the transfer's start, in a torn line: lost_records on ranks 0-2, read as it stands a
    hang (was: hang, 'every rank that joined batch_isend_irecv ... is still inside it')."""
    report = replay_dir(write_cut(tmp_path, starts(tmp_path)))
    assert (report.verdict, report.culprit_ranks) == ("lost_records", [0, 1, 2]), format_report(report)
    assert "is still inside it; but " + CUT_HINT in report.summary
    assert "(a full disk? a file-size limit?)" in report.summary
    assert report.findings[0].details[0] == "read as it stands: hang, culprit ranks 0-2"
    assert any(w.startswith(CUT_HINT) for w in report.warnings)


def test_a_rank_cut_before_the_start_the_others_wrote_is_not_the_hang_s_culprit(tmp_path):
    """Rank 0's trace is cut just before the transfer's start, ranks 1-2 after it: lost_records on ranks 0-2
    (was: hang, rank 0 'never joined')."""
    cut = starts(tmp_path)
    cut[0] -= 1
    report = replay_dir(write_cut(tmp_path, cut))
    assert (report.verdict, report.culprit_ranks) == ("lost_records", [0, 1, 2]), format_report(report)
    assert report.findings[0].details[0] == "read as it stands: hang, culprit rank 0"


def test_traces_cut_where_nothing_is_open_are_healthy_with_the_cut_told(tmp_path):
    """Every trace cut after the transfer's end: healthy (the ranks agree as far as they go), with a warning and
    the closing line saying the writers stopped (was: healthy, no word of it but 'truncated')."""
    records = SyntheticJob(world=3).run(45).records()
    cut = {r: coll_seq(recs, "collective_end", "ep_transfer", 19, 1) for r, recs in records.items()}
    report = replay_dir(write_cut(tmp_path, cut))
    assert report.verdict == "healthy", format_report(report)
    assert any(w.startswith(CUT_HINT) for w in report.warnings)
    assert "no end record on ranks 0-2: each trace ends in a half-written line" in format_report(report)


def test_one_whole_last_line_keeps_the_hang(tmp_path):
    """Rank 2's last line is whole (only ranks 0-1 torn): nothing says the writing stopped, the hang stands."""
    report = replay_dir(write_cut(tmp_path, starts(tmp_path), torn=(0, 1)))
    assert (report.verdict, report.culprit_ranks) == ("hang", [0, 1, 2]), format_report(report)
    assert not any(w.startswith(CUT_HINT) for w in report.warnings)


def test_a_wait_the_alive_records_wrote_down_keeps_the_hang(tmp_path):
    """Ranks 1-2 wrote alive records naming the transfer they wait in before their lines were cut: their wait is
    on record, so the hang on rank 0 (cut before it) stands, with the cut warned."""
    cut = starts(tmp_path)
    cut[0] -= 1
    records = SyntheticJob(world=3).run(45).records()
    extra = {}
    for r in (1, 2):
        start = next(rec for rec in records[r] if rec["seq"] == cut[r])
        extra[r] = [dict(start, event="alive", seq=cut[r] + 1 + i, ts=start["ts"] + 1.0 + i, interval_s=1.0,
                         steps_seen=start["step"], waiting_on={"op": "batch_isend_irecv", "group": "ep_transfer",
                                                               "cseq": start["cseq"]})
                    for i in range(2)]
    for rec in (e for v in extra.values() for e in v):
        for key in ("op", "group", "cseq", "shape", "dtype", "layer", "wave", "waves", "parts", "peers", "sends",
                    "recvs", "nbytes"):
            rec.pop(key, None)
    report = replay_dir(write_cut(tmp_path, cut, extra=extra))
    assert (report.verdict, report.culprit_ranks) == ("hang", [0]), format_report(report)
    assert any(w.startswith(CUT_HINT) for w in report.warnings)
