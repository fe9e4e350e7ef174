"""``eplb-fsm bench replay``: generates healthy and hung traces and times the verdicts."""

from __future__ import annotations

import json

import pytest

from eplb_fsm.cli import main


def test_small_bench_reports_both_verdicts(capsys):
    """A small run: healthy traces replay as healthy, the injected hang names the expected culprit."""
    assert main(["bench", "replay", "--json", "--ranks", "8", "--steps", "600", "--interval", "50",
                 "--layers", "2", "--repeats", "1", "--long-steps", "0"]) == 0
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
    assert ar["verdict"] == "healthy" and ar["records"] == 8 * (600 * 3 + 3) and ar["target_s"] == 4.0
    assert data["compact"]["target_s"] == 2.0
    assert data["meets_target"] == (data["compact"]["meets_target"] and ar["meets_target"])
    assert data["healthy"]["correct"] and data["hang"]["correct"] and data["parallel"]["correct"] and ar["correct"]
    assert data["long"] is None     # --long-steps 0 skips the long case


def test_long_case_replays_compact_traces_to_both_verdicts(capsys):
    """The long case writes runs of steps through the real trace writer; healthy stays healthy, the hang is named."""
    assert main(["bench", "replay", "--json", "--ranks", "4", "--steps", "200", "--interval", "50", "--layers", "2",
                 "--repeats", "1", "--long-steps", "6000", "--long-interval", "1000", "--long-alive-every", "20"]) == 0
    long = json.loads(capsys.readouterr().out)["long"]
    assert (long["ranks"], long["steps"], long["interval"], long["finished"]) == (4, 6000, 1000, True)
    assert long["healthy"]["verdict"] == "healthy" and long["healthy"]["seconds"] > 0
    hang = long["hang"]
    assert hang["verdict"] == "hang" and hang["culprit_ranks"] == [hang["expected_culprit"]] == [2]
    assert hang["step"] == hang["expected_step"] == 5999 - 1000
    assert long["healthy"]["correct"] and hang["correct"]
    # one alive record and one run per 20 steps, a few records per rearrangement: far fewer records than steps
    assert 4 * 6000 // 20 < long["records"] < 4 * 6000 // 5


def test_bad_sizes_are_refused(capsys):
    """Fewer than 2 ranks or fewer steps than two intervals is a usage error: exit 2, one line naming the options."""
    assert main(["bench", "replay", "--ranks", "1", "--steps", "100"]) == 2
    assert "eplb-fsm bench replay: error: need --ranks >= 2" in capsys.readouterr().err
    assert main(["bench", "replay", "--ranks", "4", "--steps", "50", "--interval", "100"]) == 2
    assert "--steps >= 2 * --interval" in capsys.readouterr().err
    assert main(["bench", "replay", "--ranks", "4", "--steps", "200", "--interval", "50", "--long-steps", "100",
                 "--long-interval", "100"]) == 2
    assert "--long-steps 0 or >= 2 * --long-interval" in capsys.readouterr().err


SMALL = ["--ranks", "4", "--steps", "200", "--interval", "50", "--layers", "2", "--repeats", "1", "--long-steps", "0"]


@pytest.mark.parametrize("option, value, rule", [
    ("--interval", "0", "--interval must be >= 1"),      # was a ZeroDivisionError
    ("--interval", "-5", "--interval must be >= 1"),     # was a ValueError traceback
    ("--layers", "0", "--layers must be >= 1"),          # was a ValueError traceback
    ("--repeats", "0", "--repeats must be >= 1"),        # silently ran once
    ("--repeats", "-3", "--repeats must be >= 1"),
])
def test_bad_values_are_refused_by_name_before_any_trace_is_written(option, value, rule, capsys):
    """An interval, layer count or repeat count below 1 is a usage error (exit 2) naming the option and its rule."""
    assert main(["bench", "replay", *SMALL, option, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("eplb-fsm bench replay: error: ") and rule in err and err.count("\n") == 1



@pytest.mark.parametrize("verdict, culprits, step, compact_wrong", [
    ("healthy", [], None, True),    # the hang called healthy
    ("hang", [0], None, True),      # the wrong rank named
    ("hang", [2], 7, False),        # the right rank at the wrong step: the long case checks the step
])
def test_a_wrong_verdict_fails_the_targets_and_the_long_case(verdict, culprits, step, compact_wrong, capsys,
                                                             monkeypatch):
    """A replay that calls a hung trace healthy, names the wrong rank or the wrong step is not correct, nor met."""
    import dataclasses

    import eplb_fsm.inspect.replay as replay_mod

    real = replay_mod.replay_dir

    def wrong(path, **kw):
        result = real(path, **kw)
        if result.verdict != "hang":
            return result
        return dataclasses.replace(result, verdict=verdict, culprit_ranks=culprits,
                                   step=result.step if step is None else step)

    monkeypatch.setattr(replay_mod, "replay_dir", wrong)
    assert main(["bench", "replay", "--json", *SMALL[:-2], "--long-steps", "1000", "--long-interval", "400"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["healthy"]["correct"] and data["allreduce_every_step"]["correct"] and data["long"]["healthy"]["correct"]
    assert data["long"]["hang"]["correct"] is False and data["long"]["finished"] is False
    assert data["hang"]["correct"] is data["parallel"]["correct"] is not compact_wrong
    if compact_wrong:
        assert data["compact"]["meets_target"] is False and data["meets_target"] is False
