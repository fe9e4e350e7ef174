"""What the movement-aware search aims at: per-layer goals, and the cheapest default placement.

**Goals.** The mean rank load of a layer does not depend on the placement, so reaching
``target`` x the default's balancedness (sum over layers of mean / sum over layers of
max) means ``sum_l max_l <= budget = sum_l d_l / target``, where ``d_l`` is the
default's max rank load: one budget on the sum of per-layer maxima, which layers may
share. It is split into per-layer goals:

- :func:`lagrange_levels` (flat mode): as few ranks as possible above their goal, since
  every rank above it costs moved slots to fix;
- :func:`water_level` (hierarchical mode, where node totals cannot change): one common
  fraction above ``d_l`` for every layer;
- :func:`layer_goals` picks between them and applies the floors.

**Renumbering.** Balancedness only depends on which slots share a rank, not on the
rank's number, and a move only happens when an expert is new to its rank
(:mod:`eplb_fsm.policy.movement.placement`). So a fresh placement (the default
policy's) can be made cheaper without changing its quality:

- :func:`relabel_ranks` renumbers its ranks (whole nodes first when the placement is
  hierarchical) so that as many slots as possible find their expert already on their rank;
- :func:`align_rows` orders the slots of every rank so that an expert that stays on a
  rank keeps the row it had, which turns moves inside a rank into no-ops;
- :func:`renumbered_default` does both: the movement-aware policy's fallback.

All functions are numpy, vectorised over layers (and ranks); inputs are int64 arrays with
-1 for an empty slot.
"""

from __future__ import annotations

import math

import numpy as np

from eplb_fsm.maps import checked_int64
from eplb_fsm.policy.movement import native
from eplb_fsm.policy.movement.placement import membership, moves_per_layer, rank_index

__all__ = [
    "GOAL_FLOOR",
    "NODE_SLACK",
    "align_rows",
    "lagrange_levels",
    "layer_goals",
    "relabel_ranks",
    "renumbered_default",
    "water_level",
]

# Goals never go below this multiple of the default's max rank load (flat mode) ...
GOAL_FLOOR = 1.006
# ... nor, in hierarchical mode, below this fraction above the busiest node's mean.
NODE_SLACK = 0.01
# Goals below the current max are lowered by this relative amount (see layer_goals).
_TOL = 1e-9
_STEPS = np.arange(1.0, 65.0)


def water_level(current_max: np.ndarray, default_max: np.ndarray, budget: float) -> float:
    """Largest lam with ``sum(min(m, lam * d)) <= budget`` (m, d >= 0, (L,)); inf when sum(m) fits."""
    if current_max.sum() <= budget:
        return math.inf
    ratio = np.where(default_max > 0, current_max / np.where(default_max > 0, default_max, 1.0), 0.0)
    order = np.argsort(ratio)
    r, m, d = ratio[order], current_max[order], default_max[order]
    # With lam between r[k-1] and r[k], layers 0..k-1 keep m and the others contribute lam * d.
    kept = np.concatenate([[0.0], np.cumsum(m)])
    scaled = np.concatenate([np.cumsum(d[::-1])[::-1], [0.0]])
    lam = (budget - kept) / np.where(scaled > 0, scaled, np.inf)
    low = np.concatenate([[-np.inf], r])
    high = np.concatenate([r, [np.inf]])
    ok = (lam >= low) & (lam <= high) & (scaled > 0)
    if not ok.any():  # numerical corner: the smallest segment value is safe
        return float(max(lam[np.isfinite(lam)].min(initial=0.0), 0.0))
    return float(lam[np.argmax(ok)])


def lagrange_levels(rank_loads: np.ndarray, floor: np.ndarray, budget: float) -> np.ndarray:
    """Per-layer max-load goals ``(L, G), (L,) -> (L,)`` with ``sum(goal) <= budget`` and few ranks to fix.

    A layer whose goal is below k of its ranks must fix those k (the cost), and no goal
    goes below ``floor``; with the ranks sorted, fixing k ranks gives the goal
    ``max(R[l, k], floor[l])``. Each layer takes the k that maximises (reduction of its
    max - mu * k) for a price mu per rank; mu is the largest price on a grid whose plan
    still fits the budget (a Lagrangian relaxation of the knapsack), found by bisection.
    In C where :mod:`.native` is enabled.
    """
    if native.enabled() and rank_loads.size:
        return native.lagrange_levels(rank_loads, floor, budget)
    num_layers, num_ranks = rank_loads.shape
    r = -np.sort(-rank_loads, axis=1)
    need = float(r[:, 0].sum()) - budget
    if need <= 0:
        return r[:, 0].copy()
    # Past the first sorted rank at or below its floor every level is the floor: those k
    # reduce nothing more and cost more, so no price > 0 picks them. Dropping them keeps
    # the answer and shrinks the (prices, L, k) arrays below to the ranks that matter.
    width = int((r > floor[:, None]).sum(1).max()) + 1
    level = np.maximum(np.concatenate([r, floor[:, None]], axis=1)[:, :width], floor[:, None])  # (L, width)
    reduction = level[:, :1] - level
    k = np.arange(width)
    rows = np.arange(num_layers)

    def plan(mu: float) -> tuple[np.ndarray, float]:
        pick = (reduction - mu * k).argmax(1)  # (L,) ranks to fix at price mu
        return pick, float(reduction[rows, pick].sum())

    def largest_fit(mu: np.ndarray) -> tuple[int, np.ndarray | None]:
        """Largest index i of the ascending prices ``mu`` whose plan still reduces by ``need``
        (-1 if none), by bisection: a higher price never fixes more ranks in any layer, so
        the total reduction falls with the price."""
        lo, hi, best = -1, mu.size, None
        while hi - lo > 1:
            mid = (lo + hi) // 2
            pick, total = plan(float(mu[mid]))
            if total >= need:
                lo, best = mid, pick
            else:
                hi = mid
        return lo, best

    # a geometric grid of prices, then a linear one between the two that bracket the need
    hi = float(reduction.max()) + 1.0
    mu = hi * 0.5 ** np.arange(40.0)[::-1]  # ascending
    lo_mu, hi_mu = 0.0, hi
    best = np.full(num_layers, width - 1)
    for _ in range(2):
        i, pick = largest_fit(mu)
        if i >= 0:
            best, lo_mu = pick, float(mu[i])
            hi_mu = float(mu[i + 1]) if i + 1 < mu.size else hi_mu
        else:
            hi_mu = float(mu[0])
        mu = lo_mu + _STEPS * ((hi_mu - lo_mu) / 65)  # np.linspace(lo_mu, hi_mu, 66)[1:-1], bit for bit
    return level[rows, best]


def layer_goals(
    cur_loads: np.ndarray,
    default_max: np.ndarray,
    forced: np.ndarray,
    budget: float,
    num_nodes: int,
) -> np.ndarray:
    """Goal for every layer's max rank load, ``(L,)``.

    Args:
        cur_loads: (L, G) rank loads of the starting placement under the new load.
        default_max: (L,) the default placement's max rank load.
        forced: (L,) bool, layers that must take the default's placement (their goal is
            ``default_max``).
        budget: bound on the sum over layers of max rank loads.
        num_nodes: > 1 in hierarchical mode.

    Layers with ``cur_max <= goal`` need no work.
    """
    cur_max = cur_loads.max(1)
    free = ~forced
    free_budget = budget - float(default_max[forced].sum())
    if num_nodes > 1:
        # repairs stay inside nodes, so node totals are fixed: no goal below the busiest
        # node's mean rank load, and a common fraction above the default's max for all
        num_layers, num_ranks = cur_loads.shape
        node_mean = cur_loads.reshape(num_layers, num_nodes, num_ranks // num_nodes).mean(-1).max(1)
        lam = water_level(cur_max[free], default_max[free], free_budget)
        goal = np.minimum(cur_max, lam * default_max) if math.isfinite(lam) else cur_max.copy()
        goal = np.maximum(goal, np.minimum(node_mean * (1 + NODE_SLACK), cur_max))
    else:
        goal = cur_max.copy()
        goal[free] = lagrange_levels(cur_loads[free], default_max[free] * GOAL_FLOOR, free_budget)
    # A layer whose goal is its current max needs no work and keeps it exactly; the others
    # aim a hair lower, so that float rounding never leaves a rank that "meets" the goal
    # just above it.
    goal = np.where(forced, default_max * (1 - _TOL), np.where(goal >= cur_max, cur_max, goal * (1 - _TOL)))
    return goal


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
    new = checked_int64(new_phy2log, "new_phy2log")
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
    old = checked_int64(old_phy2log, "old_phy2log")  # a uint64 2**64 - 1 must not wrap to -1 (empty)
    new = checked_int64(new_phy2log, "new_phy2log")
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
    than ``new`` as given would. (In C, one call, where :mod:`.native` is enabled.)
    """
    if native.enabled() and held.shape[1] > 0:
        return native.renumbered_default(old, held, new, num_ranks, num_nodes)
    relabeled = relabel_ranks(new, held.transpose(0, 2, 1), num_ranks, num_nodes)
    moved = moves_per_layer(held, relabeled)
    plain = moves_per_layer(held, new)
    worse = moved > plain
    if worse.any():
        relabeled[worse] = new[worse]
    return align_rows(old, relabeled, num_ranks), np.minimum(moved, plain)
