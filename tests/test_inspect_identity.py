"""Which files make one run: a run picked inside a file other runs appended to, unreadable files told apart."""

from __future__ import annotations

import json

from eplb_fsm.inspect.findings import Finding, Report
from eplb_fsm.inspect.identity import mark_unreadable, run_text


def line(event: str, seq: int, **fields) -> str:
    return json.dumps({"event": event, "seq": seq, **fields}, separators=(",", ":")) + "\n"


def test_run_text_keeps_the_chosen_run_of_a_file_appended_to():
    """A file holding run a then run b: either run's lines come back alone; an unknown id keeps the whole text."""
    a = line("header", 0, run_id="a") + line("step", 1)
    b = line("header", 0, run_id="b") + line("step", 1) + line("step", 2)
    assert run_text(a + b, "a") == a
    assert run_text(a + b, "b") == b
    assert run_text(a + b, "c") == a + b
    assert run_text(a, "c") == a


def test_run_text_keeps_joiner_and_rotated_headers_with_their_run():
    """A joiner's header and a rotated segment's `continued` header go on the run before them; a new run splits."""
    a = (line("header", 0, run_id="a") + line("step", 1) + line("header", 2, run_id="a", continued=True)
         + line("step", 3) + line("header", 0, run_id="a", role="joiner") + line("step", 1))
    b = line("header", 0, run_id="b") + line("step", 1)
    assert run_text(a + b, "a") == a
    assert run_text(a + b, "b") == b


def test_mark_unreadable_names_the_unreadable_file_where_the_report_said_no_trace():
    """A missing rank whose file could not be read: its position, details and summary say why, not 'no trace file'."""
    pos = {"rank": 1, "session": 0, "status": "no_trace", "note": "no trace file"}
    missing = Finding.of("missing_ranks", None, [(1, 0)], "no trace for rank 1 of a world of 2", ranks=[pos],
                         details=["rank 1: no trace file"])
    report = Report("missing_ranks", missing.summary, [1], None, None, None, None, missing.ranks, [missing], [], [],
                    [], 2, [1])
    mark_unreadable(report, {1: "cannot read rank00001.jsonl: Permission denied"})
    assert report.at_divergence[0]["note"] == "unreadable file: cannot read rank00001.jsonl: Permission denied"
    assert missing.details == ["rank 1: unreadable file: cannot read rank00001.jsonl: Permission denied"]
    assert report.summary.endswith("; rank 1's file is unreadable: cannot read rank00001.jsonl: Permission denied")


def test_the_two_runs_error_lists_every_file_holding_a_run(tmp_path):
    """Run a (ranks 0-1 and a joiner's file) then run b appended to ranks 0-1: the error lists rank files 0-1 under
    both runs (was: run a owned only the joiner's file, though files 0-1 hold its sessions too)."""
    import pytest

    from eplb_fsm.inspect.identity import MixedRuns
    from eplb_fsm.inspect.replay import replay_dir

    def run(rid: str, rank: int, role: str | None = None) -> str:
        head = {"run_id": rid, "rank": rank, "world": 2, "ts": 1.0, "step": 0, "schema": 1, "state": "collecting"}
        return line("header", 0, **head, **({"role": role} if role else {})) + line("step", 1, ts=1.1, step=1)

    for r in (0, 1):
        (tmp_path / f"rank{r:05d}.jsonl").write_text(run("a", r) + run("b", r))
    (tmp_path / "rank00002.g1.jsonl").write_text(run("a", 2, "joiner"))
    with pytest.raises(MixedRuns) as info:
        replay_dir(str(tmp_path))
    said = str(info.value)
    assert "run a: rank files 0-2 (rank00000.jsonl, rank00001.jsonl, rank00002.g1.jsonl)" in said, said
    assert "run b: rank files 0-1 (rank00000.jsonl, rank00001.jsonl)" in said, said
