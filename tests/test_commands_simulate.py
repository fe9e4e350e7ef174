"""``eplb-fsm simulate``: a small run reports rearrangements, exact outputs, traces and a PNG; hooks plug in."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eplb_fsm.cli import main

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
def test_simulate_json_report(tmp_path, capsys):
    """A small sync run: JSON report with rearrangements, outputs unchanged, traces, PNG and a progress line."""
    log_dir = tmp_path / "logs"
    code = main(["simulate", *SMALL, "--json", "--log-dir", str(log_dir)])
    out, err = capsys.readouterr()
    report = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and report["ok"]
    assert report["outputs_unchanged"] is True and report["output_checks"] == 2 * 40
    assert report["final_state"] == "collecting" and report["final_states"] == ["collecting"] * 2
    assert report["log_dir"] == str(log_dir)
    rearr = report["rearrangements"]
    assert [r["step"] for r in rearr] == [3, 19, 35]
    for r in rearr:
        assert {"step", "balancedness_before", "balancedness_after", "moved_slots", "moved_bytes",
                "measured_before", "measured_after", "outcome"} <= set(r)
    first = rearr[0]
    assert first["outcome"] == "committed" and first["moved_slots"] > 0
    assert first["balancedness_after"] > first["balancedness_before"]
    assert report["weights_exact"] and report["maps_agree"] and report["histories_agree"]
    assert set(report["time_in_state_s"]) >= {"collecting", "planning", "transferring"}
    for trace in report["traces"]:
        assert Path(trace).is_file() and Path(trace).parent == log_dir
    assert report["png"] and Path(report["png"]).stat().st_size > 1000
    assert "simulate step" in err and "r0:" in err and "r1:" in err


@pytest.mark.multiprocess
def test_simulate_async_with_hooks_text_report(tmp_path, capsys):
    """Async mode with a per-rank hook (dummy steps): the hook's data comes back and the text report reads well."""
    from eplb_fsm.commands import simulate as sim_cmd

    parser_args = ["simulate", *SMALL, "--mode", "async", "--log-dir", str(tmp_path), "--no-png", "--no-progress",
                   "--load", "esft"]  # the ESFT traces bundled with the package
    from eplb_fsm.cli import build_parser

    args = build_parser().parse_args(parser_args)
    args.hooks = [(f"{__name__}:make_counting_hook", {"every": 5})]
    opts = sim_cmd.build_options(args)
    report = sim_cmd.run_simulation(opts, progress=False, timeout=120, want_png=False)
    assert report["ok"], report
    assert report["hooks"][0]["after"] == 40 and report["hooks"][1]["after"] == 40
    assert report["output_checks"] == 2 * 32  # 8 of 40 steps were dummy: no forward, no check
    committed = [r for r in report["rearrangements"] if r["outcome"] == "committed"]
    assert committed and committed[0]["end_step"] > committed[0]["step"]  # async: over several steps
    text = sim_cmd.format_report(report)
    assert "rearrangements" in text and "outputs identical to the reference: yes" in text


def test_simulate_rejects_bad_arguments(capsys):
    """Slots that don't divide by the ranks are refused before any process starts (exit 2)."""
    code = main(["simulate", "--ranks", "3", "--experts", "8", "--redundant", "0", "--no-progress"])
    assert code == 2
    assert "divisible" in capsys.readouterr().err


def test_progress_redraws_on_a_terminal_and_writes_lines_to_a_log():
    """The progress line uses \\r redraws on a terminal and plain newline-ended lines in a log."""
    import io
    from types import SimpleNamespace

    from eplb_fsm.commands.simulate import _Progress

    class Tty(io.StringIO):
        def isatty(self):
            return True

    opts = SimpleNamespace(ranks=2, steps=10, log_dir="/nonexistent")
    tty, log = Tty(), io.StringIO()
    _Progress(opts, tty).draw()
    _Progress(opts, log).draw()
    assert tty.getvalue().startswith("\rsimulate step -/10") and "\n" not in tty.getvalue()
    assert log.getvalue() == "simulate step -/10 | r0:starting r1:starting | rearrangements 0\n"


@pytest.mark.parametrize(
    "make, rule",
    [
        (lambda t: ["--trace-dir", str(t / "file")], "--trace-dir: .* exists and is not a directory"),
        (lambda t: ["--log-dir", str(t / "file")], "--trace-dir: .* exists and is not a directory"),  # old name
        (lambda t: ["--trace-dir", str(t / "file" / "sub")], "--trace-dir: cannot create"),
        (lambda t: ["--timeout", "0"], "--timeout must be a finite number of seconds > 0"),
        (lambda t: ["--timeout", "nan"], "--timeout must be a finite number of seconds > 0"),
        (lambda t: ["--png", str(t / "missing" / "x.png")], "--png: directory .*missing does not exist"),
        (lambda t: ["--png", str(t)], "--png: .* is a directory"),
        (lambda t: ["--png", str(t / "plot.jpg")], "--png: .* must end in .png"),
        (lambda t: ["--png", str(t / "x.png"), "--no-png"], "--png and --no-png cannot be combined"),
        (lambda t: ["--load", str(t / "nope.npy")], "no such file"),
    ],
)
def test_bad_outputs_are_refused_before_any_work(tmp_path, capsys, make, rule):
    """Bad output paths and deadlines: one line naming the option and rule, exit 2, no process, no file."""
    import re

    (tmp_path / "file").write_text("x")
    argv = [*SMALL, "--no-progress", *make(tmp_path)]
    if "--trace-dir" not in argv and "--log-dir" not in argv:
        argv += ["--trace-dir", str(tmp_path / "traces")]
    assert main(["simulate", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("eplb-fsm simulate: error: ") and err.count("\n") == 1, err
    assert re.search(rule, err), err
    assert not list(tmp_path.rglob("*.jsonl")) and not list(tmp_path.rglob("*.png"))


def test_unknown_policy_lists_the_choices(capsys):
    """--policy is a choice among the registered policies; a wrong one is a one-line usage error (exit 2)."""
    with pytest.raises(SystemExit) as info:
        main(["simulate", "--policy", "bogus"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--policy" in err and "'default', 'movement_aware'" in err and err.count("\n") == 1


def test_scale_lines_name_what_happened():
    """A same-size scale says the group already had that size; a switched one prints from -> to (no 'None')."""
    from eplb_fsm.commands.simulate import _format_scalings

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


@pytest.mark.multiprocess
def test_a_plot_that_cannot_be_written_keeps_the_report(tmp_path):
    """When the PNG cannot be written after the run, the report still comes back, with a note saying why."""
    from eplb_fsm.cli import build_parser
    from eplb_fsm.commands import simulate as sim_cmd

    args = build_parser().parse_args(["simulate", *SMALL, "--trace-dir", str(tmp_path), "--no-progress"])
    opts = sim_cmd.build_options(args)
    gone = tmp_path / "removed-after-the-check" / "b.png"
    report = sim_cmd.run_simulation(opts, progress=False, timeout=120, png=str(gone), want_png=True)
    assert report["ok"] and report["rearrangements"]
    assert report["png"] is None and "could not be written" in report["png_note"] and str(gone) in report["png_note"]
    assert "no plot: the plot could not be written" in sim_cmd.format_report(report)
