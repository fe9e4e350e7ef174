"""What a rearrangement costs in expert-weight transfers, and placements that cost less.

A slot is *moved* when the expert it holds after a rearrangement was not on its rank
before: its weights must cross the network (``scenarios.json``: ``moved_slots``).
Everything that stays on a rank is free, whatever row it ends up in.

- :func:`rank_membership` ``phy2log (L, P) -> (L, G, N)`` bool: expert e was on rank g.
- :func:`moved_slots` ``old (L, P), new (L, P) -> (L, P)`` bool.
- :func:`relabel_ranks` renumbers the ranks of a placement (whole nodes first when the
  placement is hierarchical) so that as many slots as possible find their expert already
  on their rank; balancedness does not change, because it only depends on which slots
  share a rank, not on the rank's number.
- :func:`align_rows` orders the slots of every rank so that an expert that stays on a
  rank keeps the row it had, which turns moves inside a rank into no-ops.

All functions are numpy, vectorised over layers (and ranks); inputs are int64 arrays with
-1 for an empty slot.
"""

from __future__ import annotations

import numpy as np

__all__ = ["align_rows", "moved_slots", "rank_membership", "relabel_ranks"]


def rank_membership(phy2log: np.ndarray, num_ranks: int, num_experts: int) -> np.ndarray:
    """``(L, P) -> (L, G, N)`` bool: ``out[l, g, e]`` when some slot of rank g holds e in layer l."""
    phy2log = np.asarray(phy2log, dtype=np.int64)
    num_layers, num_slots = phy2log.shape
    slots_per_rank = num_slots // num_ranks
    # One extra expert column collects the empty slots (-1) and is dropped.
    width = num_experts + 1
    expert = np.where(phy2log >= 0, phy2log, num_experts)
    rank = np.arange(num_slots, dtype=np.int64) // slots_per_rank
    flat = (np.arange(num_layers, dtype=np.int64)[:, None] * num_ranks + rank[None, :]) * width + expert
    seen = np.bincount(flat.ravel(), minlength=num_layers * num_ranks * width) > 0
    return seen.reshape(num_layers, num_ranks, width)[:, :, :num_experts]


def moved_slots(old_phy2log: np.ndarray, new_phy2log: np.ndarray, num_ranks: int) -> np.ndarray:
    """``(L, P)`` bool: slots whose new expert was not on their rank in the old placement.

    Empty new slots (-1) are never moved.
    """
    old = np.asarray(old_phy2log, dtype=np.int64)
    new = np.asarray(new_phy2log, dtype=np.int64)
    if old.shape != new.shape or old.ndim != 2:
        raise ValueError(f"old and new placements must have the same 2-D shape, got {old.shape} and {new.shape}")
    num_experts = int(max(old.max(initial=-1), new.max(initial=-1))) + 1
    member = rank_membership(old, num_ranks, max(num_experts, 1))
    return _moved_given_membership(member, new)


def _moved_given_membership(member: np.ndarray, new: np.ndarray) -> np.ndarray:
    num_layers, num_slots = new.shape
    num_ranks = member.shape[1]
    rank = np.arange(num_slots, dtype=np.int64) // (num_slots // num_ranks)
    held = member[np.arange(num_layers)[:, None], rank[None, :], np.maximum(new, 0)]
    return (new >= 0) & ~held


def _greedy_assignment(score: np.ndarray, max_rounds: int = 2) -> np.ndarray:
    """Row-wise matching of a square score matrix ``(R, A, A)`` by rounds of proposals.

    Every round, each unmatched row index proposes to its best unmatched column and each
    column accepts its best proposer (ties: the lower index); a small bonus that decays
    with |row - column| makes equal scores spread out and keeps the identity when nothing
    is gained. After ``max_rounds`` rounds the rest is matched in index order. Returns
    ``target (R, A)``: the column matched to each row index. A greedy matching, not an
    optimal assignment.
    """
    num_rows, size, _ = score.shape
    idx = np.arange(size)
    bonus = 1e-3 / (1.0 + np.abs(idx[:, None] - idx[None, :]))
    work = score.astype(np.float64) + bonus[None]
    target = np.full((num_rows, size), -1, dtype=np.int64)
    row_free = np.ones((num_rows, size), dtype=bool)
    col_free = np.ones((num_rows, size), dtype=bool)
    rows = np.arange(num_rows)[:, None]
    for _ in range(max_rounds):
        if not row_free.any():
            break
        masked = np.where(row_free[:, :, None] & col_free[:, None, :], work, -np.inf)
        choice = masked.argmax(2)  # (R, A) best free column of each row index
        value = np.take_along_axis(masked, choice[:, :, None], 2)[:, :, 0]
        proposal = np.where(row_free & np.isfinite(value), value, -np.inf)
        # each column keeps its best proposer
        offers = np.where(choice[:, :, None] == idx[None, None, :], proposal[:, :, None], -np.inf)
        winner = offers.argmax(1)  # (R, A) per column
        won = np.isfinite(np.take_along_axis(offers, winner[:, None, :], 1)[:, 0, :])
        r, col = np.nonzero(won)
        q = winner[r, col]
        target[r, q] = col
        row_free[r, q] = False
        col_free[r, col] = False
    # whatever is left (little overlap anyway) is matched in index order
    left = row_free.sum(1)
    if left.any():
        free_rows = np.argsort(~row_free, axis=1, kind="stable")  # free row indices first, ascending
        free_cols = np.argsort(~col_free, axis=1, kind="stable")
        k = np.arange(size)[None, :] < left[:, None]
        r = np.broadcast_to(np.arange(num_rows)[:, None], k.shape)[k]
        target[r, free_rows[k]] = free_cols[k]
    return target


def relabel_ranks(
    new_phy2log: np.ndarray,
    old_member: np.ndarray,
    num_ranks: int,
    num_nodes: int = 1,
) -> np.ndarray:
    """Renumber the ranks of ``new_phy2log`` to keep as many experts where they were.

    Args:
        new_phy2log: (L, P) placement to renumber.
        old_member: (L, G, N) :func:`rank_membership` of the old placement (any strides).
        num_ranks: G.
        num_nodes: with more than one node, whole nodes are matched first (by how many
            slots of a new node hold experts that lived on the old node) and ranks only
            inside matched nodes, so a hierarchical placement stays hierarchical.

    Returns the renumbered (L, P) placement: rank blocks of S slots are permuted (and
    nodes' blocks of ranks), the contents of each block unchanged. The matching is
    greedy (:func:`_greedy_assignment`), not an optimal assignment.
    """
    new = np.asarray(new_phy2log, dtype=np.int64)
    num_layers, num_slots = new.shape
    slots_per_rank = num_slots // num_ranks
    ranks_per_node = num_ranks // num_nodes
    rows = np.arange(num_layers)[:, None]
    # overlap[l, q, g]: slots of new rank q whose expert lived on old rank g
    held = old_member[rows, :, np.maximum(new, 0)] & (new >= 0)[:, :, None]  # (L, P, G)
    overlap = held.reshape(num_layers, num_ranks, slots_per_rank, num_ranks).sum(2, dtype=np.int32)
    if num_nodes > 1:
        blocks = overlap.reshape(num_layers, num_nodes, ranks_per_node, num_nodes, ranks_per_node)
        node_target = _greedy_assignment(blocks.sum((2, 4)))  # new node -> old node
        # ranks are matched only inside matched nodes: one (ranks_per_node)^2 block per new node
        sub = np.take_along_axis(blocks, node_target[:, :, None, None, None], axis=3)[:, :, :, 0, :]
        inner = _greedy_assignment(sub.reshape(num_layers * num_nodes, ranks_per_node, ranks_per_node))
        target = (node_target[:, :, None] * ranks_per_node + inner.reshape(num_layers, num_nodes, ranks_per_node))
        target = target.reshape(num_layers, num_ranks)
    else:
        target = _greedy_assignment(overlap)  # new rank q -> rank number g
    out = np.empty_like(new)
    out.reshape(num_layers, num_ranks, slots_per_rank)[rows, target] = new.reshape(
        num_layers, num_ranks, slots_per_rank
    )
    return out


def align_rows(old_phy2log: np.ndarray, new_phy2log: np.ndarray, num_ranks: int) -> np.ndarray:
    """Reorder the slots inside every rank of ``new_phy2log`` to match the old rows.

    For every rank, an expert that it held before and still holds keeps (one of) its old
    rows; the other experts fill the remaining rows in their original order. Only the
    order within a rank changes, so the set of moved slots and the balancedness are the
    same; unchanged rows need no copy at all.
    """
    old = np.asarray(old_phy2log, dtype=np.int64)
    new = np.asarray(new_phy2log, dtype=np.int64)
    num_layers, num_slots = new.shape
    slots_per_rank = num_slots // num_ranks
    old_rows = old.reshape(-1, slots_per_rank)
    new_rows = new.reshape(-1, slots_per_rank)
    out = np.full_like(new_rows, -2)
    used = np.zeros(new_rows.shape, dtype=bool)
    blocks = np.arange(new_rows.shape[0])
    for row in range(slots_per_rank):
        want = old_rows[:, row]
        match = (new_rows == want[:, None]) & ~used & (want[:, None] >= 0)
        hit = match.any(axis=1)
        pos = match.argmax(axis=1)
        out[hit, row] = want[hit]
        used[blocks[hit], pos[hit]] = True
    # fill the rows nobody claimed with the unused new experts, in order
    free_rows = out == -2
    rest_order = np.argsort(used, axis=1, kind="stable")  # unused first, in original order
    rest = np.take_along_axis(new_rows, rest_order, axis=1)
    fill_rank = np.cumsum(free_rows, axis=1) - 1  # k-th free row takes the k-th unused expert
    filled = np.take_along_axis(rest, np.maximum(fill_rank, 0), axis=1)
    out = np.where(free_rows, filled, out)
    return out.reshape(num_layers, num_slots)
