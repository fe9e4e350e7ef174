"""Tests of ``eplb-fsm bench movement`` (eplb_fsm.bench.movement)."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from eplb_fsm.bench import movement
from eplb_fsm.stats import LoadWindow


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", action="store_true")
    movement.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_synthetic_rows_side_by_side():
    """One run reports both policies per shape and sigma, with ratios and target checks."""
    result = movement.run(
        _args("--shapes", "v2lite_ep8", "--sigmas", "0.1,1.0", "--repeats", "1", "--esft-dir", "none")
    )
    json.dumps(result)  # serialisable
    rows = result["synthetic"]["v2lite_ep8"]["sigmas"]
    assert set(rows) == {"0.1", "1.0"}
    for row in rows.values():
        for key in ("default", "movement_aware"):
            assert set(row[key]) >= {"balancedness", "next_balancedness", "moved", "ms", "best_ms"}
            assert 0.0 <= row[key]["moved"] <= 1.0
        assert row["moved_ratio"] <= 1.0
        assert row["time_ratio"] > 0
        # quality targets at sigma <= 0.1 and >= 1, the time target everywhere; judged unrounded, so a
        # printed ratio equal to the target may go either way (any other reads as it prints)
        if row["time_ratio"] != movement.TIME_RATIO_TARGET:
            assert row["time_met"] == (row["time_ratio"] <= movement.TIME_RATIO_TARGET)
        assert row["target_met"] == (row["quality_met"] and row["time_met"])
    # one timed run per policy is too noisy to assert the time ratio here; quality is exact
    assert rows["0.1"]["quality_met"]
    assert result["esft"] == {"skipped": "--esft-dir none"}
    assert result["summary"]["targets_met"].endswith("/2")
    assert result["summary"]["quality_targets_met"].endswith("/2")


def test_time_target_covers_every_sigma():
    """A sigma without a quality target (0.3) still has the time target in its check."""
    result = movement.run(_args("--shapes", "v2lite_ep8", "--sigmas", "0.3", "--repeats", "1", "--esft-dir", "none"))
    row = result["synthetic"]["v2lite_ep8"]["sigmas"]["0.3"]
    assert "quality_met" not in row
    assert row["target_met"] == row["time_met"]
    assert result["summary"]["time_targets_met"].startswith(f"{int(row['time_met'])}/1")


def test_traces_and_estimators(monkeypatch):
    """On the bundled ESFT traces it reports rolling re-plans and the load-estimator comparison."""
    monkeypatch.delenv(movement.ESFT_DIR_ENV, raising=False)
    result = movement.run(
        _args("--shapes", "v2lite_ep8", "--sigmas", "0.05", "--repeats", "1", "--sequences", "8", "--history", "3")
    )
    for case in ("intent", "intent->law"):
        row = result["esft"][case]
        assert row["rearrangements"] >= 1
        assert row["movement_aware"]["moved"] <= row["default"]["moved"]
    cases = result["estimators"]["cases"]
    assert set(cases) == {"intent", "intent->law", "intent->law first 4"}
    for case in cases.values():
        assert case["best"] in case["next_balancedness"]
        assert case["gain_over_window_sum"] >= 0


@pytest.mark.parametrize(
    "argv,message",
    [
        (("--shapes", "nope"), "unknown shape"),
        (("--sigmas", "x"), "--sigmas"),
        (("--sigmas", "-1"), "--sigmas"),
        (("--repeats", "0"), "--repeats"),
        (("--target", "1.5"), "--target"),
        (("--seed", "-1"), "--seed must be >= 0"),  # was numpy's ValueError traceback
        (("--history", "-4", "--shapes", "v2lite_ep8", "--sigmas", "0.1", "--repeats", "1"),
         "--history must be >= 1"),  # silently became 1
        (("--history", "0", "--shapes", "v2lite_ep8", "--sigmas", "0.1", "--repeats", "1"), "--history must be >= 1"),
        (("--sigmas", "inf"), r"--sigmas must be finite and >= 0, got inf"),  # was the policy's ValueError
        (("--sigmas", "0.1,nan"), r"--sigmas must be finite and >= 0, got nan"),
        # finite, but its lognormal factors reach e**200: past the float32 range the policies take
        (("--shapes", "v2lite_ep8", "--sigmas", "0.1,50"),
         r"--sigmas: sigma 50 drifts v2lite_ep8's load \(seed 0\) .*each layer's total load must be finite and "
         r"below 2\*\*126"),
    ],
)
def test_bad_arguments(argv, message):
    """Bad options stop the benchmark with a message naming the option."""
    with pytest.raises(SystemExit, match=message):
        movement.run(_args(*argv, "--esft-dir", "none"))


def test_missing_traces_under_the_environment_default_are_skipped(tmp_path: Path, monkeypatch):
    """$EPLB_FSM_ESFT_DIR (the default, nobody named it on the command line) without the ESFT tasks: the trace parts
    are reported as skipped, not an error."""
    monkeypatch.setenv(movement.ESFT_DIR_ENV, str(tmp_path))
    result = movement.run(_args("--shapes", "v2lite_ep8", "--sigmas", "0.05", "--repeats", "1"))
    assert result["esft"] == {"skipped": f"no ESFT traces at {tmp_path}"}


@pytest.mark.parametrize("folder", ["nonexistent", "empty", "intent-only"])
def test_an_esft_dir_given_by_name_without_traces_is_refused(folder, tmp_path: Path, monkeypatch):
    """--esft-dir naming a folder that is missing, empty or lacks law/ is refused by name before anything is timed
    (it ran to exit 0 with the trace parts quietly skipped)."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "intent-only" / "intent").mkdir(parents=True)
    monkeypatch.setattr(movement, "_synthetic", lambda *a, **k: pytest.fail("timed before the check"))
    path = tmp_path / folder
    rule = (f"eplb-fsm bench movement: --esft-dir: {path} is not a folder of ESFT traces (it needs intent/ and law/ "
            "folders); pass --esft-dir none")
    with pytest.raises(SystemExit, match=re.escape(rule)):
        movement.run(_args("--shapes", "v2lite_ep8", "--sigmas", "0.05", "--repeats", "1", "--esft-dir", str(path)))


@pytest.mark.parametrize("estimator", ["window_sum", "decayed_sum", "subwindow_max"])
def test_estimators_match_load_window(estimator):
    """The offline estimator math equals LoadWindow.estimate on a one-slot-per-expert placement."""
    rng = np.random.default_rng(0)
    passes = rng.integers(0, 50, size=(7, 2, 5))
    window = LoadWindow(num_layers=2, num_physical=5, window_size=5)
    for p in passes:
        window.load_pass.copy_(torch.from_numpy(p))
        window.record_pass()
    expected = window.estimate(estimator, decay=0.8, subwindows=3).numpy()
    got = movement.estimate_logical(passes[-5:], estimator, decay=0.8, subwindows=3)
    np.testing.assert_allclose(got, expected)


def _no_timing(monkeypatch) -> None:
    """Make any timed part of the benchmark fail the test: the checks under test come before timing."""
    def timed(*args, **kwargs):
        raise AssertionError("the benchmark timed something before refusing its options")

    monkeypatch.setattr(movement, "_synthetic", timed)


@pytest.mark.parametrize(
    "argv,message",
    [
        # 33 law sequences: 17 a window leaves one law window, nothing to score a re-plan on (was a KeyError)
        (("--sequences", "17"), r"--sequences must be <= 16, got 17: the trace parts need at least 3 intent "
                                r"and 2 law windows \(the traces hold 127 intent and 33 law sequences\)"),
        (("--sequences", "100000"), r"--sequences must be <= 16, got 100000"),  # was esft_load_windows' ValueError
        # 127 intent sequences make 63 windows of 2: a history of 63 or more leaves none to score (was NaN)
        (("--history", "63"), r"--history must be below the 63 intent windows that --sequences 2 makes"),
        (("--history", "1000"), r"--history must be below the 63 intent windows"),
    ],
)
def test_trace_options_that_leave_nothing_to_score_are_refused_before_timing(argv, message, monkeypatch):
    """--sequences and --history are checked against the bundled traces' windows, by name, before any timing."""
    monkeypatch.delenv(movement.ESFT_DIR_ENV, raising=False)
    _no_timing(monkeypatch)
    with pytest.raises(SystemExit, match=message):
        movement.run(_args("--shapes", "v2lite_ep8", "--sigmas", "0.05", "--repeats", "1", *argv))


def test_a_drift_past_float32_is_refused_before_timing(monkeypatch):
    """A sigma whose drifted load the policies cannot take stops the run before any shape is timed."""
    _no_timing(monkeypatch)
    with pytest.raises(SystemExit, match="--sigmas: sigma 60 drifts"):
        movement.run(_args("--shapes", "v2lite_ep8", "--sigmas", "0.1,60", "--repeats", "1", "--esft-dir", "none"))


def test_bench_movement_json_never_prints_nan(monkeypatch, capsys):
    """The --history that printed NaN (no window scored) is now a one-line usage error and no JSON at all."""
    from eplb_fsm.cli import main

    monkeypatch.delenv(movement.ESFT_DIR_ENV, raising=False)
    argv = ["bench", "movement", "--json", "--shapes", "v2lite_ep8", "--sigmas", "0.05", "--repeats", "1"]
    assert main([*argv, "--history", "1000"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("eplb-fsm bench movement: error: --history") and err.count("\n") == 1


def _stub_balancedness(monkeypatch, aware: float) -> None:
    """Score every movement-aware placement ``aware`` and every other one 1.0, whatever the load."""
    from eplb_fsm.policy import bounds
    from eplb_fsm.policy.movement import MovementAwarePolicy

    planned: list = []
    real = MovementAwarePolicy.__dict__["rebalance_experts"]  # a descriptor: bound to the instance below

    def recording(self, *args, **kwargs):
        out = real.__get__(self, type(self))(*args, **kwargs)
        planned.append(out[0])
        return out

    monkeypatch.setattr(MovementAwarePolicy, "rebalance_experts", recording)
    monkeypatch.setattr(bounds, "placement_balancedness",
                        lambda placement, weight, ranks: aware if any(placement is p for p in planned) else 1.0)


def test_quality_is_judged_on_the_unrounded_balancedness_ratio(monkeypatch):
    """A balancedness ratio of 0.98996 prints as 0.99 but misses the >= 0.99 quality target (0.99004 meets it)."""
    for aware, met in ((0.98996, False), (0.99004, True)):
        _stub_balancedness(monkeypatch, aware)
        result = movement.run(_args("--shapes", "v2lite_ep8", "--sigmas", "0.05", "--repeats", "1",
                                    "--esft-dir", "none"))
        row = result["synthetic"]["v2lite_ep8"]["sigmas"]["0.05"]
        assert row["movement_aware"]["balancedness"] == row["balancedness_ratio"] == 0.99
        assert row["moved_ratio"] <= 0.10  # the real placements: only the balancedness decides
        assert row["quality_met"] is met
        monkeypatch.undo()


def test_time_is_judged_on_the_unrounded_time_ratio(monkeypatch):
    """Medians of 5.004 ms against 1 ms print a time ratio of 5.0 but miss the <= 5 target."""
    monkeypatch.setattr(movement.Timer, "median", lambda self, name: 5.004e-3 if name == "movement_aware" else 1e-3)
    result = movement.run(_args("--shapes", "v2lite_ep8", "--sigmas", "0.3", "--repeats", "1", "--esft-dir", "none"))
    row = result["synthetic"]["v2lite_ep8"]["sigmas"]["0.3"]
    assert row["time_ratio"] == 5.0 and row["movement_aware"]["ms"] == 5.004
    assert row["time_met"] is False and row["target_met"] is False
    assert result["summary"]["time_targets_met"].startswith("0/1")


def test_verdicts_take_the_unrounded_ratios():
    """The targets' arithmetic on ratios either side of each bound (what the JSON would print as the bound)."""
    def verdicts(sigma: float, balancedness: float, moved: float, time: float) -> dict:
        return movement.verdicts(sigma, {"balancedness_ratio": balancedness, "moved_ratio": moved, "time_ratio": time})

    assert verdicts(0.1, 0.98996, 0.05, 1.0)["quality_met"] is False
    assert verdicts(0.1, 0.99, 0.10004, 1.0)["quality_met"] is False
    assert verdicts(1.0, 0.97996, 0.9, 1.0)["quality_met"] is False
    assert verdicts(1.0, 0.98, 0.9, 5.0) == {"quality_met": True, "time_met": True, "target_met": True}
    assert verdicts(0.3, 0.5, 0.9, 5.004) == {"time_met": False, "target_met": False}
