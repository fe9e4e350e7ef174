"""Tests for eplb_fsm.commands.simulate_report: the text of ``eplb-fsm simulate``'s report."""

from __future__ import annotations


def test_scale_lines_name_what_happened():
    """A same-size scale says the group already had that size; a switched one prints from -> to (no 'None')."""
    from eplb_fsm.commands.simulate_report import _format_scalings

    report = {"config": {"ranks": 4}, "scalings": [
        {"step": 50, "requested_ranks": 4, "outcome": "skipped", "from_ranks": None, "to_ranks": None},
        {"step": 100, "requested_ranks": 2, "outcome": "switched", "from_ranks": 4, "to_ranks": 2,
         "moved_slots": 12, "seconds": 0.5},
        {"step": 150, "requested_ranks": 2, "outcome": "skipped", "from_ranks": None, "to_ranks": None},
        {"step": 390, "requested_ranks": 4, "outcome": "not_reached", "from_ranks": None, "to_ranks": None},
    ]}
    lines = _format_scalings(report)
    assert lines[0] == "scale at step 50 to 4 ranks: skipped (the group already has 4 ranks)"
    assert lines[1].startswith("scale at step 100: 4 -> 2 ranks: switched")
    assert lines[2] == "scale at step 150 to 2 ranks: skipped (the group already has 2 ranks)"
    assert "not_reached (the run ended before this step)" in lines[3]
    assert not any("None" in line for line in lines)


def _failed_report(culprits):
    return {
        "failed": True, "error": "rank_failed", "failed_ranks": [0], "log_dir": "/tmp/t", "wall_s": 1.0,
        "inject": ["kill:rank=1,step=10"],
        "config": {"ranks": 2, "layers": 3, "experts": 8, "redundant": 4, "steps": 24, "interval": 8, "window": 8,
                   "mode": "sync", "load": "zipf"},
        "ranks": [{"rank": 0, "status": "failed", "last_step": 9, "last_state": "collecting", "last_event": "end",
                   "reason": "RuntimeError: Connection reset by peer"},
                  {"rank": 1, "status": "died", "last_step": 9, "last_state": "collecting",
                   "last_event": "fault_injected", "reason": "process exited with code -9"}],
        "replay": {"verdict": "hang", "summary": "rank 1 never joined all_reduce at step 10",
                   "culprit_ranks": culprits},
    }


def test_a_failed_run_leads_with_the_culprit_not_the_victims():
    """The failure headline names the rank replay blames; the ranks that merely stopped come after it."""
    from eplb_fsm.commands.simulate_report import format_report

    lines = format_report(_failed_report([1])).splitlines()
    headline = next(i for i, line in enumerate(lines) if line.startswith("the run failed"))
    assert lines[headline] == "the run failed: caused by rank(s) 1: hang: rank 1 never joined all_reduce at step 10"
    assert lines[headline + 1] == "ranks that stopped: 0"
    assert not any(line.startswith("replay:") for line in lines)  # said once, in the headline


def test_a_failed_run_without_a_culprit_lists_the_failed_ranks():
    """When replay names nobody, the headline lists the failed ranks and the replay line still ends the report."""
    from eplb_fsm.commands.simulate_report import format_report

    lines = format_report(_failed_report([])).splitlines()
    assert "the run failed: rank(s) 0" in lines
    assert lines[-1] == "replay: hang: rank 1 never joined all_reduce at step 10"
