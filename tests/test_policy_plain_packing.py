"""Tests of the general per-item packing loop (eplb_fsm.policy.plain_packing)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from eplb_fsm.policy.packing import balanced_packing, descending_order
from eplb_fsm.policy.plain_packing import _totals_stay_finite, pack_per_item
from eplb_fsm.policy.reference import _pack_rows, reference_balanced_packing

INF = float("inf")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("weights, packs", [
    ([INF, INF, 1.0, 1.0], 2),
    ([INF, INF, INF, 1.0, 1.0, 1.0], 2),
    ([3e38, 3e38, 3e38, 3e38, 1.0, 1.0], 2),  # float32 totals overflow to inf
    ([INF] * 5 + [-INF] * 4, 3),  # inf + -inf: a NaN total, then kept as the first open pack
])
def test_infinite_or_overflowing_totals_pack_like_the_reference(weights, packs, dtype):
    """Pack totals at +-inf or NaN never let a full pack be chosen: same packs as the reference."""
    with np.errstate(over="ignore", invalid="ignore"):
        expected = reference_balanced_packing(weights, packs)
    pack, rank = balanced_packing(np.array([weights], dtype=dtype), packs)
    assert (pack[0].tolist(), rank[0].tolist()) == expected


def test_random_non_finite_rows_match_the_reference_without_warnings():
    """Rows mixing +-inf, huge and ordinary weights pack as the reference does, with no overflow warning."""
    rng = np.random.default_rng(0)
    values = np.array([INF, -INF, 3e38, -3e38, 2e38, 2.0, 1.0, 0.0, -1.0], dtype=np.float32)
    for _ in range(300):
        packs, capacity, rows = (int(x) for x in rng.integers(2, 6, 3))
        w = values[rng.integers(0, values.size, (rows, packs * capacity))]
        w[rng.random(w.shape) < 0.5] = 1.0
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            pack, rank = balanced_packing(w, packs)
        with np.errstate(over="ignore", invalid="ignore"):
            ref_pack, ref_rank = _pack_rows(w, packs)
        assert np.array_equal(pack, ref_pack) and np.array_equal(rank, ref_rank)


def test_both_loops_agree_on_finite_rows():
    """On finite rows the masked loop (forced by one infinite row) places every item as the +inf-penalty loop."""
    rng = np.random.default_rng(1)
    w = rng.integers(-3, 4, (20, 24)).astype(np.float64)
    visited_t = np.ascontiguousarray(np.take_along_axis(w, descending_order(w), axis=1).T)
    penalty = pack_per_item(visited_t, 4)
    with_inf = np.concatenate([visited_t, np.full((24, 1), INF)], axis=1)
    masked = pack_per_item(with_inf, 4)
    assert all(np.array_equal(a, b[:, :20]) for a, b in zip(penalty, masked))


@pytest.mark.parametrize("weights, dtype, expected", [
    ([[1.0, -2.0, 3.0]], np.float32, True),
    ([[3e38, 1.0, 1.0]], np.float32, False),  # two items of 3e38 overflow float32
    ([[3e38, 1.0, 1.0]], np.float64, True),
    ([[1.0, -INF, 1.0]], np.float64, False),
    ([[1.0, np.nan, 1.0]], np.float64, False),
    ([[1.0, 1.0, 1.0]], np.float16, True),
])
def test_totals_stay_finite(weights, dtype, expected):
    """The bound sends infinite, NaN and possibly overflowing weights (capacity 2) to the masked loop."""
    assert _totals_stay_finite(np.array(weights, dtype=dtype), 2) is expected
