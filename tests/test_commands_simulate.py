"""``eplb-fsm simulate``: a small run reports rearrangements, exact outputs, traces and a PNG; bad options exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eplb_fsm.cli import main

SMALL = ["--ranks", "2", "--layers", "2", "--experts", "8", "--redundant", "4", "--hidden", "8",
         "--tokens", "48", "--steps", "40", "--interval", "16", "--window", "8"]


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


def test_simulate_rejects_bad_arguments(capsys):
    """Slots that don't divide by the ranks are refused before any process starts (exit 2)."""
    code = main(["simulate", "--ranks", "3", "--experts", "8", "--redundant", "0", "--no-progress"])
    assert code == 2
    assert "divisible" in capsys.readouterr().err


@pytest.mark.parametrize(
    "make, rule",
    [
        (lambda t: ["--trace-dir", str(t / "file")], "--trace-dir: .* exists and is not a directory"),
        (lambda t: ["--log-dir", str(t / "file")], "--trace-dir: .* exists and is not a directory"),  # old name
        (lambda t: ["--trace-dir", str(t / "file" / "sub")], "--trace-dir: cannot create"),
        (lambda t: ["--timeout", "0"], "--timeout must be a finite number of seconds > 0"),
        (lambda t: ["--timeout", "nan"], "--timeout must be a finite number of seconds > 0"),
        # past ~9e9 s gloo and the store overflow: refused rather than crashing or hanging the run
        (lambda t: ["--timeout", "1e10"], r"--timeout must be a finite number of seconds > 0 and <= 1e\+06"),
        (lambda t: ["--collective-timeout", "1e12"], r"--collective-timeout must be .* <= 1e\+06 s"),
        (lambda t: ["--join-timeout", "1e15"], r"--join-timeout must be .* <= 1e\+06 s"),
        (lambda t: ["--dummy-every", "1"], r"--dummy-every must be 0 \(none\) or >= 2"),
        (lambda t: ["--drift", "1000"], r"--drift must be a number in \[0, 100\]"),
        (lambda t: ["--seed", "-1"], "--seed must be >= 0"),
        (lambda t: ["--png", str(t / "missing" / "x.png")], "--png: directory .*missing does not exist"),
        (lambda t: ["--png", str(t)], "--png: .* is a directory"),
        (lambda t: ["--png", str(t / "plot.jpg")], "--png: .* must end in .png"),
        (lambda t: ["--png", str(t / "x.png"), "--no-png"], "--png and --no-png cannot be combined"),
        (lambda t: ["--load", str(t / "nope.npy")], r"--load: .*nope\.npy: no such file or directory; --load takes"),
        (lambda t: ["--window", "100000000"], r"--window must be <= 100000, got 100000000"),
        # with --scale a fault on a rank that does not run at its step could never fire
        (lambda t: ["--redundant", "8", "--scale", "10:1", "--inject", "die:rank=1,step=11"],
         r"--inject 'die:rank=1,step=11': with --scale, rank 1 .* may run steps 0-9 only"),
        # at its own scale step a leaving rank runs no engine step: the fault would never fire (it used to
        # be accepted, then failed the run as never fired)
        (lambda t: ["--redundant", "8", "--scale", "10:1", "--inject", "skip-step:rank=1,step=10"],
         r"--inject 'skip-step:rank=1,step=10': with --scale, rank 1 .* may run steps 0-9 only \(it leaves"),
        (lambda t: ["--scale", "20:3", "--inject", "skip-step:rank=2,step=10"],
         r"--inject 'skip-step:rank=2,step=10': with --scale, rank 2 .* may run steps 20-39 only"),
        (lambda t: ["--min-gain", "2"], r"--min-gain must be a number in \[0, 1\], got 2.0"),
        (lambda t: ["--min-gain", "nan"], r"--min-gain must be a number in \[0, 1\], got nan"),
    ],
)
def test_bad_outputs_are_refused_before_any_work(tmp_path, capsys, make, rule):
    """Bad output paths and deadlines: one line naming the option and rule, exit 2, no process, no file or folder."""
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
    assert not (tmp_path / "traces").exists()  # the trace folder is made only once every check passed


def test_a_load_file_whose_layer_sum_overflows_is_refused(tmp_path, capsys):
    """Finite loads that sum past the largest float are a usage error naming --load, not a uniform load."""
    big = tmp_path / "big.json"
    big.write_text("[[1e308, 1e308, 1, 1], [1, 2, 3, 4]]")
    assert main(["simulate", *SMALL, "--no-progress", "--load", str(big), "--trace-dir", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"eplb-fsm simulate: error: --load: {big}: the loads of layer 0 sum past the largest "
                          "float") and err.count("\n") == 1, err
    assert not (tmp_path / "t").exists()


def test_unknown_policy_lists_the_choices(capsys):
    """--policy is a choice among the registered policies; a wrong one is a one-line usage error (exit 2)."""
    with pytest.raises(SystemExit) as info:
        main(["simulate", "--policy", "bogus"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--policy" in err and "'default', 'movement_aware'" in err and err.count("\n") == 1


def test_join_timeout_is_checked_without_scale(tmp_path, capsys):
    """--join-timeout 0 is refused (exit 2, one line naming the option) even when --scale is not given."""
    code = main(["simulate", *SMALL, "--no-progress", "--join-timeout", "0", "--trace-dir", str(tmp_path / "t")])
    err = capsys.readouterr().err
    assert code == 2 and err == ("eplb-fsm simulate: error: --join-timeout must be a finite number > 0 and <= 1e+06 s, "
                                 "got 0.0\n")
    assert not (tmp_path / "t").exists()


INJECT_RUN = ["--ranks", "2", "--layers", "3", "--experts", "8", "--redundant", "4", "--hidden", "8",
              "--tokens", "48", "--steps", "24", "--window", "8", "--no-png", "--no-progress",
              "--collective-timeout", "2", "--timeout", "120", "--json"]


@pytest.mark.multiprocess
def test_a_reused_trace_dir_counts_only_this_runs_injections(tmp_path, capsys):
    """An injection that fired in an earlier run into the same --trace-dir does not count: unfired, exit 1."""
    spec = "wrong-collective:rank=0,step=9"
    trace_dir = str(tmp_path / "stale")
    assert main(["simulate", *INJECT_RUN, "--interval", "8", "--inject", spec, "--trace-dir", trace_dir]) == 1
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert first["inject_unfired"] == [] and first["earlier_traces"] is False
    # --interval 100: no all-reduce at or after step 9, so this run's injection cannot fire
    code = main(["simulate", *INJECT_RUN, "--interval", "100", "--inject", spec, "--trace-dir", trace_dir])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 1 and report["ok"] is False and report["inject_unfired"] == [spec]
    assert report["earlier_traces"] is True and report["run_id"] not in (None, first["run_id"])
    sessions = Path(trace_dir, "rank00000.jsonl").read_text().count('"event":"header"')
    assert sessions == 2  # appended, not overwritten


def test_help_names_every_load_source_and_what_each_is(capsys):
    """--load's help names esft (batch by batch), esft:TASK (static whole-trace total, drifting) and example."""
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    load = text[text.index("--load LOAD "):text.index("--drift DRIFT ")]
    for phrase in ("zipf", "esft (real routing, batch by batch", "next 4 sequences", "esft:TASK",
                   "intent, law, summary or translation", "summed over the whole trace, one static load, plus the "
                   "synthetic --drift", "example (the bundled ESFT intent aggregate, 26 x 64", "a load file"):
        assert phrase in load, phrase


def test_load_sources_behave_as_the_help_says():
    """esft moves batch by batch (one target per 4 sequences); esft:TASK and example are one load drifting
    per interval."""
    import numpy as np

    from eplb_fsm.sim.run import SimOptions, load_targets

    esft = load_targets(SimOptions(load="esft", steps=100, interval=25, drift=0.6))
    assert (esft.phase_start, esft.phase_steps) == (1, 1) and len(esft.targets) == 124 // 4
    task = load_targets(SimOptions(load="esft:intent", steps=100, interval=25, drift=0.6))
    example = load_targets(SimOptions(load="example", steps=100, interval=25, drift=0.6))
    assert task.phase_steps == 25 and np.array_equal(task.targets, example.targets)
    flat = load_targets(SimOptions(load="esft:intent", steps=100, interval=25, drift=0.0))
    assert all(np.allclose(t, flat.targets[0], rtol=1e-9, atol=0) for t in flat.targets)  # only --drift moves it


def test_help_says_what_the_collective_timeout_bounds(capsys):
    """--collective-timeout's help gives the engine all-reduce's own bound, and that bound is the injector's."""
    from eplb_fsm.sim.inject import Injector

    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    ct = text[text.index("--collective-timeout COLLECTIVE_TIMEOUT "):text.index("--watchdog S ")]
    assert "The engine's forward all-reduce has its own bound: 3 x this + 10 s with --inject" in ct
    assert "else the run's --timeout (with --scale also 60 s)" in ct
    assert Injector([], collective_timeout_s=2.0).engine_timeout_s == 3 * 2.0 + 10
