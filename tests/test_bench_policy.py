"""Tests for ``eplb-fsm bench policy`` (eplb_fsm.bench.policy)."""

from __future__ import annotations

import json
import re

import pytest

from eplb_fsm.cli import main


def test_bench_policy_json(capsys):
    """The benchmark reports time, speed-up, balancedness, bound and identical placements per shape."""
    argv = ["bench", "policy", "--json", "--shapes", "v2lite_ep8,qwen3_ep16"]
    argv += ["--repeats", "2", "--reference-repeats", "1"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["benchmark"] == "policy"
    assert list(result["shapes"]) == ["v2lite_ep8", "qwen3_ep16"]
    for row in result["shapes"].values():
        assert row["identical"] is True
        assert row["default_ms"] > 0 and row["reference_ms"] > 0
        assert row["speedup"] == pytest.approx(row["reference_ms"] / row["default_ms"], rel=0.01)
        assert row["default_best_ms"] <= row["default_ms"] and row["reference_best_ms"] <= row["reference_ms"]
        assert row["initial"] < row["balancedness"] <= row["bound"] + 1e-9
    assert result["all_identical"] is True
    assert result["min_speedup"] == min(r["speedup"] for r in result["shapes"].values())


def test_bench_policy_custom_scenarios(capsys, tmp_path):
    """--scenarios runs the shapes of another file, hierarchical included."""
    path = tmp_path / "s.json"
    spec = {"layers": 3, "experts": 16, "replicas": 24, "ranks": 4, "nodes": 2, "groups": 4}
    path.write_text(json.dumps({"shapes": {"tiny_hier": spec}, "synthetic_load": {"kind": "zipf", "exponent": 1.2,
                                                                                   "tokens_per_layer": 1000}}))
    assert main(["bench", "policy", "--json", "--scenarios", str(path), "--repeats", "1"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["shapes"]["tiny_hier"]["hierarchical"] is True
    assert result["shapes"]["tiny_hier"]["identical"] is True


def test_bench_policy_unknown_shape(capsys):
    """An unknown --shapes name is a usage error (exit 2) with one line listing the known shapes."""
    assert main(["bench", "policy", "--shapes", "nope"]) == 2
    err = capsys.readouterr().err
    assert re.search("eplb-fsm bench policy: error: .*unknown shape.*dsv3_ep32_hier", err) and err.count("\n") == 1
