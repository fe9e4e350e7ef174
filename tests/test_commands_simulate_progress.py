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


def test_after_a_scale_the_line_follows_the_serving_ranks_and_shows_joiners(tmp_path):
    """A rank that left does not hold the step back, and a joiner past the first world is shown."""
    import io
    import json
    from types import SimpleNamespace

    from eplb_fsm.commands.simulate_progress import Progress
    from eplb_fsm.sim.run import progress_path

    for rank, info in {0: {"state": "collecting", "step": 50, "rearrangements": 3},
                       1: {"state": "left", "step": 11, "rearrangements": 1},
                       2: {"state": "collecting", "step": 48, "rearrangements": 3}}.items():
        path = progress_path(tmp_path, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(info))
    line = Progress(SimpleNamespace(ranks=2, steps=100, log_dir=str(tmp_path)), io.StringIO()).line()
    assert line == "simulate step 48/100 | r0:collecting r1:left r2:collecting | rearrangements 3"
