"""Tests for eplb_fsm.commands.simulate_run: per-rank hooks plug into a run; a plot that fails keeps the report."""

from __future__ import annotations

import pytest

SMALL = ["--ranks", "2", "--layers", "2", "--experts", "8", "--redundant", "4", "--hidden", "8",
         "--tokens", "48", "--steps", "40", "--interval", "16", "--window", "8"]


class CountingHook:
    """A per-rank hook: makes every 5th step a dummy step and counts what it saw."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.before = self.after = 0

    def before_step(self, ctx, step):
        self.before += 1
        return {"is_dummy": step % self.every == self.every - 1}

    def after_step(self, ctx, step):
        self.after += 1
        ctx.extra["after"] = self.after
        ctx.extra["dummy_window_filled"] = ctx.controller.models[0].window.filled


def make_counting_hook(every: int = 5) -> CountingHook:
    return CountingHook(every)


@pytest.mark.multiprocess
def test_simulate_async_with_hooks_text_report(tmp_path, capsys):
    """Async mode with a per-rank hook (dummy steps): the hook's data comes back and the text report reads well."""
    from eplb_fsm.commands import simulate as sim_cmd
    from eplb_fsm.commands.simulate_run import run_simulation

    parser_args = ["simulate", *SMALL, "--mode", "async", "--log-dir", str(tmp_path), "--no-png", "--no-progress",
                   "--load", "esft"]  # the ESFT traces bundled with the package
    from eplb_fsm.cli import build_parser

    args = build_parser().parse_args(parser_args)
    args.hooks = [(f"{__name__}:make_counting_hook", {"every": 5})]
    opts = sim_cmd.build_options(args)
    report = run_simulation(opts, progress=False, timeout=120, want_png=False)
    assert report["ok"], report
    assert report["hooks"][0]["after"] == 40 and report["hooks"][1]["after"] == 40
    assert report["output_checks"] == 2 * 32  # 8 of 40 steps were dummy: no forward, no check
    committed = [r for r in report["rearrangements"] if r["outcome"] == "committed"]
    assert committed and committed[0]["end_step"] > committed[0]["step"]  # async: over several steps
    text = sim_cmd.format_report(report)
    assert "rearrangements" in text and "outputs identical to the reference: yes" in text


@pytest.mark.multiprocess
def test_a_plot_that_cannot_be_written_keeps_the_report(tmp_path):
    """When the PNG cannot be written after the run, the report still comes back, with a note saying why."""
    from eplb_fsm.cli import build_parser
    from eplb_fsm.commands import simulate as sim_cmd
    from eplb_fsm.commands.simulate_run import run_simulation

    args = build_parser().parse_args(["simulate", *SMALL, "--trace-dir", str(tmp_path), "--no-progress"])
    opts = sim_cmd.build_options(args)
    gone = tmp_path / "removed-after-the-check" / "b.png"
    report = run_simulation(opts, progress=False, timeout=120, png=str(gone), want_png=True)
    assert report["ok"] and report["rearrangements"]
    assert report["png"] is None and "could not be written" in report["png_note"] and str(gone) in report["png_note"]
    assert "no plot: the plot could not be written" in sim_cmd.format_report(report)
