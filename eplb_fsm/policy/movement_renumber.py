"""Placements that move fewer slots: rank renumbering and row alignment.

Balancedness only depends on which slots share a rank, not on the rank's number, and a
move only happens when an expert is new to its rank (:mod:`eplb_fsm.policy.movement_cost`).
So a fresh placement (the default policy's) can be made cheaper without changing its
quality:

- :func:`relabel_ranks` renumbers its ranks (whole nodes first when the placement is
  hierarchical) so that as many slots as possible find their expert already on their rank;
- :func:`align_rows` orders the slots of every rank so that an expert that stays on a
  rank keeps the row it had, which turns moves inside a rank into no-ops;
- :func:`renumbered_default` does both: the movement-aware policy's fallback.

All functions are numpy, vectorised over layers (and ranks); inputs are int64 arrays with
-1 for an empty slot.
"""

from __future__ import annotations

import numpy as np

from eplb_fsm.policy.movement_cost import rank_index, membership, moves_per_layer

__all__ = ["align_rows", "relabel_ranks", "renumbered_default"]


def _greedy_assignment(score: np.ndarray, max_rounds: int = 2) -> np.ndarray:
    """Row-wise matching of a square integer score matrix ``(R, A, A)`` by rounds of proposals.

    Every round, each unmatched row index proposes to its best unmatched column and each
    column accepts its best proposer (ties: the lower index); between equal scores the
    column (proposer) nearer to the row index (column) wins, which spreads equal scores
    out and keeps the identity when nothing is gained. After ``max_rounds`` rounds the
    rest is matched in index order. Returns ``target (R, A)``: the column matched to each
    row index. A greedy matching, not an optimal assignment.

    Scores are integers (shared slots), so one int32 key ``score * 2A - |row - column|``
    orders candidates by score, then by nearness; int32 halves the float64 traffic.
    """
    num_rows, size, _ = score.shape
    idx = np.arange(size)
    taken = -(2**30)  # added to a column once it is matched; far below any real key
    work = score.astype(np.int32) * np.int32(2 * size) - np.abs(idx[:, None] - idx[None, :]).astype(np.int32)
    target = np.full((num_rows, size), -1, dtype=np.int64)
    row_free = np.ones((num_rows, size), dtype=bool)
    col_block = np.zeros((num_rows, 1, size), dtype=np.int32)
    for round_index in range(max_rounds):
        masked = work if round_index == 0 else work + col_block
        choice = masked.argmax(2)  # (R, A): best free column of each row index
        value = np.take_along_axis(masked, choice[:, :, None], 2)[:, :, 0]
        r, q = np.nonzero(row_free & (value > taken // 2))
        if r.size == 0:
            break
        col = choice[r, q]
        # each column accepts its best proposer, lowest row index on ties: sort the
        # proposals by (layer, column, -value, row) and keep the first of every column
        key = r * size + col
        order = np.lexsort((q, -value[r, q], key))
        key = key[order]
        first = np.ones(order.size, dtype=bool)
        first[1:] = key[1:] != key[:-1]
        win = order[first]
        target[r[win], q[win]] = col[win]
        row_free[r[win], q[win]] = False
        col_block[r[win], 0, col[win]] = taken
    # whatever is left (little overlap anyway) is matched in index order
    left = row_free.sum(1)
    if left.any():
        col_free = col_block[:, 0, :] == 0
        free_rows = np.argsort(~row_free, axis=1, kind="stable")  # free row indices first, ascending
        free_cols = np.argsort(~col_free, axis=1, kind="stable")
        k = np.arange(size)[None, :] < left[:, None]
        r = np.broadcast_to(np.arange(num_rows)[:, None], k.shape)[k]
        target[r, free_rows[k]] = free_cols[k]
    return target


def _overlap(new: np.ndarray, held: np.ndarray) -> np.ndarray:
    """``new (L, P), held (L, N, G) -> (L, G, G)``: slots of new rank q whose expert old rank g held."""
    num_layers, num_slots = new.shape
    _, num_experts, num_ranks = held.shape
    slots_per_rank = num_slots // num_ranks
    flat = (np.maximum(new, 0) + num_experts * np.arange(num_layers)[:, None]).ravel()
    rows = held.reshape(num_layers * num_experts, num_ranks)[flat]  # (L * P, G): who held each slot's expert
    if (new < 0).any():
        rows &= (new >= 0).reshape(-1, 1)
    rows = rows.view(np.uint8).reshape(num_layers, num_ranks, slots_per_rank, num_ranks)
    out = rows[:, :, 0].astype(np.int32)
    for row in range(1, slots_per_rank):  # S adds of (L, G, G) beat a reduction over a middle axis
        out += rows[:, :, row]
    return out


def relabel_ranks(
    new_phy2log: np.ndarray,
    old_member: np.ndarray,
    num_ranks: int,
    num_nodes: int = 1,
) -> np.ndarray:
    """Renumber the ranks of ``new_phy2log`` to keep as many experts where they were.

    Args:
        new_phy2log: (L, P) placement to renumber.
        old_member: (L, G, N) :func:`rank_membership` of the old placement (any strides;
            the transpose of an (L, N, G) array is cheapest).
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
    held = np.ascontiguousarray(np.asarray(old_member, dtype=bool).transpose(0, 2, 1))  # (L, N, G)
    overlap = _overlap(new, held)  # overlap[l, q, g], int32
    if num_nodes > 1:
        blocks = overlap.reshape(num_layers, num_nodes, ranks_per_node, num_nodes, ranks_per_node)
        node_target = _greedy_assignment(blocks.sum((2, 4)))  # new node -> old node
        # ranks are matched only inside matched nodes: one (ranks_per_node)^2 block per new node
        sub = np.take_along_axis(blocks, node_target[:, :, None, None, None], axis=3)[:, :, :, 0, :]
        inner = _greedy_assignment(sub.reshape(num_layers * num_nodes, ranks_per_node, ranks_per_node))
        target = node_target[:, :, None] * ranks_per_node + inner.reshape(num_layers, num_nodes, ranks_per_node)
        target = target.reshape(num_layers, num_ranks)
    else:
        target = _greedy_assignment(overlap)  # new rank q -> rank number g
    out = np.empty_like(new)
    out.reshape(num_layers, num_ranks, slots_per_rank)[rows, target] = new.reshape(
        num_layers, num_ranks, slots_per_rank
    )
    return out


def _first_come_rows(old_rows: np.ndarray, new_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row by row: old row i keeps its expert if an unused new entry holds it (the first such).

    ``(B, S), (B, S) -> hit (B, S)`` (old rows kept), ``used (B, S)`` (new entries taken).
    """
    used = np.zeros(new_rows.shape, dtype=bool)
    hit = np.zeros(old_rows.shape, dtype=bool)
    blocks = np.arange(new_rows.shape[0])
    for row in range(old_rows.shape[1]):
        want = old_rows[:, row]
        match = (new_rows == want[:, None]) & ~used & (want[:, None] >= 0)
        hit[:, row] = match.any(axis=1)
        pos = match.argmax(axis=1)
        used[blocks[hit[:, row]], pos[hit[:, row]]] = True
    return hit, used


def _has_repeat(rows: np.ndarray) -> np.ndarray:
    """``(B, S) -> (B,)``: some expert (>= 0) appears twice in the row."""
    same = np.sort(rows, axis=1)
    return ((same[:, 1:] == same[:, :-1]) & (same[:, 1:] >= 0)).any(1)


def align_rows(old_phy2log: np.ndarray, new_phy2log: np.ndarray, num_ranks: int) -> np.ndarray:
    """Reorder the slots inside every rank of ``new_phy2log`` to match the old rows.

    For every rank, an expert that it held before and still holds keeps (one of) its old
    rows; the other experts fill the remaining rows in their original order. Only the
    order within a rank changes, so the set of moved slots and the balancedness are the
    same; unchanged rows need no copy at all.

    In a rank where no expert repeats (old or new), "kept" is plain membership, two flat
    gathers for all ranks at once; ranks with a repeated expert are matched row by row,
    the k-th old copy to the k-th new copy.
    """
    old = np.asarray(old_phy2log, dtype=np.int64)
    new = np.asarray(new_phy2log, dtype=np.int64)
    num_layers, num_slots = new.shape
    slots_per_rank = num_slots // num_ranks
    old_rows = old.reshape(-1, slots_per_rank)  # (B, S), B = L * G rank blocks
    new_rows = new.reshape(-1, slots_per_rank)
    num_experts = max(int(max(old.max(initial=-1), new.max(initial=-1))) + 1, 1)
    # empty slots (index -1) are never kept nor used: gather at 0, then mask
    old_index = np.maximum(rank_index(old, num_experts, num_ranks), 0)
    new_index = np.maximum(rank_index(new, num_experts, num_ranks), 0)
    hit = membership(new, num_experts, num_ranks).reshape(-1)[old_index].reshape(old_rows.shape)
    used = membership(old, num_experts, num_ranks).reshape(-1)[new_index].reshape(new_rows.shape)
    hit &= old_rows >= 0
    used &= new_rows >= 0
    repeat = np.flatnonzero(_has_repeat(old_rows) | _has_repeat(new_rows))
    if repeat.size:
        hit[repeat], used[repeat] = _first_come_rows(old_rows[repeat], new_rows[repeat])
    # fill the rows nobody claimed with the unused new experts, in order: the k-th free
    # row of a rank takes its k-th unused entry (flat scatters, no per-rank sort)
    free, spare = ~hit, ~used
    base = (np.arange(old_rows.shape[0]) * slots_per_rank)[:, None]
    row_at = np.empty(old_rows.size, dtype=np.int64)  # flat (rank, k) -> flat row of its k-th free row
    row_at[(base + np.cumsum(free, axis=1) - 1)[free]] = (base + np.arange(slots_per_rank))[free]
    out = np.where(hit, old_rows, 0).reshape(-1)
    out[row_at[(base + np.cumsum(spare, axis=1) - 1)[spare]]] = new_rows[spare]
    return out.reshape(num_layers, num_slots)


def renumbered_default(
    old: np.ndarray, held: np.ndarray, new: np.ndarray, num_ranks: int, num_nodes: int
) -> tuple[np.ndarray, np.ndarray]:
    """``new`` (L, P) renumbered to match ``old`` (L, P), rows aligned; and its moves (L,).

    ``held`` (L, N, G) is the old placement's membership. The greedy renumbering can lose
    against ``new``'s own numbering; such layers keep it, so a layer never moves more
    than ``new`` as given would.
    """
    relabeled = relabel_ranks(new, held.transpose(0, 2, 1), num_ranks, num_nodes)
    moved = moves_per_layer(held, relabeled)
    plain = moves_per_layer(held, new)
    worse = moved > plain
    if worse.any():
        relabeled[worse] = new[worse]
    return align_rows(old, relabeled, num_ranks), np.minimum(moved, plain)
