"""Greedy packing one item position at a time, on int64 keys reduced across packs.

:func:`pack_per_item_keyed` is the per-item greedy rule of :mod:`eplb_fsm.policy.packing`
(lightest open pack, lowest pack index on ties, items in visiting order) for float32,
finite, non-negative weights. It exists for shapes with many rows and few packs (the
hierarchical policy's 232 (layer, node) rows of 72 replicas into 8 ranks), where numpy's
``argmin(axis=1)`` over 8 columns costs ~28 ns per row: here the pack choice is one
``minimum.reduce`` over the pack axis of a (packs, rows) array, a vector operation.
"""

from __future__ import annotations

import sys

import numpy as np

__all__ = ["finite_non_negative", "keyed_packing_applies", "pack_per_item_keyed"]

# Largest int64 key: marks a full pack, above every open pack's key.
_FULL = np.iinfo(np.int64).max


def _low_bits(num_rows: int, num_packs: int, capacity: int) -> tuple[int, int, bool]:
    """Bits of the item count and of the row index, and whether pack, row and count fit 32 bits."""
    count_bits = int(capacity).bit_length()
    row_bits = int(max(num_rows - 1, 1)).bit_length()
    return count_bits, row_bits, (num_packs << (row_bits + count_bits)) <= 2**32


def finite_non_negative(w: np.ndarray) -> bool:
    """Whether every entry of the float array ``w`` is finite and >= 0 (False for NaN).

    Two reductions and no temporary: ``isfinite(w).all()`` and ``(w < 0).any()`` each
    build a boolean array first.
    """
    return w.size == 0 or bool(w.min() >= 0 and w.max() < np.inf)


def keyed_packing_applies(w: np.ndarray, num_packs: int) -> bool:
    """Whether :func:`pack_per_item_keyed` can take ``w`` (R, n): float32, finite, >= 0, keys in 64 bits."""
    num_rows, num_items = w.shape
    return (
        w.dtype == np.float32
        and sys.byteorder == "little"  # the key's high half is read as the float32 total
        and _low_bits(num_rows, num_packs, num_items // num_packs)[2]
        and finite_non_negative(w)
    )


def pack_per_item_keyed(sorted_w: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy packing of items already in visiting order, one item position per step.

    Args:
        sorted_w: (n, R) float32, finite, >= 0 — transposed: row k holds every row's k-th
            visited item (descending within each of the R rows).
        num_packs: m >= 2 dividing n, capacity n / m >= 2.

    Returns:
        ``chosen`` (n, R) int64: pack of the k-th visited item of each row; ``arrival``
        (n, R) int64: its position in that pack.

    Pack p of row r is the int64 key at ``keys[p, r]``: the float32 bits of its total in
    the high half (for totals >= 0 the bit patterns order like the values), then in the
    low half the key's own flat index ``p << row_bits | r`` (rows padded to a power of two,
    so the pack is a shift away) and the pack's item count.
    Within a column r the keys order like (total, pack index): the greedy rule's order,
    so the column minimum is the chosen pack, and its low half says where to write the
    updated key back. A full pack's key is the largest int64 (an open pack's total may
    overflow to inf and still order below it).
    """
    num_items, num_rows = sorted_w.shape
    capacity = num_items // num_packs
    count_bits, row_bits, _ = _low_bits(num_rows, num_packs, capacity)
    count_mask = (1 << count_bits) - 1
    padded_keys = (np.arange(num_packs << row_bits, dtype=np.int64) << count_bits).reshape(num_packs, -1)
    flat_keys = padded_keys.reshape(-1)
    keys = padded_keys[:, :num_rows]  # the padding columns are never read
    # record[k] = the key item k met: its pack and its count before arriving.
    record = np.empty((num_items, num_rows), dtype=np.int64)
    record_low = record.view(np.uint32)[:, 0::2]  # little-endian: the low half comes first
    record_total = record.view(np.float32)[:, 1::2]
    first = 0
    if (sorted_w[num_packs - 2] > 0).all():
        # Exact shortcut (as in pack_per_item): while the first m - 1 visited items are > 0,
        # item k < m finds packs 0..k-1 heavier than the empty pack k, so it goes to pack k.
        first = num_packs
        record[:first] = keys
        keys += 1
        # + 0.0 turns a -0.0 load into a +0.0 total: a set sign bit would order below every key
        np.add(sorted_w[:first], np.float32(0.0), out=keys.view(np.float32)[:, 1::2])
    # full_at[count an item meets] is _FULL where that item fills its pack.
    # The loop's ufuncs take array operands and write into preallocated buffers: a Python
    # scalar operand or a take(out=...) costs more than the work on a few hundred rows.
    full_at = np.zeros(count_mask + 1, dtype=np.int64)
    full_at[capacity - 1] = _FULL
    low_mask = np.full(num_rows, 0xFFFFFFFF, dtype=np.int64)
    count_masks = np.full(num_rows, count_mask, dtype=np.int64)
    count = np.empty(num_rows, dtype=np.int64)
    shift = np.full(num_rows, count_bits, dtype=np.int64)
    one = np.ones(num_rows, dtype=np.int64)
    low = np.empty(num_rows, dtype=np.int64)
    slot = np.empty(num_rows, dtype=np.int64)
    updated = np.empty(num_rows, dtype=np.int64)
    updated_total = updated.view(np.float32)[1::2]
    minimum, bitwise_and, right_shift, add, maximum = (
        np.minimum.reduce, np.bitwise_and, np.right_shift, np.add, np.maximum)
    with np.errstate(over="ignore"):  # a total may overflow to inf: it still orders below _FULL
        for k in range(first, num_items):
            chosen_key = record[k]
            minimum(keys, axis=0, out=chosen_key)
            bitwise_and(chosen_key, low_mask, out=low)
            right_shift(low, shift, out=slot)
            add(chosen_key, one, out=updated)  # count + 1 in the low bits
            add(record_total[k], sorted_w[k], out=updated_total)  # float32 running sum
            bitwise_and(low, count_masks, out=count)
            maximum(updated, full_at[count], out=updated)
            flat_keys[slot] = updated
    low = record_low.astype(np.int64)
    return low >> (count_bits + row_bits), low & count_mask
