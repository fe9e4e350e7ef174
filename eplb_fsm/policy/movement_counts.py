"""Replica counts before the local search: one pass for experts far above the default's per-replica load.

A hot expert with too few replicas keeps every rank that holds it overloaded, and the
local search would need one re-point per missing replica, a round each. This pass gives
all of them in one go: expert e wants ``ceil(w_e / cap) - c_e`` more replicas; an
expert can spare the replicas it has above ``max(1, ceil(w_e / cap))``. In every
(layer, node) as many replicas change hands as both sides allow: the neediest experts
(largest load per replica) are served first and the experts that suffer least (smallest
load per replica after giving one up) give first. A giver frees its slots on its
lightest ranks, and the heaviest new replicas go to the lightest of those ranks. Every
change is one re-pointed slot, within each layer's move limit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from eplb_fsm.policy.movement_search import SearchState

__all__ = ["COUNT_CAP", "rebalance_counts"]

# Experts whose load per replica exceeds this multiple of the default's largest load per
# replica get more replicas before the search.
COUNT_CAP = 2.0


def _node_major(node: np.ndarray, key: np.ndarray) -> np.ndarray:
    """Expert order by (node, key): ``(n, N), (n, N) -> (n, N)``."""
    span = np.abs(key).max(initial=0.0) * 4 + 1.0
    return np.argsort(node * span + key, axis=1)


def _take(amount: np.ndarray, order: np.ndarray, node: np.ndarray, moves: np.ndarray) -> np.ndarray:
    """Take up to ``moves[l, node]`` units from ``amount`` (n, N), experts in ``order`` (n, N)."""
    width = moves.shape[1]
    order = (order + (np.arange(order.shape[0]) * order.shape[1])[:, None]).ravel()  # flat
    a = amount.ravel()[order].reshape(amount.shape)
    before = np.cumsum(a, 1) - a  # units before e (in its layer)
    if width == 1:
        got = np.clip(moves - before, 0, a)
    else:
        nd = node.ravel()[order].reshape(amount.shape)
        start_of_node = np.take_along_axis(before, np.argmax(nd[:, :, None] == np.arange(width), 1), 1)
        before -= np.take_along_axis(start_of_node, nd, 1)  # units of this node before e
        got = np.clip(np.take_along_axis(moves, nd, 1) - before, 0, a)
    out = np.empty(amount.size, dtype=amount.dtype)
    out[order] = got.ravel()
    return out.reshape(amount.shape)


def rebalance_counts(st: "SearchState", cap: np.ndarray) -> None:
    """Re-point slots of ``st`` so that no expert's load per replica exceeds ``cap`` (A,) where
    givers allow (module docstring); updates ``st`` in place."""
    w, count = st.w, st.count
    floor = np.maximum(np.ceil(w / np.maximum(cap, 1e-300)[:, None] - 1e-9), 1).astype(np.int64)
    need = np.maximum(floor - count, 0)
    some = need.any(1)
    if not some.any():
        return
    rows = np.flatnonzero(some)
    w, count, floor, need = w[rows], count[rows], floor[rows], need[rows]
    n, N, P, width = rows.size, st.N, st.P, st.nodes
    spare = np.maximum(count - floor, 0)
    node = st.node_of_expert[rows]  # (n, N)
    flat_node = (node + width * np.arange(n)[:, None]).ravel()
    total_need = np.bincount(flat_node, need.ravel(), minlength=n * width).reshape(n, width)
    total_spare = np.bincount(flat_node, spare.ravel(), minlength=n * width).reshape(n, width)
    moves = np.minimum(total_need, total_spare).astype(np.int64)  # replicas changing hands per node
    # within the layer's move limit (each change moves at most one slot), nodes in order
    room = np.maximum(st.limit[rows] - st.moves[rows], 0)[:, None]
    moves = np.clip(room - (np.cumsum(moves, 1) - moves), 0, moves)
    if not moves.any():
        return

    take_order = _node_major(node, -(w / count))  # neediest first
    gets = _take(need, take_order, node, moves)
    gives = _take(spare, _node_major(node, w / np.maximum(count - 1, 1)), node, moves)  # least harmed first
    # each giver frees its slots on its lightest ranks
    cur = st.cur[rows]
    slot_load = st.rank_load[rows][:, st.rank_of_slot]  # (n, P) load of each slot's rank
    span = slot_load.max(initial=0.0) * 4 + 1.0
    order = np.argsort(cur * span + slot_load, axis=1)  # by expert, then rank load
    sorted_e = np.take_along_axis(cur, order, 1)
    first = np.cumsum(count, 1) - count
    pos = np.arange(P)[None, :] - np.take_along_axis(first, sorted_e, 1)
    freed = np.zeros((n, P), bool)
    np.put_along_axis(freed, order, pos < np.take_along_axis(gives, sorted_e, 1), 1)
    # freed slots node-major, lightest rank first; new replicas node-major, heaviest first
    slot_node = st.node_of_rank[st.rank_of_slot][None, :]
    total = moves.sum(1)
    kmax = int(total.max())
    slots = np.argsort(np.where(freed, slot_node * span + slot_load, np.inf), axis=1)[:, :kmax]
    # item j of a layer goes to the expert whose run of new replicas covers j
    ends = np.cumsum(np.take_along_axis(gets, take_order, 1), 1)  # (n, N), ends[:, -1] = total
    item = np.arange(kmax)
    offset = (np.arange(n) * (int(ends[:, -1].max()) + 1))[:, None]
    at = np.searchsorted((ends + offset).ravel(), (item[None, :] + offset).ravel(), side="right")
    at = at.reshape(n, kmax) - np.arange(n)[:, None] * N
    taker = np.take_along_axis(take_order, np.clip(at, 0, N - 1), 1)
    valid = item[None, :] < total[:, None]
    r = np.broadcast_to(rows[:, None], valid.shape)[valid]
    st.recount(r, slots[valid], taker[valid], distinct=False)
