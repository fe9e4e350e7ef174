"""Tests of ``eplb-fsm bench movement`` (eplb_fsm.bench.movement)."""

from __future__ import annotations

import argparse
import json
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
    result = movement.run(_args("--shapes", "v2lite_ep8", "--sigmas", "0.1,1.0", "--repeats", "1", "--esft-dir", "none"))
    json.dumps(result)  # serialisable
    rows = result["synthetic"]["v2lite_ep8"]["sigmas"]
    assert set(rows) == {"0.1", "1.0"}
    for row in rows.values():
        for key in ("default", "movement_aware"):
            assert set(row[key]) >= {"balancedness", "next_balancedness", "moved", "ms", "best_ms"}
            assert 0.0 <= row[key]["moved"] <= 1.0
        assert row["moved_ratio"] <= 1.0
        assert row["time_ratio"] > 0
        # quality targets at sigma <= 0.1 and >= 1, the time target everywhere
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
    ],
)
def test_bad_arguments(argv, message):
    """Bad options stop the benchmark with a message naming the option."""
    with pytest.raises(SystemExit, match=message):
        movement.run(_args(*argv, "--esft-dir", "none"))


def test_missing_traces_are_skipped(tmp_path: Path):
    """A trace directory without the ESFT tasks is reported as skipped, not an error."""
    result = movement.run(_args("--shapes", "v2lite_ep8", "--sigmas", "0.05", "--repeats", "1", "--esft-dir", str(tmp_path)))
    assert "skipped" in result["esft"]


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
