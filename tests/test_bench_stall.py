"""``eplb-fsm bench stall``: one rearrangement per mode on real gloo ranks, complete and consistent JSON."""

from __future__ import annotations

import io
import json
import math
import sys

import pytest

from eplb_fsm.cli import main

pytestmark = pytest.mark.multiprocess

# the least sync stall (ms) a ratio over it is checked against: its rounding to 0.001 ms moves the ratio < 1 %
_STALL = 0.1

SMALL = ["--world", "2", "--mb", "0.5", "--layers", "2", "--experts", "6", "--redundant", "2", "--matmul", "32",
         "--warm", "6", "--tail", "1", "--repeats", "2", "--timeout", "180"]
MODE_FIELDS = ("baseline_step_ms", "baseline_mean_step_ms", "baseline_longest_step_ms", "longest_step_ms",
               "longest_extra_ms", "total_extra_ms", "work_extra_ms", "controller_extra_ms", "controller_cpu_extra_ms",
               "total_no_engine_credit_ms", "commit_ms", "longest_commit_ms", "steps_to_commit",
               "rearrangement_wall_ms",
               "engine_cpu_per_step_base_ms", "engine_cpu_per_step_rearrange_ms", "other_cpu_per_step_base_ms",
               "other_cpu_per_step_rearrange_ms", "extra_cpu_ms", "cores_busy_base", "cores_busy_rearrange")


@pytest.fixture(scope="module")
def result():
    """One small run of the benchmark, parsed (shared by the tests below: it costs a few seconds)."""
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "stdout", out)
        assert main(["bench", "stall", "--json", *SMALL]) == 0
    return json.loads(out.getvalue())


def test_both_modes_reach_the_same_placement_bit_exact(result):
    """Sync and async commit the same placement, with every slot's weights exactly its expert's."""
    assert result["same_placement"] is True
    assert result["bit_exact"] is True
    assert result["moved_slots"] > 0 and result["moved_mb"] > 0
    assert result["align_slots"] is True and result["changed_slots"] >= result["moved_slots"]
    assert result["world"] == 2 and result["layers"] == 2 and result["repeats"] == 2


def test_every_mode_reports_every_field_once_per_repeat(result):
    """Both modes carry every figure, as medians and per run, one run per repeat."""
    for mode in ("sync", "async"):
        assert set(result[mode]) == set(MODE_FIELDS)
        assert len(result["runs"][mode]) == 2
        assert all(set(run) == set(MODE_FIELDS) for run in result["runs"][mode])
    assert len(result["runs"]["plain"]) == 2


def test_sync_commits_in_the_asking_step_and_async_over_several(result):
    """Sync moves everything inside the step that asked; async needs at least a plan step and a layer step."""
    assert all(run["steps_to_commit"] == 1 for run in result["runs"]["sync"])
    assert all(run["steps_to_commit"] >= 2 for run in result["runs"]["async"])


def test_step_figures_are_consistent(result):
    """The longest step is at least the mean rearrangement step; extras add up to wall minus baseline."""
    for mode in ("sync", "async"):
        for run in result["runs"][mode]:
            steps, wall = run["steps_to_commit"], run["rearrangement_wall_ms"]
            assert run["longest_step_ms"] >= wall / steps - 1e-3
            assert run["longest_extra_ms"] == pytest.approx(run["longest_step_ms"] - run["baseline_step_ms"], abs=2e-3)
            assert run["total_extra_ms"] == pytest.approx(wall - steps * run["baseline_mean_step_ms"], abs=5e-3 * steps)
            assert run["baseline_longest_step_ms"] >= run["baseline_step_ms"]
            assert run["engine_cpu_per_step_base_ms"] > 0 and run["cores_busy_base"] > 0


def test_plain_run_covers_the_async_steps_with_nothing_moved(result):
    """The noise-floor run steps as long as each async run did, its extras measured the same way."""
    assert set(result["plain"]) == set(MODE_FIELDS)
    for plain, asy in zip(result["runs"]["plain"], result["runs"]["async"]):
        assert plain["steps_to_commit"] == asy["steps_to_commit"]
        assert plain["longest_extra_ms"] == pytest.approx(plain["longest_step_ms"] - plain["baseline_step_ms"],
                                                          abs=2e-3)


def test_noise_corrected_figures_are_async_less_plain_and_labelled(result):
    """noise_corrected subtracts the plain run's extras from async's; meets_target stays on the raw ratios."""
    noise, a, p, s = result["noise_corrected"], result["async"], result["plain"], result["sync"]
    assert "raw figures decide meets_target" in noise["what"]
    assert noise["async_longest_extra_ms"] == pytest.approx(a["longest_extra_ms"] - p["longest_extra_ms"], abs=2e-3)
    assert noise["async_total_extra_ms"] == pytest.approx(a["total_extra_ms"] - p["total_extra_ms"], abs=2e-3)
    # over sync's stall where it is large enough that its rounding (0.001 ms) cannot move the ratio by 1 %
    if s["longest_extra_ms"] >= _STALL:
        want = noise["async_longest_extra_ms"] / s["longest_extra_ms"]
        assert noise["longest_extra_over_sync"] == pytest.approx(want, rel=1e-2, abs=1e-3)
    over = noise["total_extra_over_sync"]  # judged unrounded: a printed target may go either way
    if over is not None and over != result["target_total"]:
        assert noise["within_target"]["total"] == (over <= result["target_total"])


def test_breakdown_names_where_each_mode_spent_its_extra_time(result):
    """Per mode, the parts' extras plus the unstamped rest add up to the step's; sync's transfer is on the engine
    thread."""
    from eplb_fsm.bench.stall_stamps import PARTS

    for mode in ("sync", "async", "plain"):
        for where in ("worst_steps", "total"):
            part = result["breakdown"][mode][where]
            assert set(part) == {f"{p}_ms" for p in PARTS} | {"step_extra_ms", "unstamped_ms"}
        assert set(result["breakdown"][mode]["baseline"]) == {f"{p}_ms" for p in PARTS}
    sync, asy = result["breakdown"]["sync"]["total"], result["breakdown"]["async"]["total"]
    assert sync["transfer_ms"] > 0 and sync["commit_weights_ms"] > 0 and sync["commit_maps_ms"] > 0
    assert asy["commit_maps_ms"] > 0        # the maps flip is stamped on the prepared path too
    assert asy["transfer_ms"] == 0          # the worker's transfer is not stamped on the engine thread
    assert asy["ready_all_reduce_ms"] > 0   # async polls the ready flags every rearrangement step
    assert result["breakdown"]["plain"]["total"]["commit_weights_ms"] == 0


def test_ratios_and_targets_follow_from_the_medians(result):
    """The async/sync ratios are the medians' ratios inside their intervals; each verdict is its target's."""
    s, a, ratio = result["sync"], result["async"], result["async_over_sync"]
    assert ratio["longest_step"] == pytest.approx(a["longest_step_ms"] / s["longest_step_ms"], rel=1e-2)
    # each ratio is async's figure over sync's stall, None where that stall is negative: the sync step holds the
    # whole transfer, but how far it stands above its baseline is the machine's doing, so not asserted here
    for name, key, stall in (("longest_extra", "longest_extra_ms", "longest_extra_ms"),
                             ("total_extra", "total_extra_ms", "total_extra_ms"),
                             ("controller_extra", "controller_extra_ms", "total_extra_ms"),
                             ("controller_cpu_extra", "controller_cpu_extra_ms", "total_extra_ms"),
                             ("work_extra", "work_extra_ms", "total_extra_ms"),
                             ("total_no_engine_credit", "total_no_engine_credit_ms", "total_extra_ms")):
        assert isinstance(s[stall], float) and math.isfinite(s[stall])
        if s[stall] >= _STALL:
            assert ratio[name] == pytest.approx(a[key] / s[stall], rel=1e-2, abs=1e-3)
        elif s[stall] < 0:
            assert ratio[name] is None
    for run in result["runs"]["async"]:  # per run: the total, less a negative engine part (never credited)
        want = run["total_extra_ms"] - min(run["work_extra_ms"], 0.0)
        assert run["total_no_engine_credit_ms"] == pytest.approx(want, abs=2e-3)
        assert run["total_no_engine_credit_ms"] >= run["controller_extra_ms"] - 2e-3
    intervals = result["async_over_sync_interval"]  # two repeats: the medians' ratio lies between the runs'
    for name, point, target in (("single_step", ratio["longest_extra"], result["target_single_step"]),
                                ("total", ratio["total_extra"], result["target_total"]),
                                ("total_no_engine_credit", ratio["total_no_engine_credit"], result["target_total"])):
        if point is None or intervals[name] is None:  # no positive sync stall to divide by
            continue
        low, high = intervals[name]
        assert low - 2e-4 <= point <= high + 2e-4
        # 0.5 MB over 2 layers: smaller than the layers of tens of MB the targets name, so no verdict is given
        assert result["meets_target"][name] is None and result["target_verdict"][name] is None
    assert result["at_target_size"] is False and result["target_size"] == {"min_mb_per_layer": 10.0}
    assert result["judged_on"] == {"statistic": "median", "runs": 2, "option": "--repeats", "method_runs": 7,
                                   "follows_method": False}
    per_repeat = ratio["longest_extra_per_repeat"]
    assert len(per_repeat) == 2 and ratio["longest_extra_worst_repeat"] == max(per_repeat)
    load = result["uptime_load_average"]
    assert len(load["before"]) == 3 and len(load["after"]) == 3 and result["cores"] >= 1


def test_controller_cpu_is_reported_for_every_mode_and_run(result):
    """Every mode's median and every run carry the engine thread's CPU inside the controller's calls, as finite ms."""
    for mode in ("sync", "async", "plain"):
        for figures in (result[mode], *result["runs"][mode]):
            assert isinstance(figures["controller_cpu_extra_ms"], float)
            assert math.isfinite(figures["controller_cpu_extra_ms"])


def test_controller_cpu_extra_is_the_cpu_in_the_calls_over_their_baseline(monkeypatch):
    """Stubbed CPU times: sync's rearrangement step spends 80 ms of engine-thread CPU in the controller's calls on
    top of the 1 ms they took before: its controller_cpu_extra is 80 ms; async's and plain's calls cost what they
    did before: none."""
    out = _stall_with(monkeypatch, [0.001] * 3, sync_cpu=0.080)
    assert out["sync"]["controller_cpu_extra_ms"] == 80.0
    assert all(run["controller_cpu_extra_ms"] == 80.0 for run in out["runs"]["sync"])
    assert out["async"]["controller_cpu_extra_ms"] == out["plain"]["controller_cpu_extra_ms"] == 0.0
    assert out["async_over_sync"]["controller_cpu_extra"] == 0.0


def test_commit_floor_is_async_commits_over_the_sync_stall(result):
    """commit_floor: async's own commit time over sync's stall, flagged where a target lies below it."""
    floor, s, a = result["commit_floor"], result["sync"], result["async"]
    assert a["commit_ms"] > 0 and 0 < a["longest_commit_ms"] <= a["commit_ms"] + 1e-3
    assert result["plain"]["commit_ms"] == 0
    for name, commit, stall, target in (("single_step", "longest_commit_ms", "longest_extra_ms", "target_single_step"),
                                        ("total", "commit_ms", "total_extra_ms", "target_total")):
        if s[stall] >= _STALL:  # a sync stall its rounding cannot move by 1 % (its size is the machine's)
            assert floor[name] == pytest.approx(a[commit] / s[stall], rel=1e-2, abs=1e-3)
        # judged unrounded: a floor printed equal to its target may go either way
        if floor[name] is not None and floor[name] != result[target]:
            assert floor["target_below_floor"][name] == (result[target] < floor[name])


@pytest.mark.parametrize("argv, message", [
    (["--ranks", "5"], "--ranks must be in 2..4"),
    (["--experts", "7", "--redundant", "0"], "must be divisible by --ranks"),
    (["--warm", "2"], "--warm must be >= 4"),
    (["--worker-nice", "25"], "--worker-nice must be in 0..19"),
    (["--max-bytes-per-step", "-1"], "--max-bytes-per-step must be >= 0"),
    (["--timeout", "inf"], "--timeout must be in (0, 1e+06] seconds"),  # was an OverflowError on every rank
    (["--timeout", "nan"], "--timeout must be in (0, 1e+06] seconds"),
    (["--timeout", "2e6"], "--timeout must be in (0, 1e+06] seconds"),
    (["--mb", "inf"], "--mb must be > 0 and finite, got inf"),   # was an OverflowError inside the ranks
    (["--seed", "-1"], "--seed must be >= 0 (a numpy seed), got -1"),   # was a ValueError inside the ranks
    # one expert a rank, no replica: every rank raised "rearrangement ended 'skipped'" (a RankFailedError traceback)
    (["--experts", "2", "--redundant", "0"], "--experts 2 with --redundant 0 on --ranks 2 is one expert a rank: "
                                             "nothing to rearrange"),
    (["--ranks", "0"], "--ranks must be in 2..4, got 0"),   # was a ZeroDivisionError building the rules
    # past the cap: every rank failed to start its threads ("process exited with code 1 without reporting")
    (["--engine-threads", "100000"], "--engine-threads must be in 1..1024 (threads), got 100000"),
    (["--engine-threads", "1025"], "--engine-threads must be in 1..1024 (threads), got 1025"),
    (["--engine-threads", "0"], "--engine-threads must be in 1..1024 (threads), got 0"),
    # each rank's three matmul matrices alone: 3 x 4e12 bytes, past any machine's memory
    (["--matmul", "1000000"], "three --matmul 1000000 square float32 matrices) needs at least"),
    (["--ranks", "4", "--experts", "4", "--redundant", "0"], "--experts 4 with --redundant 0 on --ranks 4"),
])
def test_bad_settings_are_refused_before_any_rank_starts(argv, message, capsys, monkeypatch):
    """A bad option is named with its rule (usage error, exit 2), and nothing is launched."""
    import eplb_fsm.sim.launcher as launcher

    monkeypatch.setattr(launcher, "run_ranks", lambda *a, **k: pytest.fail("ranks started before the check"))
    assert main(["bench", "stall", *argv]) == 2
    assert message in capsys.readouterr().err


def test_device_engine_with_both_knobs_stays_exact_and_paces_the_async_transfer(result):
    """--engine device --worker-nice 5 --max-bytes-per-step (one row): both modes exact, async spread over more steps;
    --no-align-slots commits the policy's rows as given: more of them change than in the aligned run."""
    out = io.StringIO()
    argv = [*SMALL[:-6], "--tail", "1", "--repeats", "1", "--timeout", "180", "--engine", "device",
            "--worker-nice", "5", "--max-bytes-per-step", "2048", "--no-align-slots"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "stdout", out)
        assert main(["bench", "stall", "--json", *argv]) == 0
    res = json.loads(out.getvalue())
    assert (res["engine"], res["worker_nice"], res["max_bytes_per_step"]) == ("device", 5, 2048)
    assert res["same_placement"] and res["bit_exact"]
    # 0.5 MB over 2 layers x 4 slots x 2 tensors: 16 KB rows; 2 KB per step still moves a row per step
    assert res["async"]["steps_to_commit"] > res["moved_slots"] // 2
    assert res["align_slots"] is False and res["moved_slots"] == result["moved_slots"]
    assert res["changed_slots"] > result["changed_slots"]


def _fake_ranks(async_extra: list[float], sync_extra: float = 0.100, sync_cpu: float = 0.0):
    """A run_ranks stand-in: per repeat, a sync run whose one rearrangement step takes ``sync_extra`` s
    more than the 10 ms baseline, an async one whose longest takes ``async_extra[repeat]`` more, and a plain run.
    The controller's calls take 1 ms of engine-thread CPU a step, sync's rearrangement step ``sync_cpu`` s more."""
    import itertools

    from eplb_fsm.bench.stall_stamps import PARTS

    def one(mode: str, extras: list[float], cpu: float = 0.0) -> dict:
        times = [0.010] * 10 + [0.010 + e for e in extras] + [0.010] * 2
        controller_cpu = [0.001] * 10 + [0.001 + (cpu if i == 0 else 0.0) for i in range(len(extras))] + [0.001] * 2
        span = {"wall_s": 0.1, "engine_cpu_s": 0.05, "process_cpu_s": 0.08}
        return {"mode": mode, "times": times, "start": 0.0, "ends": list(itertools.accumulate(times)),
                "work": [0.009] * len(times), "parts": [{p: 0.0 for p in PARTS} for _ in times],
                "controller_cpu": controller_cpu, "trigger": 10, "commit": 9 + len(extras), "skip": 3,
                "moves": 4, "moved_bytes": 1 << 20, "phy2log": [0, 1], "changed_slots": 4, "bit_exact": True,
                "weight_bytes": 1 << 22, "device_s": 0.0, "cpu_base": span, "cpu_rearrange": span}

    def run_ranks(fn, world, args=(), timeout=None, torch_threads=None):
        runs = []
        for extra in async_extra:
            runs += [one("sync", [sync_extra], sync_cpu), one("async", [extra, 0.0, 0.0]), one("plain", [0.0] * 3)]
        return [runs, runs]

    return run_ranks


def _stall_with(monkeypatch, async_extra: list[float], sync_cpu: float = 0.0, argv: tuple = ()) -> dict:
    import argparse

    import eplb_fsm.sim.launcher as launcher
    from eplb_fsm.bench import stall

    monkeypatch.setattr(launcher, "run_ranks", _fake_ranks(async_extra, sync_cpu=sync_cpu))
    parser = argparse.ArgumentParser()
    stall.add_arguments(parser)
    return stall.run(parser.parse_args(["--repeats", str(len(async_extra)), *argv]))


def test_single_step_is_judged_on_the_median_repeat_with_the_worst_printed_beside_it(monkeypatch):
    """One repeat of seven adds 30 % of the sync stall to a step: the median repeat meets 5 %, the worst is shown."""
    out = _stall_with(monkeypatch, [0.001, 0.001, 0.001, 0.030, 0.001, 0.001, 0.001])
    ratio = out["async_over_sync"]
    assert ratio["longest_extra"] == 0.01 and out["meets_target"]["single_step"] is True
    assert ratio["longest_extra_worst_repeat"] == 0.3
    assert ratio["longest_extra_per_repeat"] == [0.01, 0.01, 0.01, 0.3, 0.01, 0.01, 0.01]


def test_verdicts_are_null_below_the_layer_size_the_targets_name(monkeypatch):
    """Layers under 10 MB (--mb 8 over --layers 1 at the edge, --mb 1 over 2) get no verdict: the same ratios that meet
    both targets on 20 MB layers give null meets_target and target_verdict, with at_target_size false."""
    for argv, at_size in ((("--mb", "1", "--layers", "2"), False), (("--mb", "9.99", "--layers", "1"), False),
                          (("--mb", "10", "--layers", "1"), True), ((), True)):
        out = _stall_with(monkeypatch, [0.001] * 7, argv=argv)
        assert out["at_target_size"] is at_size and out["async_over_sync"]["longest_extra"] == 0.01
        names = ("single_step", "total", "total_no_engine_credit")
        assert out["meets_target"] == dict.fromkeys(names, True if at_size else None)
        assert out["target_verdict"] == dict.fromkeys(names, "met" if at_size else None)
        assert out["judged_on"]["runs"] == 7 and out["judged_on"]["follows_method"] is True


def test_targets_are_judged_on_the_unrounded_ratios(monkeypatch):
    """An async extra of 5.004 % of the sync stall prints as 0.05 but misses the 0.05 target, point and interval."""
    out = _stall_with(monkeypatch, [0.005004] * 3)
    ratio, interval = out["async_over_sync"], out["async_over_sync_interval"]
    assert ratio["longest_extra"] == 0.05 and interval["single_step"] == [0.05, 0.05]
    assert out["meets_target"]["single_step"] is False
    assert out["target_verdict"]["single_step"] == "missed"


def test_a_failed_rank_ends_the_command_in_one_line(monkeypatch, capsys):
    """A rank that raises ends ``bench stall`` with one usage-error line naming the rank and its error, exit 2 (was
    a RankFailedError traceback)."""
    import eplb_fsm.sim.launcher as launcher

    def failing(fn, world, args=(), timeout=None, torch_threads=None):
        raise launcher.RankFailedError({0: "Traceback (most recent call last):\nRuntimeError: boom\n"})

    monkeypatch.setattr(launcher, "run_ranks", failing)
    assert main(["bench", "stall", "--json", *SMALL]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == "eplb-fsm bench stall: error: rank 0 of 2 failed: RuntimeError: boom\n"


def test_a_rearrangement_over_max_steps_is_one_line_naming_the_option(capfd):
    """Real ranks: async cannot commit 4 layers within --max-steps 1, and the command says so in its last line."""
    argv = [*SMALL[:4], "--layers", "4", *SMALL[6:-6], "--tail", "0", "--repeats", "1", "--timeout", "120",
            "--max-steps", "1"]
    assert main(["bench", "stall", "--json", *argv]) == 2
    out, err = capfd.readouterr()
    assert out == "" and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("eplb-fsm bench stall: error: rank ") and "not committed within --max-steps=1" in last
