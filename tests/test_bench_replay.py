"""``eplb-fsm bench replay``: generates healthy and hung traces and times the verdicts."""

from __future__ import annotations

import json

from eplb_fsm.cli import main


def test_small_bench_reports_both_verdicts(capsys):
    """A small run: healthy traces replay as healthy, the injected hang names the expected culprit."""
    assert main(["bench", "replay", "--json", "--ranks", "8", "--steps", "600", "--interval", "50",
                 "--layers", "2", "--repeats", "1"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ranks"] == 8 and data["steps"] == 600
    assert data["healthy"]["verdict"] == "healthy"
    assert data["hang"]["verdict"] == "hang"
    assert data["hang"]["culprit_ranks"] == [data["hang"]["expected_culprit"]] == [4]
    assert data["hang"]["step"] == 599 and data["hang"]["collective"]["op"] == "all_reduce"
    assert data["records"] > 8 * 600
    for key in ("seconds", "records_per_s", "over_parse"):
        assert data["healthy"][key] > 0
    assert data["baseline_parse_s"] > 0 and isinstance(data["meets_target"], bool)
    ar = data["allreduce_every_step"]
    assert ar["verdict"] == "healthy" and ar["records"] == 8 * (600 * 3 + 2) and ar["target_s"] == 4.0
    assert data["compact"]["target_s"] == 2.0
    assert data["meets_target"] == (data["compact"]["meets_target"] and ar["meets_target"])


def test_bad_sizes_are_refused(capsys):
    """Fewer than 2 ranks or fewer steps than two intervals is a usage error: exit 2, one line naming the options."""
    assert main(["bench", "replay", "--ranks", "1", "--steps", "100"]) == 2
    assert "eplb-fsm bench replay: error: need --ranks >= 2" in capsys.readouterr().err
    assert main(["bench", "replay", "--ranks", "4", "--steps", "50", "--interval", "100"]) == 2
    assert "--steps >= 2 * --interval" in capsys.readouterr().err
