"""The default policy's row loops in C, where the optional extension is built.

``eplb_fsm/policy/cnative.c`` with its row kernels in ``cnative_rows.c`` (built by
setup.py at install, ``optional``: skipped where no C compiler is found) runs the
placement of every layer in one call (groups onto nodes, then replication + balanced
packing of each node's experts onto its ranks), and builds ``log2phy``, with the GIL
released; ``place_rows`` is the per-row step alone. The numpy implementation
(:mod:`eplb_fsm.policy.default`, :mod:`eplb_fsm.policy.packing`) defines the results;
the C loops follow the same
float32 arithmetic in the same order, so both give bit-identical placements (the tests
run both). :func:`available` says whether the C path is used: the extension imported,
and the environment variable ``EPLB_FSM_NATIVE`` is not ``0`` (read at each call, so a
test or a benchmark can compare both in one process).
"""

from __future__ import annotations

import os

import numpy as np

try:
    from eplb_fsm.policy.cnative import (
        place_layers as _place_layers,
        place_rows as _place_rows,
        slots_of_experts as _slots_of_experts,
    )
except ImportError:  # not built (no compiler at install): the numpy path is used
    _place_layers = _place_rows = _slots_of_experts = None

__all__ = ["available", "built", "place_layers", "place_rows", "slots_of_experts"]


def built() -> bool:
    """Whether the C extension was built and imports."""
    return _place_rows is not None


def available() -> bool:
    """Whether the default policy takes the C path now (built, and ``EPLB_FSM_NATIVE`` is not ``0``)."""
    return _place_rows is not None and os.environ.get("EPLB_FSM_NATIVE", "1") != "0"


def place_rows(w: np.ndarray, num_slots: int, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Replicate and pack every row: ``(R, n) float32, p, m -> slot_item (R, p), count (R, n)`` int64.

    ``w``: finite, >= 0 (the policy's checked load). Slot i < n first holds item i and
    each further slot goes to the item with the largest load / replicas (first maximum);
    the p replicas, each with its item's final load / replicas, are packed greedily into
    m packs of p / m (descending load, ties by replica index; lightest open pack, lowest
    on ties). ``slot_item[r, pack * (p / m) + arrival]`` is the item of that replica.
    Same result as ``default._replicate`` followed by ``packing.pack_visited``.
    """
    w = np.ascontiguousarray(w, dtype=np.float32)
    rows, items = w.shape
    slot_item = np.empty((rows, num_slots), dtype=np.int64)
    count = np.empty((rows, items), dtype=np.int64)
    _place_rows(w, slot_item, count, rows, items, int(num_slots), int(num_packs))
    return slot_item, count


def place_layers(
    w: np.ndarray, group_load: np.ndarray | None, num_slots: int, num_groups: int, num_nodes: int, num_ranks: int
) -> tuple[np.ndarray, np.ndarray]:
    """The whole docs/design.md §5 placement: ``(L, N) float32 -> phy2log (L, P), replica_count (L, N)`` int64.

    ``w``: finite, >= 0 (the policy's checked load); ``group_load``: (L, groups) float32,
    each group's load as ``default.group_loads`` sums it (None when ``num_groups`` is 1).
    The arguments obey ``check_rebalance_args``'s rules (groups = nodes = 1: the global
    mode). Same result as ``default.rebalance_hierarchical``'s numpy path: groups packed
    onto nodes, then each node's experts replicated and packed onto its ranks, in one call.
    """
    w = np.ascontiguousarray(w, dtype=np.float32)
    layers, experts = w.shape
    group_load = w[:, :0] if group_load is None else np.ascontiguousarray(group_load, dtype=np.float32)
    phy2log = np.empty((layers, num_slots), dtype=np.int64)
    replica_count = np.empty((layers, experts), dtype=np.int64)
    _place_layers(w, group_load, phy2log, replica_count, layers, experts, int(num_groups), int(num_nodes),
                  int(num_slots), int(num_ranks))
    return phy2log, replica_count


def slots_of_experts(phy2log: np.ndarray, num_experts: int, max_replicas: int) -> np.ndarray:
    """``log2phy`` of a full placement: ``(L, P) int64 -> (L, N, max_replicas)`` int64, -1 padded.

    Raises ``ValueError`` if a slot holds no expert in [0, N), an expert has no slot, or
    more than ``max_replicas``.
    """
    phy2log = np.ascontiguousarray(phy2log, dtype=np.int64)
    layers, slots = phy2log.shape
    out = np.empty((layers, num_experts, max_replicas), dtype=np.int64)
    _slots_of_experts(phy2log, out, layers, slots, int(num_experts), int(max_replicas))
    return out
