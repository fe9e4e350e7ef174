"""``eplb_fsm.bench.intervals``: paired bootstrap intervals of ratios of medians, and verdicts on them."""

from __future__ import annotations

import numpy as np
import pytest

from eplb_fsm.bench.intervals import (MET, MISSED, UNRESOLVED, combined, median_ratio_interval, power, rounded,
                                      verdict)


def test_a_ratio_without_noise_has_a_point_interval():
    """Samples whose every round has the same ratio give that ratio as both ends."""
    low, high = median_ratio_interval([2.0, 4.0, 6.0, 8.0], [1.0, 2.0, 3.0, 4.0])
    assert low == pytest.approx(2.0) and high == pytest.approx(2.0)


def test_rounds_are_resampled_as_pairs():
    """Drift that moves both sides of each round alike leaves the interval at the true ratio; unpaired it would not."""
    drift = np.random.default_rng(1).uniform(1.0, 3.0, size=40)
    low, high = median_ratio_interval(list(0.9 * drift), list(drift))
    assert low == pytest.approx(0.9) and high == pytest.approx(0.9)
    # the same two samples with one side shuffled: the drift no longer cancels
    shuffled = np.random.default_rng(2).permutation(drift)
    low, high = median_ratio_interval(list(0.9 * drift), list(shuffled))
    assert high - low > 0.1


def test_the_interval_holds_the_point_ratio_and_narrows_with_more_rounds():
    """The median ratio lies inside its interval, and 400 rounds give a narrower one than 15."""
    rng = np.random.default_rng(3)
    widths = []
    for n in (15, 400):
        ceiling = rng.uniform(11.0, 25.0, size=n)  # ms: one call's spread on the 2-core box
        engine = rng.uniform(12.0, 27.0, size=n)
        low, high = median_ratio_interval(list(ceiling), list(engine))
        point = float(np.median(ceiling) / np.median(engine))
        assert low <= point <= high
        widths.append(high - low)
    assert widths[1] < widths[0] / 2


def test_the_same_samples_give_the_same_interval():
    """The resampling is seeded, so a benchmark's JSON is reproducible from its samples."""
    rng = np.random.default_rng(4)
    a, b = list(rng.uniform(1, 2, 30)), list(rng.uniform(1, 2, 30))
    assert median_ratio_interval(a, b) == median_ratio_interval(a, b)
    assert median_ratio_interval(a, b, level=0.5) != median_ratio_interval(a, b)


def test_a_wider_level_gives_a_wider_interval():
    """A 99 % interval contains the 50 % one."""
    rng = np.random.default_rng(5)
    a, b = list(rng.uniform(1, 2, 30)), list(rng.uniform(1, 2, 30))
    lo50, hi50 = median_ratio_interval(a, b, level=0.5)
    lo99, hi99 = median_ratio_interval(a, b, level=0.99)
    assert lo99 <= lo50 < hi50 <= hi99


@pytest.mark.parametrize("numerator, denominator", [
    ([1.0], [1.0]),                   # one round: nothing to resample
    ([], []),
    ([1.0, None, 2.0], [1.0, 1.0, 1.0]),  # a missing sample
    ([1.0, 2.0], [0.0, 0.0]),         # a zero median below
])
def test_no_interval_where_there_is_nothing_to_resample(numerator, denominator):
    """Too few rounds, a missing sample or a zero denominator give None, not a made-up interval."""
    assert median_ratio_interval(numerator, denominator) is None


def test_bad_input_is_refused_with_the_rule():
    """Unpaired lengths and a level outside (0, 1) raise ValueError naming the rule."""
    with pytest.raises(ValueError, match="pair round by round: 3 != 2"):
        median_ratio_interval([1.0, 2.0, 3.0], [1.0, 2.0])
    for level in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match="level must be in"):
            median_ratio_interval([1.0, 2.0], [1.0, 2.0], level=level)


def test_a_floor_target_is_met_or_missed_only_outside_the_interval():
    """For ratio >= target: met when the low end reaches it, missed when the high end is under it."""
    assert verdict((0.91, 0.97), 0.9) == MET
    assert verdict((0.90, 0.97), 0.9) == MET
    assert verdict((0.80, 0.89), 0.9) == MISSED
    assert verdict((0.85, 0.95), 0.9) == UNRESOLVED
    assert verdict(None, 0.9) == UNRESOLVED


def test_a_ceiling_target_is_met_or_missed_only_outside_the_interval():
    """For ratio <= target: met when the high end stays under it, missed when the low end is over it."""
    assert verdict((0.10, 0.20), 0.2, at_most=True) == MET
    assert verdict((0.21, 0.40), 0.2, at_most=True) == MISSED
    assert verdict((0.15, 0.30), 0.2, at_most=True) == UNRESOLVED
    assert verdict(None, 0.2, at_most=True) == UNRESOLVED


def test_rounded_gives_a_json_list():
    """An interval prints as a two-item list at the benchmark's precision; none prints as null."""
    assert rounded((0.123456, 0.98765)) == [0.123, 0.988]
    assert rounded((0.123456, 0.98765), 4) == [0.1235, 0.9877]
    assert rounded(None) is None


def test_targets_that_must_all_hold_combine_into_one_verdict():
    """One miss decides the whole; met needs every target met; anything else is unresolved."""
    assert combined([MET, MET]) == MET
    assert combined([MET, UNRESOLVED, MISSED]) == MISSED
    assert combined([MET, UNRESOLVED]) == UNRESOLVED
    assert combined([]) == UNRESOLVED


def test_power_maps_both_bounds_and_refuses_a_non_positive_exponent():
    """A ratio over a size step normalised to one doubling takes both bounds with it; None stays None."""
    assert power((4.0, 9.0), 0.5) == (2.0, 3.0)
    assert power(None, 0.5) is None
    with pytest.raises(ValueError, match="exponent must be > 0"):
        power((1.0, 2.0), 0.0)


def test_a_printed_interval_is_judged_as_it_reads():
    """rounded()'s list is judged like a tuple, so a bound rounded onto the target counts as on it."""
    printed = rounded((0.89996, 0.95))
    assert printed == [0.9, 0.95] and verdict(printed, 0.9) == MET
    assert verdict((0.89996, 0.95), 0.9) == UNRESOLVED


@pytest.mark.parametrize("denominator", [
    [-1.0, -3.0, -2.0],                # every median below is negative
    [1.0, 2.0, -5.0],                  # a positive median, but some resamples' are negative
])
def test_a_non_positive_denominator_median_gives_no_interval_and_no_verdict(denominator):
    """A resampled denominator median <= 0 gives None (as stall_metrics.ratio does), so the verdict is unresolved."""
    interval = median_ratio_interval([4.0, 6.0, 5.0], denominator)
    assert interval is None
    assert verdict(interval, 2.1, at_most=True) == UNRESOLVED
