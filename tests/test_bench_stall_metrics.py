"""``bench stall``'s figures: the job's step times on a modelled lockstep timeline, and the ratios."""

from __future__ import annotations

import pytest

from eplb_fsm.bench.stall_metrics import commit_floor, job_steps, merge_ranks, noise_corrected


def _lockstep(steps: int, extra: dict[tuple[int, int], float], work: float = 1.0, allreduce: float = 0.1,
              after: float = 0.2) -> tuple[list[float], list[list[float]], list[list[float]]]:
    """Two ranks stepping in lockstep: each step's work, an all-reduce both must enter, then the
    controller (``after`` plus ``extra[(rank, step)]``). Returns starts, per-rank ends and step times."""
    begin = [0.0, 0.0]
    starts = list(begin)
    ends: list[list[float]] = [[], []]
    times: list[list[float]] = [[], []]
    for i in range(steps):
        done = max(b + work for b in begin) + allreduce   # the all-reduce ends when the last rank is in
        for r in (0, 1):
            end = done + after + extra.get((r, i), 0.0)
            ends[r].append(end)
            times[r].append(end - begin[r])
            begin[r] = end
    return starts, ends, times


def test_a_lag_on_one_rank_counts_once_in_the_job_step_times():
    """A rank that ends one step late delays the job by that much once; each step's slowest rank would count it
    twice."""
    starts, ends, per_rank = _lockstep(6, {(1, 2): 0.5})
    times, last, leads = job_steps(starts, ends)
    base = 1.3
    assert times == pytest.approx([base, base, base + 0.5, base, base, base])
    assert last[2] == 1 and leads[2] == pytest.approx(0.0)
    # rank 0 began step 3 half a second before the job's step 2 ended: that wait is its lead
    assert leads[3] == pytest.approx(0.5) and per_rank[0][3] == pytest.approx(base + 0.5)
    assert sum(max(ts) for ts in zip(*per_rank)) - 6 * base == pytest.approx(1.0)   # the double count
    assert sum(times) - 6 * base == pytest.approx(0.5)
    assert ends[1][-1] - starts[1] == pytest.approx(sum(times))   # the job's wall, step by step


def test_merged_work_and_controller_split_adds_up_to_the_job_step():
    """Per step, the last rank's engine work less its lead plus its controller time is the job's step time."""
    starts, ends, per_rank = _lockstep(5, {(1, 1): 0.4, (0, 3): 0.3})
    cpu = {"wall_s": 1.0, "engine_cpu_s": 0.5, "process_cpu_s": 0.8}
    runs = []
    for r in (0, 1):
        work = [t - 0.2 - (0.4 if (r, i) == (1, 1) else 0.3 if (r, i) == (0, 3) else 0.0)
                for i, t in enumerate(per_rank[r])]
        parts = [{"engine_all_reduce": w - 1.0} for w in work]
        runs.append({"times": per_rank[r], "start": starts[r], "ends": ends[r], "work": work, "parts": parts,
                     "commit": 3, "bit_exact": True, "cpu_base": cpu, "cpu_rearrange": cpu})
    merged = merge_ranks(runs)
    for i, step in enumerate(merged["times"]):
        controller = step - merged["work"][i]
        assert controller == pytest.approx(0.2 + (0.4 if i == 1 else 0.3 if i == 3 else 0.0))
        assert merged["parts"][i]["engine_all_reduce"] == pytest.approx(merged["work"][i] - 1.0)


def test_controller_cpu_comes_from_the_rank_that_ended_each_step_and_counts_over_its_mean():
    """merge_ranks takes each step's controller CPU from its last rank; run_metrics sums it over the baseline's mean."""
    from eplb_fsm.bench.stall_metrics import run_metrics

    starts, ends, per_rank = _lockstep(6, {(1, 4): 0.5})
    cpu = {"wall_s": 1.0, "engine_cpu_s": 0.5, "process_cpu_s": 0.8}
    runs = []
    for r in (0, 1):
        work = [t - 0.2 for t in per_rank[r]]
        controller_cpu = [0.01 * (r + 1)] * 6   # rank 0: 10 ms a step, rank 1: 20 ms
        controller_cpu[4] += 0.1 * (r + 1)      # the stall's step: rank 0 +100 ms, rank 1 +200 ms
        runs.append({"times": per_rank[r], "start": starts[r], "ends": ends[r], "work": work, "commit": 5,
                     "parts": [{"engine_all_reduce": 0.0, "commit_weights": 0.0, "commit_maps": 0.0} for _ in work],
                     "controller_cpu": controller_cpu, "bit_exact": True, "cpu_base": cpu, "cpu_rearrange": cpu})
    merged = merge_ranks(runs)
    assert merged["controller_cpu"][4] == pytest.approx(0.22)   # rank 1 ended step 4 last
    merged.update(trigger=3, skip=0)
    base = sum(merged["controller_cpu"][:3]) / 3
    metrics = run_metrics(merged)
    assert metrics["controller_cpu_extra_s"] == pytest.approx(sum(merged["controller_cpu"][3:6]) - 3 * base)
    assert metrics["controller_cpu_extra_s"] > 0.1
    without = dict(merged, controller_cpu=None)
    assert run_metrics(without)["controller_cpu_extra_s"] == 0.0   # not taken: no CPU claimed


def _mode(longest: float, total: float, commits: float = 0.0, longest_commit: float = 0.0) -> dict:
    return {"longest_extra_s": longest, "total_extra_s": total, "commit_s": commits, "longest_commit_s": longest_commit}


def test_commit_floor_flags_a_target_below_async_own_commits():
    """The floor is async's commits over sync's stall; a target under it is flagged, one above it is not."""
    floor = commit_floor(_mode(0.1, 0.1), _mode(0.02, 0.5, commits=0.03, longest_commit=0.004))
    assert floor["single_step"] == pytest.approx(0.04) and floor["total"] == pytest.approx(0.3)
    assert floor["target_below_floor"] == {"single_step": False, "total": True}
    assert commit_floor(_mode(0.0, 0.0), _mode(0.01, 0.01))["total"] is None   # no sync stall, no ratio


def test_noise_corrected_subtracts_the_plain_run_and_keeps_raw_verdicts_apart():
    """noise_corrected is async less plain over sync, with its own within_target, labelled as such."""
    out = noise_corrected(_mode(0.1, 0.1), _mode(0.012, 0.05), _mode(0.008, 0.04))
    assert out["longest_extra_over_sync"] == pytest.approx(0.04)
    assert out["total_extra_over_sync"] == pytest.approx(0.1)
    assert out["within_target"] == {"single_step": True, "total": True}
    assert "raw figures decide meets_target" in out["what"]


def _run(times: list[float], trigger: int, commit: int) -> dict:
    cpu = {"wall_s": 1.0, "engine_cpu_s": 0.5, "process_cpu_s": 0.8}
    parts = [{"commit_weights": 0.0, "commit_maps": 0.0} for _ in times]
    return {"times": times, "work": list(times), "parts": parts, "trigger": trigger, "commit": commit, "skip": 0,
            "cpu_base": cpu, "cpu_rearrange": cpu}


def test_total_extra_of_skewed_steps_with_nothing_moved_is_zero_over_the_mean():
    """Skewed steps repeated unchanged sum to no extra over their mean; over their median they would sum to more."""
    from eplb_fsm.bench.stall_metrics import run_metrics

    pattern = [2.0, 2.0, 2.0, 4.0, 2.0, 6.0]   # most steps fast, a tail of slow ones (ms)
    times = [t / 1e3 for t in pattern * 8]
    metrics = run_metrics(_run(times, trigger=24, commit=47))
    assert metrics["baseline_step_s"] == pytest.approx(2e-3)
    assert metrics["baseline_mean_step_s"] == pytest.approx(3e-3)
    assert metrics["total_extra_s"] == pytest.approx(0.0, abs=1e-12)
    assert metrics["work_extra_s"] == pytest.approx(0.0, abs=1e-12)
    assert metrics["longest_extra_s"] == pytest.approx(4e-3)            # the longest step against the median
    assert sum(times[24:]) - 24 * metrics["baseline_step_s"] == pytest.approx(24e-3)   # the median's bias


def test_total_extra_counts_a_stall_once_over_the_mean():
    """One 50 ms stall among steady steps adds exactly 50 ms to the total and to the longest step's extra."""
    from eplb_fsm.bench.stall_metrics import run_metrics

    times = [2e-3] * 30
    times[25] += 50e-3
    metrics = run_metrics(_run(times, trigger=20, commit=29))
    assert metrics["total_extra_s"] == pytest.approx(50e-3)
    assert metrics["longest_extra_s"] == pytest.approx(50e-3)
    assert metrics["steps_to_commit"] == 10


@pytest.mark.parametrize("work_change_ms,credited", [(-0.5, True), (0.5, False)])
def test_total_no_engine_credit_adds_back_only_a_faster_engine(work_change_ms, credited):
    """An engine faster during the rearrangement lowers the total but not total_no_engine_credit; a slower one
    counts in both."""
    from eplb_fsm.bench.stall_metrics import run_metrics

    work = [2e-3] * 30
    for i in range(20, 30):
        work[i] += work_change_ms / 1e3          # the engine's own part, 10 steps of the rearrangement
    controller = [1e-3] * 30
    controller[25] += 30e-3                      # one commit of 30 ms in the controller's part
    run = _run([w + c for w, c in zip(work, controller)], trigger=20, commit=29)
    run["work"] = work
    metrics = run_metrics(run)
    engine = 10 * work_change_ms / 1e3
    assert metrics["work_extra_s"] == pytest.approx(engine)
    assert metrics["controller_extra_s"] == pytest.approx(30e-3)
    assert metrics["total_extra_s"] == pytest.approx(30e-3 + engine)
    want = 30e-3 if credited else 30e-3 + engine
    assert metrics["total_no_engine_credit_s"] == pytest.approx(want)


def test_noise_and_floor_flags_judge_the_unrounded_ratios():
    """A ratio of 0.05004 prints as 0.05 but is over the 0.05 target: not within it, and the target is below it."""
    out = noise_corrected(_mode(0.1, 1.0), _mode(0.005004, 0.1), _mode(0.0, 0.0))
    assert out["longest_extra_over_sync"] == 0.05 and out["within_target"]["single_step"] is False
    floor = commit_floor(_mode(0.1, 1.0), _mode(0.0, 0.0, commits=0.0, longest_commit=0.005004))
    assert floor["single_step"] == 0.05 and floor["target_below_floor"]["single_step"] is True


def test_judged_targets_take_the_median_repeat_and_print_the_worst_beside_it():
    """single_step is judged on medians over repeats, unrounded; the worst repeat's own ratio is given beside it."""
    from eplb_fsm.bench.stall_metrics import judged_targets

    def one(longest, total=0.05):
        return {**_mode(longest, total), "total_no_engine_credit_s": total}

    sync = [one(0.1, 1.0) for _ in range(5)]
    judged = judged_targets([one(0.001), one(0.001), one(0.03), one(0.001), one(0.005004)], sync)
    assert judged["point"]["single_step"] == pytest.approx(0.01) and judged["meets_target"]["single_step"] is True
    assert judged["longest_extra_per_repeat"] == pytest.approx([0.01, 0.01, 0.3, 0.01, 0.05004])
    assert judged["longest_extra_worst_repeat"] == pytest.approx(0.3)
    edge = judged_targets([one(0.005004) for _ in range(3)], sync[:3])   # prints as 0.05, the target
    assert edge["meets_target"]["single_step"] is False and edge["target_verdict"]["single_step"] == "missed"
