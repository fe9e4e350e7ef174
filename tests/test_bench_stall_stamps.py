"""Per-step stamps of ``bench stall``: what is timed on which thread, and the breakdown's arithmetic."""

from __future__ import annotations

import threading

import pytest

from eplb_fsm.bench.stall_stamps import PARTS, StepStamps, breakdown, breakdown_flat, unflatten


def test_timed_counts_only_calls_on_the_engine_thread():
    """A wrapped call adds its time on the creating thread; the same call from another thread adds nothing."""
    stamps = StepStamps()
    fn = stamps.timed("transfer", lambda x: x + 1)
    assert fn(1) == 2
    first = stamps.current["transfer"]
    assert first >= 0
    got = []
    other = threading.Thread(target=lambda: got.append(fn(5)))
    other.start()
    other.join(5)
    assert got == [6] and stamps.current["transfer"] == first


def test_timed_still_counts_a_call_that_raises():
    """An exception passes through and its time is still stamped."""
    stamps = StepStamps()

    def boom():
        raise KeyError("x")

    with pytest.raises(KeyError):
        stamps.timed("ready_all_reduce", boom)()
    assert "ready_all_reduce" in stamps.current


def test_close_step_splits_commit_and_leaves_the_rest_to_controller_other():
    """commit_weights = the write less its maps flip; controller_other = controller wall less stamped parts."""
    stamps = StepStamps()
    stamps.add("commit_total", 0.005)
    stamps.add("commit_maps", 0.002)
    stamps.add("ready_all_reduce", 0.001)
    stamps.close_step({"compute": 0.01, "route": 0.001, "engine_all_reduce": 0.002}, 0.0001, 0.010)
    row = stamps.steps[-1]
    assert set(row) == set(PARTS)
    assert row["commit_weights"] == pytest.approx(0.003)
    assert row["controller_other"] == pytest.approx(0.010 - 0.001 - 0.002 - 0.003)
    assert row["gil_probe"] == 0.0001 and stamps.current == {}


def _row(**over):
    row = {p: 0.001 for p in PARTS}
    row.update(over)
    return row


def test_breakdown_takes_each_part_over_its_own_baseline():
    """Worst steps and total extras are per part over the part's baseline median; unstamped is the remainder."""
    parts = [_row() for _ in range(6)] + [_row(ready_all_reduce=0.004), _row(commit_weights=0.011)]
    times = [0.010] * 6 + [0.013, 0.021]
    out = breakdown(times, parts, skip=1, trigger=6, end=7)
    assert out["total"]["ready_all_reduce_s"] == pytest.approx(0.003)
    assert out["total"]["commit_weights_s"] == pytest.approx(0.010)
    assert out["total"]["step_extra_s"] == pytest.approx(0.014)
    assert out["total"]["unstamped_s"] == pytest.approx(0.001)
    # both rearrangement steps are among the worst three: the mean of the two
    assert out["worst_steps"]["commit_weights_s"] == pytest.approx(0.005)
    assert out["baseline"]["compute_s"] == pytest.approx(0.001)
    flat = breakdown_flat({"times": times, "parts": parts, "skip": 1, "trigger": 6, "commit": 7})
    assert unflatten(flat) == out


def test_breakdown_totals_are_over_the_baseline_mean_and_add_up_to_the_total_extra():
    """Skewed baseline parts: totals are over their mean (and sum to the step's total), worst steps over the median."""
    from eplb_fsm.bench.stall_metrics import run_metrics

    slow = [1, 4]                      # two of the six baseline steps wait 3 ms longer in the all-reduce
    parts = [_row(engine_all_reduce=0.001 + (0.003 if i in slow else 0.0)) for i in range(6)]
    parts += [_row(commit_weights=0.011), _row()]
    times = [0.010 + (0.003 if i in slow else 0.0) for i in range(6)] + [0.021, 0.010]
    out = breakdown(times, parts, skip=0, trigger=6, end=7)
    assert out["total"]["engine_all_reduce_s"] == pytest.approx(-0.002)     # 2 steps at 1 ms below the 2 ms mean
    assert out["total"]["step_extra_s"] == pytest.approx(0.031 - 2 * 0.011)
    assert out["worst_steps"]["commit_weights_s"] == pytest.approx(0.005)
    assert out["baseline"]["engine_all_reduce_s"] == pytest.approx(0.001)   # the median
    cpu = {"wall_s": 1.0, "engine_cpu_s": 0.5, "process_cpu_s": 0.8}
    run = {"times": times, "work": times, "parts": parts, "trigger": 6, "commit": 7, "skip": 0,
           "cpu_base": cpu, "cpu_rearrange": cpu}
    assert out["total"]["step_extra_s"] == pytest.approx(run_metrics(run)["total_extra_s"])
