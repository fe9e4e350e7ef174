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
