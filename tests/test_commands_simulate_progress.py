"""Tests for eplb_fsm.commands.simulate_progress: the live progress line of ``eplb-fsm simulate``."""

from __future__ import annotations


def test_progress_redraws_on_a_terminal_and_writes_lines_to_a_log():
    """The progress line uses \\r redraws on a terminal and plain newline-ended lines in a log."""
    import io
    from types import SimpleNamespace

    from eplb_fsm.commands.simulate_progress import Progress

    class Tty(io.StringIO):
        def isatty(self):
            return True

    opts = SimpleNamespace(ranks=2, steps=10, log_dir="/nonexistent")
    tty, log = Tty(), io.StringIO()
    Progress(opts, tty).draw()
    Progress(opts, log).draw()
    assert tty.getvalue().startswith("\rsimulate step -/10") and "\n" not in tty.getvalue()
    assert log.getvalue() == "simulate step -/10 | r0:starting r1:starting | rearrangements 0\n"
