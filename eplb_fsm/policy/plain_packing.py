"""Greedy packing one item position at a time, on float running totals: the general path.

:func:`pack_per_item` is the per-item greedy rule of :mod:`eplb_fsm.policy.packing`
(lightest open pack, lowest pack index on ties, items in visiting order) for any float
dtype and sign, infinities included. It takes what the key paths cannot (float64,
negative or non-finite weights) and wins on small packings.

Two loops give the same answer:

- while every pack total provably stays finite (the usual case), a full pack gets +inf
  added as its last item arrives, which takes it out of ``argmin``'s reach: one
  ``argmin`` per item position;
- otherwise (an infinite weight, or totals that may overflow) a pack at +inf could tie
  a full one, and -inf + inf makes a NaN total, so fullness is a separate mask and the
  choice follows the reference's ``min`` over the open packs, NaN included.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["pack_per_item"]

# (largest finite value, machine epsilon) of each float dtype seen, as Python floats.
_LIMITS: dict[np.dtype, tuple[float, float]] = {}


def pack_per_item(sorted_w: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy packing one item position at a time over all rows (any float dtype).

    Args:
        sorted_w: (n, R) — transposed: row k holds every row's k-th visited item.
        num_packs: m dividing n, capacity n / m >= 2.

    Returns:
        ``chosen`` (n, R) int64: pack of the k-th visited item of each row; ``arrival``
        (n, R): its position in that pack.
    """
    num_items, num_rows = sorted_w.shape
    capacity = num_items // num_packs
    totals = np.zeros((num_rows, num_packs), dtype=sorted_w.dtype)
    counts = np.zeros((num_rows, num_packs), dtype=np.int64)
    chosen = np.empty((num_items, num_rows), dtype=np.int64)
    arrival = np.empty((num_items, num_rows), dtype=np.int64)
    first = 0
    if num_packs > 1 and (sorted_w[num_packs - 2] > 0).all():
        # Shortcut, exact: while the first m - 1 visited items are all > 0, the k-th of them
        # (k < m) finds packs 0..k-1 non-empty with positive totals and pack k empty at 0, so
        # it goes to pack k. Capacity >= 2 here, so no pack is full yet.
        first = num_packs
        chosen[:first] = np.arange(num_packs, dtype=np.int64)[:, None]
        arrival[:first] = 0
        totals[:] = sorted_w[:first].T
        counts[:] = 1
    loop = _penalty_loop if _totals_stay_finite(sorted_w, capacity) else _masked_loop
    loop(sorted_w, first, capacity, totals, counts, chosen, arrival)
    return chosen, arrival


def _totals_stay_finite(sorted_w: np.ndarray, capacity: int) -> bool:
    """Whether no pack total can reach +-inf: ``capacity`` items of the largest magnitude,
    each addition rounding up by at most a factor (1 + eps), stay below the dtype's max.

    False for a NaN or infinite weight. Two reductions, no temporary array.
    """
    if sorted_w.size == 0:
        return True
    limits = _LIMITS.get(sorted_w.dtype)
    if limits is None:  # np.finfo costs microseconds per call, a sizeable share of a small packing
        info = np.finfo(sorted_w.dtype)
        limits = _LIMITS[sorted_w.dtype] = (float(info.max), float(info.eps))
    top, eps = limits
    # In Python floats: no overflow warnings, and a NaN (numpy's max and min propagate it)
    # fails the comparison. A longdouble above float's range becomes inf and fails too.
    high, low = float(sorted_w.max()), -float(sorted_w.min())
    largest = high if high >= low else low
    return largest * capacity * math.exp(min(capacity * eps, 700.0)) < top


def _penalty_loop(sorted_w, first, capacity, totals, counts, chosen, arrival) -> None:
    """The packing loop for finite totals: a full pack's total becomes +inf, above every open one.

    ``argmin`` returns the first minimum, i.e. the lowest pack index among the lightest.
    """
    num_rows, num_packs = totals.shape
    flat_totals = totals.reshape(-1)
    flat_counts = counts.reshape(-1)
    row_base = np.arange(num_rows, dtype=np.int64) * num_packs
    full_penalty = np.zeros(capacity, dtype=totals.dtype)  # indexed by the count before adding
    full_penalty[-1] = np.inf
    next_count = np.arange(1, capacity + 1, dtype=np.int64)
    argmin = totals.argmin
    for k in range(first, sorted_w.shape[0]):
        pack = argmin(axis=1, out=chosen[k])
        flat = row_base + pack
        count = flat_counts[flat]
        arrival[k] = count
        flat_counts[flat] = next_count[count]
        # x + 0 == x exactly, so live totals are plain running sums in the weights' dtype.
        flat_totals[flat] = flat_totals[flat] + (sorted_w[k] + full_penalty[count])


def _masked_loop(sorted_w, first, capacity, totals, counts, chosen, arrival) -> None:
    """The packing loop for totals that may be +-inf or NaN: fullness is a mask, not a total.

    The reference picks ``min(open packs, key=total)``: it keeps the first open pack and
    moves only to a strictly smaller total. So a NaN first open pack is kept; otherwise
    NaN totals are never taken, and among the smallest the lowest index wins, +inf included.
    """
    num_rows = totals.shape[0]
    rows = np.arange(num_rows)
    with np.errstate(over="ignore", invalid="ignore"):  # inf totals and -inf + inf = NaN are expected
        for k in range(first, sorted_w.shape[0]):
            is_open = counts < capacity
            nan = np.isnan(totals)
            masked = np.where(is_open & ~nan, totals, np.inf)
            pack = masked.argmin(axis=1)
            at_inf = masked[rows, pack] == np.inf
            if at_inf.any():  # argmin's first +inf may be a full or NaN pack: take the first open one at +inf
                open_inf = is_open & (totals == np.inf)
                pack = np.where(at_inf & open_inf.any(axis=1), open_inf.argmax(axis=1), pack)
            first_open = is_open.argmax(axis=1)
            pack = np.where(nan[rows, first_open], first_open, pack)
            chosen[k] = pack
            arrival[k] = counts[rows, pack]
            counts[rows, pack] += 1
            totals[rows, pack] += sorted_w[k]
