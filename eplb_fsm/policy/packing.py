"""Balanced packing, vectorised over rows: the hot loop of the default policy.

:func:`balanced_packing` ``(R, n), m -> pack_index (R, n), rank_in_pack (R, n)`` packs the
n items of every row into m packs of n / m items each, greedily: items are visited by
descending weight (stable: equal weights go lowest index first) and each goes to the open
pack with the smallest running total (lowest pack index on ties). This is the rule of
docs/design.md §5 and of :func:`eplb_fsm.policy.reference.reference_balanced_packing`.

Exact implementations that give the same answer:

- the *rounds* path (float32, finite, non-negative weights: what the policy passes) gives
  each row several items per numpy step (see :func:`pack_in_rounds`), so the number of
  Python iterations is about n / m instead of n;
- the *per-item* paths (:func:`~eplb_fsm.policy.keyed_packing.pack_per_item_keyed` for
  the same inputs, :func:`~eplb_fsm.policy.plain_packing.pack_per_item` for any float
  input) visit one item position per iteration, over all rows at once.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from eplb_fsm.maps import as_count, host_array
from eplb_fsm.policy.keyed_packing import finite_non_negative, keyed_packing_applies, pack_per_item_keyed
from eplb_fsm.policy.plain_packing import pack_per_item

__all__ = [
    "balanced_packing",
    "descending_keys",
    "descending_order",
    "float_rows",
    "pack_in_rounds",
    "pack_pairs",
    "pack_per_item",
    "pack_visited",
    "row_offsets",
]


# Largest int64 key: marks a full pack, above every open pack's key.
_FULL = np.iinfo(np.int64).max


def float_rows(weight: Any, name: str = "weight") -> np.ndarray:
    """A 2-D float numpy view of ``weight`` (torch or numpy); non-float input becomes float32."""
    arr = host_array(weight, name)
    if arr.ndim != 2:
        raise ValueError(f"{name} must be 2-D (rows, items), got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.floating):
        arr = arr.astype(np.float32)
    if np.isnan(arr).any():
        raise ValueError(f"{name} must not contain NaN")
    return arr


def row_offsets(num_rows: int, width: int) -> np.ndarray:
    """(R, 1) offsets that turn a column index into an index of the flattened (R, width) array."""
    return (np.arange(num_rows, dtype=np.int64) * width)[:, None]


def descending_keys(weight: np.ndarray) -> np.ndarray:
    """Unique int64 sort keys of a float32 ``(R, n)`` array: ascending key = descending weight.

    Key = order-preserving bit pattern of the weight (-0.0 counts as 0.0), reversed, then
    the item index in the low 31 bits (``key & 0x7FFFFFFF``), so equal weights order by
    ascending index. Needs n < 2**31.
    """
    num_items = weight.shape[1]
    bits = weight.view(np.int32) if weight.flags.c_contiguous else np.ascontiguousarray(weight).view(np.int32)
    if sys.byteorder == "little" and bits.min() >= 0:
        # No sign bit set (the policy's case: loads >= 0, no -0.0): the reversed bits fit 31
        # bits, so key = reversed << 32 | index, written as the two int32 halves of each
        # key (little-endian: low half first) in two passes instead of five.
        key = np.empty(weight.shape, dtype=np.int64)
        halves = key.view(np.int32)
        np.bitwise_xor(bits, 0x7FFFFFFF, out=halves[:, 1::2])  # 0x7FFFFFFF - bits, for bits >= 0
        halves[:, 0::2] = np.arange(num_items, dtype=np.int32)
        return key
    bits = (weight + np.float32(0.0)).view(np.int32)  # + 0 turns -0.0 into 0.0
    key = bits.astype(np.int64)
    if bits.min() < 0:  # negative weights: their bit patterns order backwards, flip all but the sign
        key ^= (key >> 31) & 0x7FFFFFFF  # now the same order as the floats, in [-2**31, 2**31)
    # In place, as the policy calls this on every packing: each temporary costs a pass.
    np.subtract(0x7FFFFFFF, key, out=key)
    key <<= 31
    key |= np.arange(num_items, dtype=np.int64)
    return key


def descending_order(weight: np.ndarray) -> np.ndarray:
    """Stable descending order of every row: ``(R, n) float -> (R, n)`` int64 item indices.

    Equal weights keep ascending index order (-0.0 counts as 0.0). For float32 the sort
    runs on :func:`descending_keys`, which numpy sorts several times faster than a stable
    argsort of the floats.
    """
    if weight.dtype != np.float32 or weight.shape[1] >= 2**31:
        return np.argsort(-weight, axis=1, kind="stable")
    key = descending_keys(weight)
    key.sort(axis=1)
    return key & 0x7FFFFFFF


def _flat_visiting_order(w: np.ndarray) -> np.ndarray:
    """:func:`descending_order` as flat indices ``(R * n,)``: row * n + item, row by row.

    For float32 the keys are sorted and turned into indices in place: no temporaries.
    """
    num_rows, num_items = w.shape
    if w.dtype != np.float32 or num_items >= 2**31:
        return (descending_order(w) + row_offsets(num_rows, num_items)).reshape(-1)
    key = descending_keys(w)
    key.sort(axis=1)
    key &= 0x7FFFFFFF
    key += row_offsets(num_rows, num_items)
    return key.reshape(-1)


def balanced_packing(weight: Any, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack the n items of every row into ``num_packs`` packs of exactly n / num_packs items.

    Args:
        weight: (R, n) item weights, numpy or torch, no NaN; R independent rows. Float
            inputs keep their dtype (the policy passes float32), others are cast to float32.
        num_packs: m, an integer (not a float or bool: ``ValueError`` naming it) dividing n.

    Returns:
        ``pack_index`` (R, n) int64: the pack of each item, and ``rank_in_pack`` (R, n)
        int64: its position in that pack, in order of arrival.

    Totals are accumulated one item at a time in the weight's dtype. With n / m == 1
    every item gets its own pack (identity); with m == 1 the rank is the visiting position.
    """
    num_packs = as_count(num_packs, "num_packs")
    w = float_rows(weight)
    num_rows, num_items = w.shape
    flat_order, chosen, arrival = pack_visited(w, num_packs)
    pack_index = np.empty(num_rows * num_items, dtype=np.int64)
    rank_in_pack = np.empty(num_rows * num_items, dtype=np.int64)
    pack_index[flat_order] = chosen.reshape(-1)
    rank_in_pack[flat_order] = arrival.reshape(-1)
    return pack_index.reshape(num_rows, num_items), rank_in_pack.reshape(num_rows, num_items)


def pack_visited(w: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`balanced_packing` in visiting order, for callers that need no per-item arrays.

    Args:
        w: (R, n) float numpy array, no NaN (see :func:`float_rows`).
        num_packs: m, a divisor of n.

    Returns:
        ``flat_order`` (R * n,) int64: the flat index (row * n + item) of each row's k-th
        visited item; ``chosen`` and ``arrival`` (R, n) int64: its pack and its position there.
    """
    num_rows, num_items = w.shape
    if num_packs < 1 or num_items % num_packs != 0:
        raise ValueError(f"num_packs ({num_packs}) must be >= 1 and divide the number of items ({num_items})")
    capacity = num_items // num_packs
    if capacity == 1 or num_rows == 0:  # item i alone in pack i, whatever the order
        identity = np.broadcast_to(np.arange(num_items, dtype=np.int64), (num_rows, num_items))
        return np.arange(num_rows * num_items, dtype=np.int64), identity.copy(), np.zeros_like(identity)

    flat_order = _flat_visiting_order(w)
    if num_packs == 1:
        chosen = np.zeros((num_rows, num_items), dtype=np.int64)
        arrival = np.broadcast_to(np.arange(num_items, dtype=np.int64), (num_rows, num_items))
    elif capacity == 2 and (pairs := pack_pairs(w.reshape(-1)[flat_order].reshape(num_rows, num_items))):
        chosen, arrival = pairs
    elif (path := _cheapest_path(num_rows, num_items, num_packs)) == "rounds" and _rounds_apply(w, num_packs, capacity):
        chosen, arrival = pack_in_rounds(w.reshape(-1)[flat_order].reshape(num_rows, num_items), num_packs)
    else:
        sorted_w = w.reshape(-1)[flat_order.reshape(num_rows, num_items).T]  # (n, R), C-contiguous
        keyed = path == "keyed" and keyed_packing_applies(w, num_packs)
        per_item = pack_per_item_keyed if keyed else pack_per_item
        chosen, arrival = (a.T for a in per_item(sorted_w, num_packs))
    return flat_order, chosen, arrival


def pack_pairs(sorted_w: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Greedy packing into packs of two items, in closed form; None where it does not apply.

    Args:
        sorted_w: (R, 2m) float32, row r's items in visiting order (descending).

    Returns:
        ``chosen``, ``arrival`` (R, 2m) int64 as :func:`pack_in_rounds`, or None unless
        every row's first m - 1 items are > 0 and its m-th is finite and >= 0.

    Under that condition item k < m goes to the empty pack k (packs 0..k-1 hold positive
    totals), and each later item fills the lightest pack still holding one item: the
    second half goes to the packs in ascending (total, index) order, whatever its weights.
    The 8 groups of DeepSeek-V3 onto 4 nodes are such a packing.
    """
    num_rows, num_items = sorted_w.shape
    half = num_items // 2
    first = sorted_w[:, :half] + np.float32(0.0)  # pack totals; + 0 turns -0.0 into 0.0
    if (
        sorted_w.dtype != np.float32
        or sys.byteorder != "little"
        or not (sorted_w[:, half - 2] > 0).all()
        or not (first[:, half - 1] >= 0).all()
        or not np.isfinite(first[:, 0]).all()
    ):
        return None
    # Key = total's bits (ordered like the values for totals >= 0), then the pack index.
    key = first.view(np.int32).astype(np.int64) << 32
    key |= np.arange(half, dtype=np.int64)
    key.sort(axis=1)
    chosen = np.empty((num_rows, num_items), dtype=np.int64)
    chosen[:, :half] = np.arange(half, dtype=np.int64)
    np.bitwise_and(key, 0xFFFFFFFF, out=chosen[:, half:])
    arrival = np.zeros((num_rows, num_items), dtype=np.int64)
    arrival[:, half:] = 1
    return chosen, arrival


def _cheapest_path(num_rows: int, num_items: int, num_packs: int) -> str:
    """``"rounds"``, ``"keyed"`` or ``"plain"``: the packing loop a cost model (in us) expects fastest.

    - plain (:func:`pack_per_item`): n - m iterations, ~4 us each plus ~35 ns per row
      (its ``argmin`` over the packs of every row);
    - keyed (:func:`pack_per_item_keyed`): ~30 us of setup, then n - m iterations of ~5 us
      plus ~7 ns per row and ~0.4 ns per (row, pack) key;
    - rounds (:func:`pack_in_rounds`): about 1.5 n / m + 3 steps (rows that take few items
      per step add a tail), each ~25 us plus ~12 ns per key.

    Measured on the 2-core test box: rounds win 2-4x on the DeepSeek-V3 global and Qwen3
    shapes; keyed wins ~1.5x on the hierarchical shape's 232 (layer, node) rows of 72
    replicas into 8 ranks; plain wins on a few dozen such rows and on tiny packings.
    """
    iterations = num_items - num_packs
    costs = {
        "plain": iterations * (4.0 + 0.035 * num_rows),
        "keyed": 30.0 + iterations * (5.0 + 0.007 * num_rows + 0.0004 * num_rows * num_packs),
        "rounds": (1.5 * num_items / num_packs + 3.0) * (25.0 + 0.012 * num_rows * (num_packs + 1)),
    }
    return min(costs, key=costs.__getitem__)


def _rounds_apply(w: np.ndarray, num_packs: int, capacity: int) -> bool:
    """Whether :func:`pack_in_rounds` can take ``w``: its keys need float32 totals >= 0 and room in 32 bits."""
    count_bits = int(capacity).bit_length()
    return (
        w.dtype == np.float32
        and sys.byteorder == "little"  # the key's high half is read as the float32 total
        and (num_packs << count_bits) < 2**31
        and finite_non_negative(w)
    )


def pack_in_rounds(sorted_w: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy packing of items already in visiting order, several items per row per step.

    Args:
        sorted_w: (R, n) float32, finite, >= 0; row r's items in visiting order (descending).
        num_packs: m >= 2 dividing n.

    Returns:
        ``chosen`` (R, n) int64: the pack of the k-th visited item; ``arrival`` (R, n): its
        position in that pack.

    Each pack is one int64 key: the float32 bits of its total (high half; for totals >= 0
    the bit patterns order like the values), then the pack index, then its item count
    (low half), so keys order like (total, pack index), the greedy rule's order; a full
    pack's key is the largest int64. A step sorts every row's keys: q_0 < q_1 < ... With
    the row's next items w_0 >= w_1 >= ..., item j goes to q_j for every j in the prefix
    where q_j stays below each updated key (q_i's total + w_i, i < j): that is exactly
    where the one-item-at-a-time greedy would put them, since the untouched packs' smallest
    key is q_j. A row whose lightest pack is full is done (its items are all placed).
    """
    num_rows, num_items = sorted_w.shape
    capacity = num_items // num_packs
    count_bits = int(capacity).bit_length()
    count_mask = (1 << count_bits) - 1
    # Keys are (R, m + 1): column m is a _FULL sentinel that stays last and is never taken,
    # so the taken prefix's length is the first False along a row. Element-wise work runs
    # on flat 1-D views, which numpy iterates without a per-row overhead.
    keys_width = num_packs + 1
    width = num_items + keys_width  # padded: a step reads m + 1 items from a row's next one
    padded = np.zeros((num_rows, width), dtype=np.float32)
    padded[:, :num_items] = sorted_w
    record = np.empty((num_rows, width), dtype=np.int64)  # key each visited item met, by position
    # Row i of these (overlapping, read-only for items) views is the m + 1 positions from
    # flat position i, so one index per row reads or writes a whole step's window.
    # (np.ndarray over the buffer: as_strided builds the same view several microseconds slower.)
    windows = padded.size - keys_width + 1
    item_windows = np.ndarray((windows, keys_width), np.float32, buffer=padded, strides=(4, 4))
    record_windows = np.ndarray((windows, keys_width), np.int64, buffer=record, strides=(8, 8))

    keys = np.full((num_rows, keys_width), _FULL, dtype=np.int64)
    keys[:, :num_packs] = np.arange(num_packs, dtype=np.int64) << count_bits
    first_step = 0
    if (sorted_w[:, num_packs - 2] > 0).all():
        # Exact shortcut (as in pack_per_item): while the first m - 1 items are > 0, item k < m
        # finds packs 0..k-1 heavier than the empty pack k, so the first m go to packs 0..m-1.
        record[:, :num_packs] = keys[:, :num_packs]
        keys[:, :num_packs] += 1
        # + 0.0 turns a -0.0 load into a +0.0 total: a set sign bit would order below every key
        np.add(sorted_w[:, :num_packs], np.float32(0.0), out=keys[:, :num_packs].view(np.float32)[:, 1::2])
        first_step = 1
    # fill[low half] is _FULL where the count reaches capacity: np.maximum then marks the pack full.
    fill = np.zeros(num_packs << count_bits, dtype=np.int64)
    fill[(np.arange(num_packs) << count_bits) + capacity] = _FULL
    row_start = row_offsets(num_rows, width)[:, 0]
    next_item = row_start + first_step * num_packs  # flat index of each row's next item
    row_end = row_start + num_items
    live = num_rows + 1
    for step in range(first_step, num_items):  # each step places >= 1 item of every unfinished row
        if len(keys) < live:  # fewer rows than the buffers: size them to the live rows
            live = len(keys)
            updated = np.empty(live * keys_width, dtype=np.int64)
            lowest = np.empty((live, keys_width), dtype=np.int64)
            taken = np.empty((live, keys_width), dtype=bool)
            updated_total = updated.view(np.float32)[1::2]  # high half of each key (little-endian)
            updated_low = updated.view(np.uint32)[0::2]
            lowest_flat, taken_flat = lowest.reshape(-1), taken.reshape(-1)
        flat_keys = keys.reshape(-1)
        keys.sort(axis=1)
        items = item_windows[next_item]
        record_windows[next_item] = keys  # items past the taken prefix are rewritten by a later step
        np.add(flat_keys, 1, out=updated)  # count + 1 (_FULL wraps: such keys are never taken)
        np.add(flat_keys.view(np.float32)[1::2], items.reshape(-1), out=updated_total)  # float32 running sum
        np.maximum(updated, fill.take(updated_low), out=updated)
        np.minimum.accumulate(updated.reshape(live, keys_width), axis=1, out=lowest)
        # q_j is taken if below the updated keys of q_0..q_{j-1}; the flat shift compares
        # column 0 with the previous row, so column 0 is set after: taken if the pack is open.
        # Taken is a prefix: once q_j >= that minimum, every later (larger) q stays above it.
        np.less(flat_keys[1:], lowest_flat[:-1], out=taken_flat[1:])
        np.not_equal(keys[:, 0], _FULL, out=taken[:, 0])
        np.copyto(flat_keys, updated, where=taken_flat)
        next_item += taken.argmin(axis=1)
        if step < capacity - 1:  # a step places <= 1 item per pack: no row is done before `capacity` steps
            continue
        unfinished = next_item != row_end
        still = int(np.count_nonzero(unfinished))
        if still == 0:
            break
        if 4 * still <= 3 * len(keys):  # drop finished rows: the per-row costs shrink with them
            keys, next_item, row_end = keys[unfinished], next_item[unfinished], row_end[unfinished]
    else:  # pragma: no cover - the greedy rule always places the lightest open pack's item
        raise AssertionError("pack_in_rounds: a row made no progress")

    low = record[:, :num_items] & 0xFFFFFFFF
    return low >> count_bits, low & count_mask
