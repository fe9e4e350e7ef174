"""The default policy: greedy replication and balanced packing, hierarchical when possible.

docs/design.md §5 fixes the behaviour; this module is the fast implementation. Every loop
runs over item *positions* (at most a few hundred iterations) and each iteration is a
handful of numpy operations over all rows at once (rows = layers, or layers x nodes), so
the cost does not grow with a Python loop per layer. The slow, one-item-at-a-time
version that the outputs are checked against is :mod:`eplb_fsm.policy.reference`.

Helpers that other policies build on:

- :func:`balanced_packing` ``(R, n), m -> pack_index (R, n), rank_in_pack (R, n)``
- :func:`replicate_experts` ``(R, n), p -> phy2log (R, p), replica_rank (R, p), replica_count (R, n)``
- :func:`inverse_permutation` ``(R, n) -> (R, n)``
- :func:`descending_order` ``(R, n) -> (R, n)``: the stable visiting order of balanced packing
- :func:`group_loads` ``(L, N), groups -> (L, groups)`` float32, summed the way the reference does
- :func:`slots_of_experts` ``(L, P), (L, N) -> (L, N, K)``: log2phy of a full placement
- :func:`rebalance_hierarchical` the whole docs/design.md §5 pipeline on a float32 load, in numpy
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from eplb_fsm.maps import as_count
from eplb_fsm.policy import native
from eplb_fsm.policy.base import AbstractEplbPolicy, check_rebalance_args
from eplb_fsm.policy.packing import (
    balanced_packing,
    descending_order,
    float_rows,
    pack_visited,
    row_offsets,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "DefaultEplbPolicy",
    "balanced_packing",
    "descending_order",
    "group_loads",
    "inverse_permutation",
    "rebalance_hierarchical",
    "replicate_experts",
    "slots_of_experts",
]


# torch runs an op inline (no thread-pool dispatch) below this many elements (its grain size).
_SERIAL_ELEMENTS = 32768


def replicate_experts(weight: Any, num_slots: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Spread n experts over ``num_slots`` >= n slots, giving extra slots to the hottest.

    Args:
        weight: (R, n) expert loads, numpy or torch (float dtype kept, others -> float32).
        num_slots: p >= n, an integer (not a float or bool: ``ValueError`` naming it).

    Returns:
        ``phy2log`` (R, p) int64: expert of each slot; ``replica_rank`` (R, p) int64: the
        index of that replica among its expert's copies; ``replica_count`` (R, n) int64.

    Slot i < n holds expert i. Each further slot goes to the expert with the largest
    load / current replica count (computed in the weight's dtype; ties to the lowest
    expert index); the replica's rank is the expert's count before it was added.
    """
    num_slots = as_count(num_slots, "num_slots")
    w = float_rows(weight)
    if num_slots < w.shape[1]:
        raise ValueError(f"num_slots ({num_slots}) must be >= the number of experts ({w.shape[1]})")
    phy2log, replica_rank, replica_count, _ = _replicate(w, num_slots)
    return phy2log, replica_rank, replica_count


def _replicate(w: np.ndarray, num_slots: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`replicate_experts` on a checked float (R, n) array, plus each expert's final
    load per replica (R, n) in w's dtype: w / count, the loads balanced packing then packs."""
    num_rows, num_experts = w.shape
    phy2log = np.empty((num_rows, num_slots), dtype=np.int64)
    replica_rank = np.zeros((num_rows, num_slots), dtype=np.int64)
    phy2log[:, :num_experts] = np.arange(num_experts, dtype=np.int64)
    replica_count = np.ones((num_rows, num_experts), dtype=np.int64)
    per_replica = w.copy()  # load / count, updated only where a count changes
    if num_slots == num_experts or num_rows == 0:
        return phy2log, replica_rank, replica_count, per_replica

    flat_w = np.ascontiguousarray(w).reshape(-1)
    flat_per_replica = per_replica.reshape(-1)
    flat_count = replica_count.reshape(-1)
    row_base = np.arange(num_rows, dtype=np.int64) * num_experts
    # Array operands and a lookup of each count as a float: a Python scalar operand or an
    # astype costs a ufunc call more than the work on a few hundred rows.
    count_value = np.arange(num_slots - num_experts + 2, dtype=w.dtype)
    one = np.ones(num_rows, dtype=np.int64)
    expert = np.empty(num_rows, dtype=np.int64)
    flat = np.empty(num_rows, dtype=np.int64)
    for slot in range(num_experts, num_slots):
        per_replica.argmax(axis=1, out=expert)  # first maximum = lowest expert index
        np.add(row_base, expert, out=flat)
        count = flat_count[flat]
        phy2log[:, slot] = expert
        replica_rank[:, slot] = count
        np.add(count, one, out=count)
        flat_count[flat] = count
        flat_per_replica[flat] = flat_w[flat] / count_value[count]
    return phy2log, replica_rank, replica_count, per_replica


def inverse_permutation(perm: np.ndarray) -> np.ndarray:
    """Row-wise inverse of a permutation: ``(R, n) -> (R, n)`` with ``inv[r, perm[r, i]] = i``."""
    perm = np.asarray(perm, dtype=np.int64)
    num_rows, n = perm.shape
    inv = np.empty(num_rows * n, dtype=np.int64)
    inv[(perm + row_offsets(num_rows, n)).reshape(-1)] = np.tile(np.arange(n, dtype=np.int64), num_rows)
    return inv.reshape(num_rows, n)


def group_loads(weight32: "torch.Tensor | np.ndarray", num_groups: int) -> np.ndarray:
    """Load of each expert group: ``(L, N) float32 -> (L, num_groups)`` float32.

    Groups are N / num_groups contiguous experts. The sum is torch's float32 reduction,
    the same call the reference makes, so both see bit-identical group loads. It runs in
    blocks of fewer than 32K elements: torch hands larger inputs to its thread pool,
    whose dispatch costs several times the sum itself; each row's sum is the same
    kernel either way, so the blocks change no bit.
    """
    import torch

    w = weight32 if isinstance(weight32, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(weight32))
    num_layers, num_experts = w.shape
    grouped = w.to(torch.float32).reshape(num_layers, num_groups, num_experts // num_groups)
    block = max(1, (_SERIAL_ELEMENTS - 1) // num_experts)  # layers per block
    if num_layers <= block:
        return grouped.sum(-1).numpy()
    out = torch.empty((num_layers, num_groups), dtype=torch.float32)
    for start in range(0, num_layers, block):
        torch.sum(grouped[start : start + block], -1, out=out[start : start + block])
    return out.numpy()


def slots_of_experts(phy2log: np.ndarray, replica_count: np.ndarray, max_replicas: int) -> np.ndarray:
    """``log2phy`` of a full placement: ``(L, P), (L, N) -> (L, N, max_replicas)`` int64.

    Every slot holds an expert (no -1) and every expert has a slot (``replica_count``
    >= 1), so the slots of each expert, ascending, are one sort of (expert, slot) keys per
    layer away; the -1 padding is the only write that scales with the output's size.
    ``ValueError`` if a slot holds no expert in [0, N), an expert has no slot or more than
    ``max_replicas``: the C and numpy paths name the same rule (the first one the C scan
    meets, layer by layer and slot by slot).
    """
    num_layers, num_slots = phy2log.shape
    num_experts = replica_count.shape[1]
    if native.available():  # one pass over the slots in C (policy/cnative.c)
        return native.slots_of_experts(phy2log, num_experts, max_replicas)
    if phy2log.size and (phy2log.min() < 0 or phy2log.max() >= num_experts):
        _raise_bad_placement(phy2log, num_experts, max_replicas)
    # key = (layer * N + expert) << bits | slot: a row's sort groups it by expert, slots
    # ascending, and the high bits are the expert's flat (layer, expert) index. int32 when
    # it fits: numpy sorts that ~2x faster than int64.
    bits = int(num_slots - 1).bit_length()
    key_type = np.int32 if ((num_layers * num_experts) << bits) < 2**31 else np.int64
    key = phy2log.astype(key_type)
    key += (np.arange(num_layers, dtype=key_type) * num_experts)[:, None]
    key <<= bits
    key |= np.arange(num_slots, dtype=key_type)
    key.sort(axis=1)
    key = key.reshape(-1)
    # int64 (intp) outputs: numpy indexes and scatters with them without a cast buffer.
    slot = np.bitwise_and(key, (1 << bits) - 1, dtype=np.int64)
    expert = np.right_shift(key, bits, dtype=np.int64)  # flat (layer, expert) of each sorted slot
    # Every expert has a slot, so the sorted positions where the expert changes are, in
    # order, the first sorted position of each (layer, expert): no cumsum of the counts.
    starts = np.empty(key.size, dtype=bool)
    starts[0] = True
    np.not_equal(expert[1:], expert[:-1], out=starts[1:])
    first = np.flatnonzero(starts)  # (L * N,)
    if first.size != num_layers * num_experts or (
        max_replicas < num_slots and int(np.diff(first, append=key.size).max()) > max_replicas
    ):
        _raise_bad_placement(phy2log, num_experts, max_replicas)
    # The k-th sorted slot is replica k - first[expert] of its expert: its destination is
    # start[expert] + k with start = (layer * N + expert) * max_replicas - first.
    start = np.arange(0, num_layers * num_experts * max_replicas, max_replicas, dtype=np.int64)
    start -= first
    dest = start[expert]
    dest += np.arange(key.size, dtype=np.int64)
    # The -1 padding is the one write that scales with the output (3.9 MB on DeepSeek-V3):
    # -1 is all 0xFF bytes, and a byte fill (memset) runs ~1.5x faster than np.full's int64
    # loop; torch.full is no better, as it hands large fills to its thread pool.
    log2phy = np.empty(num_layers * num_experts * max_replicas, dtype=np.int64)
    log2phy.view(np.uint8).fill(0xFF)
    log2phy[dest] = slot
    return log2phy.reshape(num_layers, num_experts, max_replicas)


def _raise_bad_placement(phy2log: np.ndarray, num_experts: int, max_replicas: int) -> None:
    """Raise the ``ValueError`` the C ``slots_of_experts`` raises for this bad placement.

    C scans layer by layer, each layer's slots in order, and stops at the first slot that
    holds no expert in [0, N) or is an expert's replica number ``max_replicas + 1``; a
    layer it scans through, with some expert left without a slot, stops it there.
    """
    for row in np.asarray(phy2log):
        in_range = (row >= 0) & (row < num_experts)
        expert = np.where(in_range, row, num_experts)  # out-of-range slots apart, as one pseudo-expert
        order = np.argsort(expert, kind="stable")
        ranked = expert[order]
        is_start = np.r_[True, ranked[1:] != ranked[:-1]]
        start = np.maximum.accumulate(np.where(is_start, np.arange(row.size), 0))
        replica = np.empty(row.size, dtype=np.int64)
        replica[order] = np.arange(row.size) - start  # copies of the slot's expert in earlier slots
        bad = ~in_range | (replica >= max_replicas)
        if bad.any():
            if not in_range[bad.argmax()]:
                raise ValueError("slots_of_experts: every slot must hold an expert in [0, experts)")
            raise ValueError("slots_of_experts: an expert has more slots than max_replicas")
        if np.bincount(row, minlength=num_experts).min() == 0:
            raise ValueError("slots_of_experts: every expert needs at least one slot")
    raise AssertionError("slots_of_experts: a placement failed the check, yet no layer breaks a rule")


def rebalance_hierarchical(
    weight32: "torch.Tensor",
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_ranks: int,
) -> tuple[np.ndarray, np.ndarray]:
    """docs/design.md §5 on validated input.

    Args:
        weight32: (L, N) float32 load, a CPU tensor or numpy array, validated (see
            ``check_rebalance_args``: finite, non-negative).
        num_replicas, num_groups, num_nodes, num_ranks: P, groups, nodes, G with
            N % groups == 0, groups % nodes == 0, G % nodes == 0, P % G == 0
            (pass groups = nodes = 1 for the global mode).

    Returns:
        ``phy2log`` (L, P) and ``replica_count`` (L, N), int64.
    """
    if hasattr(weight32, "detach"):  # torch tensor
        weight32 = weight32.detach().cpu().numpy()
    w = np.ascontiguousarray(weight32, dtype=np.float32)
    if native.available():  # the whole pipeline, layer by layer in C (policy/cnative.c): the same placement
        group_load = group_loads(w, num_groups) if num_groups > 1 else None
        return native.place_layers(w, group_load, num_replicas, num_groups, num_nodes, num_ranks)
    num_layers, num_experts = w.shape
    group_size = num_experts // num_groups
    groups_per_node = num_groups // num_nodes
    experts_per_node = num_experts // num_nodes
    slots_per_node = num_replicas // num_nodes
    ranks_per_node = num_ranks // num_nodes
    slots_per_rank = num_replicas // num_ranks
    rows = num_layers * num_nodes  # one row per (layer, node) from step 2 on
    in_group = np.arange(group_size, dtype=np.int64)

    # 1. Groups onto nodes. "mlog" is the node-major expert order: a group's new position
    #    is node * groups_per_node + its arrival in the node's pack; experts keep their
    #    order inside the group.
    if num_groups == 1:
        mlog2log = None
        w_mlog = w
    else:
        # Work on group rows: (L * groups, group_size) views, row l * groups + g = group g of layer l.
        group_offsets = row_offsets(num_layers, num_groups)
        visit, group_pack, group_rank = pack_visited(group_loads(w, num_groups), num_nodes)
        group_row_at = np.empty(num_layers * num_groups, dtype=np.int64)  # group row at each position row
        group_row_at[(group_pack * groups_per_node + group_rank + group_offsets).reshape(-1)] = visit
        group_at = group_row_at.reshape(num_layers, num_groups) - group_offsets  # (L, groups)
        mlog2log = (group_at[:, :, None] * group_size + in_group).reshape(num_layers, num_experts)
        w_mlog = w.reshape(num_layers * num_groups, group_size)[group_row_at].reshape(num_layers, num_experts)

    w_node = w_mlog.reshape(rows, experts_per_node)

    # 2. Replicate within each node.
    phy2mlog, _, mlog_count, per_replica = _replicate(w_node, slots_per_node)  # (rows, spn), (rows, epn) x2

    # 3. Pack each node's replicas onto its ranks; a replica's load is float32 load / count.
    # Flat (row, expert in node) of every replica: also its flat (layer, mlog) index.
    replica_mlog = phy2mlog + row_offsets(rows, experts_per_node)
    replica_load = per_replica.reshape(-1)[replica_mlog]
    # In visiting order: the scatter below places each replica directly (no per-item arrays).
    visit, pack, rank_in_pack = pack_visited(replica_load.reshape(rows, slots_per_node), ranks_per_node)

    # 4. Slot of every replica, and its global expert id.
    if mlog2log is None:
        expert = phy2mlog  # one node: mlog ids are log ids
        replica_count = mlog_count.reshape(num_layers, num_experts)
    else:
        expert = mlog2log.reshape(-1)[replica_mlog]  # (rows, slots_per_node) log ids
        replica_count = np.empty((num_layers * num_groups, group_size), dtype=np.int64)
        replica_count[group_row_at] = mlog_count.reshape(num_layers * num_groups, group_size)
        replica_count = replica_count.reshape(num_layers, num_experts)
    # Flat (layer, node, slot) of each visited replica. pack and rank_in_pack may be
    # transposed views: the index arrays keep their layout (no copy to ravel them).
    slot = pack * slots_per_rank
    slot += rank_in_pack
    slot += row_offsets(rows, slots_per_node)
    phy2log = np.empty(num_layers * num_replicas, dtype=np.int64)
    phy2log[slot] = expert.reshape(-1)[visit.reshape(rows, slots_per_node)]
    return phy2log.reshape(num_layers, num_replicas), np.ascontiguousarray(replica_count)


class DefaultEplbPolicy(AbstractEplbPolicy):
    """Greedy replication + balanced packing (docs/design.md §5), vectorised over layers.

    Hierarchical (groups packed onto nodes, then replicas onto each node's ranks) when
    ``num_groups % num_nodes == 0``; otherwise the same with groups = nodes = 1.
    ``old_phy2log`` is validated and ignored.
    """

    name = "default"

    @classmethod
    def rebalance_experts(
        cls,
        weight: "torch.Tensor",
        num_replicas: int,
        num_groups: int,
        num_nodes: int,
        num_ranks: int,
        old_phy2log: "torch.Tensor | None" = None,
    ) -> tuple["torch.Tensor", "torch.Tensor", "torch.Tensor"]:
        """Return ``(phy2log (L, P), log2phy (L, N, P-N+1), replica_count (L, N))``, int64 CPU tensors."""
        import torch

        weight32, num_replicas, groups, nodes, num_ranks = check_rebalance_args(
            weight, num_replicas, num_groups, num_nodes, num_ranks, old_phy2log
        )
        num_experts = weight32.shape[1]
        phy2log, replica_count = rebalance_hierarchical(weight32, num_replicas, groups, nodes, num_ranks)
        log2phy = slots_of_experts(phy2log, replica_count, num_replicas - num_experts + 1)
        return torch.from_numpy(phy2log), torch.from_numpy(log2phy), torch.from_numpy(replica_count)
