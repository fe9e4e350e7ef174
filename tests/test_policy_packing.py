"""Tests for eplb_fsm.policy.packing and keyed_packing: every packing path agrees with the one-item-at-a-time
reference."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eplb_fsm.policy.packing import (
    balanced_packing,
    descending_keys,
    descending_order,
    pack_in_rounds,
    pack_pairs,
    pack_per_item,
)
from eplb_fsm.policy.keyed_packing import finite_non_negative, keyed_packing_applies, pack_per_item_keyed
from eplb_fsm.policy.reference import reference_balanced_packing

# Few distinct values, zeros among them: ties between items and between pack totals are common.
TIE_VALUES = [0.0, 0.5, 1.0, 2.0, 3.0, 7.25, 1e-3, 1e6]


def _reference_rows(w: np.ndarray, packs: int) -> tuple[np.ndarray, np.ndarray]:
    rows = [reference_balanced_packing(list(row), packs) for row in w]
    return np.array([r[0] for r in rows]), np.array([r[1] for r in rows])


def _tie_rows(data, rows: int, items: int) -> np.ndarray:
    """(rows, items) float32 weights drawn from TIE_VALUES: many ties and zeros."""
    values = data.draw(st.lists(st.sampled_from(TIE_VALUES), min_size=rows * items, max_size=rows * items))
    return np.array(values, dtype=np.float32).reshape(rows, items)


def _visited(w: np.ndarray) -> np.ndarray:
    return np.take_along_axis(w, descending_order(w), axis=1)


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 9), st.integers(2, 9), st.integers(1, 4), st.data())
def test_rounds_equal_per_item_and_reference(packs, per_pack, rows, data):
    """pack_in_rounds, pack_per_item and the reference place every visited item alike (ties, zeros)."""
    w = _tie_rows(data, rows, packs * per_pack)
    visited = _visited(w)
    chosen, arrival = pack_in_rounds(visited, packs)
    item_chosen, item_arrival = pack_per_item(np.ascontiguousarray(visited.T), packs)
    assert np.array_equal(chosen, item_chosen.T) and np.array_equal(arrival, item_arrival.T)
    pack, rank = balanced_packing(w, packs)
    ref_pack, ref_rank = _reference_rows(w, packs)
    assert np.array_equal(pack, ref_pack) and np.array_equal(rank, ref_rank)
    for r in range(rows):
        assert (np.bincount(pack[r], minlength=packs) == per_pack).all()
        assert sorted(zip(pack[r], rank[r])) == [(p, k) for p in range(packs) for k in range(per_pack)]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("rows, items, packs", [(7, 72, 8), (3, 288, 32), (2, 320, 64), (5, 60, 3)])
def test_rounds_on_policy_sized_rows(seed, rows, items, packs):
    """Rows of the policy's sizes (zipf and lognormal loads, some rows all equal) match the reference."""
    rng = np.random.default_rng(seed)
    if seed % 2:
        w = rng.zipf(1.4, (rows, items)).astype(np.float32)
    else:
        w = rng.lognormal(0, 2, (rows, items)).astype(np.float32)
    w[0] = 5.0  # every item tied
    pack, rank = balanced_packing(w, packs)
    ref_pack, ref_rank = _reference_rows(w, packs)
    assert np.array_equal(pack, ref_pack) and np.array_equal(rank, ref_rank)


def test_rounds_when_most_items_are_zero():
    """A long tail of zero-weight items fills the lightest open pack first, lowest index on ties."""
    w = np.zeros((2, 40), dtype=np.float32)
    w[0, :3] = [9.0, 4.0, 4.0]
    w[1, 5] = 1.0
    pack, rank = balanced_packing(w, 4)
    ref_pack, ref_rank = _reference_rows(w, 4)
    assert np.array_equal(pack, ref_pack) and np.array_equal(rank, ref_rank)


@pytest.mark.parametrize("make", [
    lambda w: w.astype(np.float64),          # other float dtype: per-item path in float64
    lambda w: w - np.float32(3.0),           # negative weights: per-item path
])
def test_inputs_outside_the_rounds_path_match_the_reference(make):
    """Float64 and negative weights take the per-item path and still follow the greedy rule."""
    rng = np.random.default_rng(5)
    w = make(rng.integers(0, 6, (3, 48)).astype(np.float32))
    pack, rank = balanced_packing(w, 4)
    ref_pack, ref_rank = _reference_rows(w.astype(np.float32), 4)
    assert np.array_equal(pack, ref_pack) and np.array_equal(rank, ref_rank)


def test_infinite_weight_never_overfills_a_pack():
    """An infinite weight (allowed here, rejected by the policy) still leaves every pack at capacity."""
    w = np.ones((1, 40), dtype=np.float32)
    w[0, 3] = np.inf
    pack, _ = balanced_packing(w, 4)
    assert (np.bincount(pack[0], minlength=4) == 10).all()


def test_one_pack_ranks_follow_the_visiting_order():
    """With one pack every item lands in it, ranked by the stable descending order."""
    w = np.array([[1.0, 3.0, 3.0, 0.0, 2.0] * 5], dtype=np.float32)
    pack, rank = balanced_packing(w, 1)
    assert (pack == 0).all()
    assert np.array_equal(np.argsort(rank[0]), descending_order(w)[0])


def test_descending_keys_order_and_index():
    """Ascending keys give the stable descending order; the low 31 bits are the item index."""
    w = np.array([[2.0, -0.0, 0.0, 7.5, 2.0, -1.0, 1e30]], dtype=np.float32)
    key = descending_keys(w)
    assert np.array_equal(key & 0x7FFFFFFF, np.arange(7)[None])
    assert np.argsort(key[0]).tolist() == [6, 3, 0, 4, 1, 2, 5]


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 9), st.integers(2, 9), st.integers(1, 5), st.data())
def test_keyed_per_item_equals_per_item_and_reference(packs, per_pack, rows, data):
    """pack_per_item_keyed places every visited item as pack_per_item and the reference do (ties, zeros)."""
    w = _tie_rows(data, rows, packs * per_pack)
    order = descending_order(w)
    visited_t = np.ascontiguousarray(_visited(w).T)
    chosen, arrival = pack_per_item_keyed(visited_t, packs)
    item_chosen, item_arrival = pack_per_item(visited_t, packs)
    assert np.array_equal(chosen, item_chosen) and np.array_equal(arrival, item_arrival)
    ref_pack, ref_rank = _reference_rows(w, packs)
    visited_ref_pack = np.take_along_axis(ref_pack, order, axis=1)
    visited_ref_rank = np.take_along_axis(ref_rank, order, axis=1)
    assert np.array_equal(chosen.T, visited_ref_pack) and np.array_equal(arrival.T, visited_ref_rank)


def test_keyed_per_item_on_hierarchical_rows():
    """232 rows of 72 items into 8 packs (the hierarchical policy's replica packing) match the reference."""
    rng = np.random.default_rng(11)
    w = (rng.zipf(1.3, (232, 72)) / rng.integers(1, 4, (232, 72))).astype(np.float32)
    w[5] = 2.0  # a row of ties
    w[6, 40:] = 0.0  # a tail of zeros
    assert keyed_packing_applies(w, 8)
    pack, rank = balanced_packing(w, 8)
    ref_pack, ref_rank = _reference_rows(w, 8)
    assert np.array_equal(pack, ref_pack) and np.array_equal(rank, ref_rank)
    visited_t = np.ascontiguousarray(_visited(w).T)
    assert all(np.array_equal(a, b) for a, b in zip(pack_per_item_keyed(visited_t, 8), pack_per_item(visited_t, 8)))


def test_keyed_per_item_when_totals_overflow_to_inf():
    """A pack total that overflows float32 to inf still ranks below a full pack: packs stay at capacity."""
    w = np.full((2, 24), 3e38, dtype=np.float32)
    w[1, ::3] = 1.0
    visited_t = np.ascontiguousarray(_visited(w).T)
    with np.errstate(over="ignore"):
        ref_pack, ref_rank = _reference_rows(w, 4)
    chosen, arrival = pack_per_item_keyed(visited_t, 4)
    order = descending_order(w)
    assert np.array_equal(chosen.T, np.take_along_axis(ref_pack, order, axis=1))
    assert np.array_equal(arrival.T, np.take_along_axis(ref_rank, order, axis=1))
    for r in range(2):
        assert (np.bincount(chosen[:, r], minlength=4) == 6).all()


@pytest.mark.parametrize("make, applies", [
    (lambda w: w, True),
    (lambda w: w.astype(np.float64), False),
    (lambda w: w - np.float32(3.0), False),
    (lambda w: np.where(w == w.max(), np.float32(np.inf), w), False),
])
def test_keyed_path_takes_only_finite_non_negative_float32(make, applies):
    """keyed_packing_applies admits float32, finite, >= 0 weights and nothing else."""
    w = make(np.arange(48, dtype=np.float32).reshape(2, 24))
    assert keyed_packing_applies(w, 4) is applies


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 9), st.integers(1, 5), st.data())
def test_pack_pairs_equals_reference(packs, rows, data):
    """Packs of two items in closed form match the reference wherever pack_pairs applies (ties, zeros)."""
    values = data.draw(st.lists(st.sampled_from(TIE_VALUES), min_size=rows * 2 * packs, max_size=rows * 2 * packs))
    w = np.array(values, dtype=np.float32).reshape(rows, 2 * packs)
    order = descending_order(w)
    visited = _visited(w)
    pairs = pack_pairs(visited)
    applies = bool((visited[:, packs - 2] > 0).all())
    assert (pairs is not None) is applies
    if pairs is not None:
        ref_pack, ref_rank = _reference_rows(w, packs)
        assert np.array_equal(pairs[0], np.take_along_axis(ref_pack, order, axis=1))
        assert np.array_equal(pairs[1], np.take_along_axis(ref_rank, order, axis=1))
    pack, rank = balanced_packing(w, packs)  # through whichever path applies
    ref_pack, ref_rank = _reference_rows(w, packs)
    assert np.array_equal(pack, ref_pack) and np.array_equal(rank, ref_rank)


def test_pack_pairs_declines_negative_or_float64_rows():
    """pack_pairs returns None for a negative first-half item or a float64 input; second-half signs do not matter."""
    assert pack_pairs(np.array([[5.0, -1.0, -2.0, -3.0]], dtype=np.float32)) is None
    pack, rank = pack_pairs(np.array([[5.0, 4.0, 3.0, -1.0, -2.0, -3.0]], dtype=np.float32))
    assert pack.tolist() == [[0, 1, 2, 2, 1, 0]] and rank.tolist() == [[0, 0, 0, 1, 1, 1]]
    assert pack_pairs(np.array([[5.0, 4.0, 3.0, 2.0]])) is None
    assert pack_pairs(np.array([[5.0, 4.0, 3.0, 2.0]], dtype=np.float32)) is not None


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 12), st.booleans(), st.data())
def test_descending_keys_both_layouts_give_the_stable_descending_order(rows, items, signed, data):
    """Rows >= 0 (two-half keys) or with -0.0 / negatives (shifted) sort stably descending, index in the low 31 bits."""
    w = _tie_rows(data, rows, items)
    if signed:
        w[0, 0] = data.draw(st.sampled_from([-0.0, -1.0]))
    key = descending_keys(w)
    expected = np.argsort(-(w + np.float32(0.0)), axis=1, kind="stable")
    assert np.array_equal(np.argsort(key, axis=1), expected)
    assert np.array_equal(key & 0x7FFFFFFF, np.broadcast_to(np.arange(items), w.shape))


@pytest.mark.parametrize("weight, expected", [
    (np.array([[0.0, -0.0, 3.5]], dtype=np.float32), True),
    (np.zeros((2, 0), dtype=np.float32), True),
    (np.array([[1.0, -1e-30]], dtype=np.float32), False),
    (np.array([[1.0, np.inf]], dtype=np.float32), False),
    (np.array([[1.0, np.nan]], dtype=np.float64), False),
])
def test_finite_non_negative(weight, expected):
    """finite_non_negative is True exactly for arrays without NaN, infinities or negative entries."""
    assert finite_non_negative(weight) is expected


@pytest.mark.parametrize("loop", ["rounds", "keyed"])
def test_first_items_shortcut_with_negative_zero_matches_the_reference(loop):
    """A -0.0 among the first m visited items makes a +0.0 total in both key loops, so they pack like the reference."""
    w = np.array([[2.0, 1.0] + [-0.0] * 7, [1.0] * 4 + [-0.0] * 5], dtype=np.float32)
    visited = _visited(w)
    if loop == "rounds":
        chosen, arrival = pack_in_rounds(visited, 3)
    else:
        chosen, arrival = (a.T for a in pack_per_item_keyed(np.ascontiguousarray(visited.T), 3))
    ref_pack, ref_rank = _reference_rows(w, 3)
    order = descending_order(w)
    assert np.array_equal(chosen, np.take_along_axis(ref_pack, order, axis=1))
    assert np.array_equal(arrival, np.take_along_axis(ref_rank, order, axis=1))
