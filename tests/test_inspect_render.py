"""Text forms of a replay: the report (verdict first, ranks grouped) and the per-rank timeline."""

from __future__ import annotations

import pytest

from eplb_fsm.inspect.render import format_report, format_timeline, timeline_rows
from eplb_fsm.inspect.replay import diagnose
from eplb_fsm.testing import Faults, SyntheticJob, hang_faults


def records(world=4, steps=40, faults=None):
    job = SyntheticJob(world=world)
    job.run(steps, faults)
    return job.records()


@pytest.fixture(scope="module")
def healthy():
    return records()


def test_healthy_report_is_short():
    """A healthy report of ranks that all wrote `end`: the verdict, 'illegal transitions: none', the traces line."""
    job = SyntheticJob(world=4)
    job.run(40)
    for rank in job.sessions:
        rank.trace.end("closed")
    report = diagnose(job.records())
    lines = format_report(report).splitlines()
    assert lines[0].startswith("healthy: 4 of 4 ranks agree")
    assert lines[1:] == ["  illegal transitions: none", "  traces: 4 of world 4, 396 records, last steps 39..39"]
    assert report.to_dict()["unended_ranks"] == []


def test_healthy_report_names_the_ranks_without_an_end_record():
    """Healthy traces that stop without `end` (running, or killed together) say so, naming those ranks."""
    job = SyntheticJob(world=4)
    job.run(40)
    lines = format_report(diagnose(job.records())).splitlines()
    assert lines[0].startswith("healthy") and lines[-1].startswith("  no end record on ranks 0-3: still running")
    assert diagnose(job.records()).to_dict()["unended_ranks"] == [0, 1, 2, 3]
    for rank in job.sessions[:3]:  # the others ended: the one without `end` is a culprit, not a note
        rank.trace.end("closed")
    assert format_report(diagnose(job.records())).startswith("rank_died: rank 3 died")


def test_problem_report_sections():
    """A hang report: verdict line, where, collective, and every rank's position."""
    text = format_report(diagnose(records(faults=hang_faults(4, culprit=2, step=19))))
    lines = text.splitlines()
    assert lines[0].startswith("hang: rank 2 never joined all_reduce")
    assert lines[1] == "  where:      step 19, state planning, layer -; culprit rank 2"
    assert lines[2] == "  collective: all_reduce group=ep cseq=4 shape=[32] dtype=torch.float64"
    assert lines[3] == "  ranks at this point:"
    assert lines[4].split()[0] == "0-1,3" and "inside since step 19" in lines[4]
    assert lines[5].split()[0] == "2" and "never joined" in lines[5]


def test_many_ranks_in_the_same_position_share_a_line():
    """64 ranks, one culprit: the rank positions fit on two lines."""
    text = format_report(diagnose(records(world=64, steps=20, faults=hang_faults(64, culprit=40, step=9))))
    block = text.split("ranks at this point:\n")[1].splitlines()
    assert block[0].split()[0] == "0-39,41-63"
    assert block[1].split()[0] == "40"
    assert "illegal transitions" in block[2]


def test_later_findings_illegal_list_and_warnings_are_listed():
    """Secondary findings, the illegal transitions and the warnings each get a section."""
    recs = records(faults=Faults(illegal={0: 9}))
    del recs[0][0]  # no header on rank 0: a warning
    text = format_report(diagnose(recs))
    assert "  later findings (" in text and "decision_divergence at step 9" in text
    assert "  illegal transitions (1):\n    rank 0 seq 19 step 9: committed transferring->collecting" in text
    assert "  warnings (1):\n    rank 0: no header record" in text


def test_timeline_has_one_line_per_record(healthy):
    """format_timeline prints a title, a column header and one line per record."""
    text = format_timeline(healthy[0], 0).splitlines()
    assert text[0] == f"rank 0: {len(healthy[0])} records"
    assert len(text) == len(healthy[0]) + 2
    line = next(t for t in text if "collective_end" in t and "ep_transfer#0" in t)
    assert line.split()[2] == "9"


def test_timeline_rows_are_compact(healthy):
    """Rows carry seq, relative time, step, state, what happened, layer, collective and duration."""
    rows = timeline_rows(healthy[0])
    assert rows[0]["t"] == 0.0 and rows[0]["what"] == "header"
    move = next(r for r in rows if r["what"].startswith("plan_ready"))
    assert move["what"] == "plan_ready: planning->transferring (moves=1 worth=True)"
    start = next(r for r in rows if r["what"] == "collective_start")
    assert start["collective"] == "all_reduce ep#0 [32]" and start["step"] == 9
    end = next(r for r in rows if r["what"] == "collective_end")
    assert end["duration_s"] is not None and end["duration_s"] >= 0
    stuck = timeline_rows([{"event": "stuck", "seconds": 5, "last_collective": {"op": "x"}}])[0]
    assert stuck["what"].startswith("stuck 5s") and stuck["t"] is None



def test_handled_faults_are_listed_in_a_healthy_report():
    """A transfer failure every rank aborted shows in its own section of a healthy report."""
    text = format_report(diagnose(records(faults=Faults(transfer_error={1: (19, 0)}))))
    assert text.splitlines()[0].startswith("healthy:")
    assert "  handled (every rank aborted that rearrangement with a fault) (1):" in text


def test_timeline_names_step_runs_and_continued_headers():
    """A `steps` run shows its first and last step, count and dummies; a continued header says it is one."""
    rows = timeline_rows([
        {"ts": 1.0, "event": "header", "continued": True, "segment": 2, "step": 40, "seq": 7, "state": "collecting"},
        {"ts": 2.0, "event": "steps", "step": 40, "count": 25, "dummy": 3, "seq": 8, "state": "collecting"},
    ])
    assert rows[0]["what"] == "header (continued: segment 2 of a rotated file)"
    assert rows[1]["what"] == "steps 40..64 (25, 3 dummy)" and rows[1]["t"] == 1.0


def test_a_duration_of_the_wrong_type_is_shown_not_a_crash():
    """A collective_end whose duration_s is a string (a damaged line) prints as it is; numbers keep 6 decimals."""
    job = SyntheticJob(world=1)
    job.run(10)
    recs = job.records()[0]
    ends = [r for r in recs if r["event"] == "collective_end"]
    ends[0]["duration_s"] = "slow"
    text = format_timeline(recs, 0)
    assert "'slow'" in text and f"{ends[1]['duration_s']:.6f}" in text


def test_traces_line_counts_files_against_the_largest_world():
    """2 -> 4: four rank files are 'traces: 4 of world 4', not 'of world 2' (the first generation's)."""
    job = SyntheticJob(world=2, num_layers=2, interval=10)
    job.run(15)
    job.scale(4)
    job.run(10)
    report = diagnose(job.records())
    assert report.verdict == "healthy", report.summary
    assert "  traces: 4 of world 4, " in format_report(report)
