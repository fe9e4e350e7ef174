"""The movement-aware policy's local search: every round, all layers still above their goal.

:class:`SearchState` holds the placement being repaired for the searched layers (A of
them) and everything the candidate scores need, kept up to date change by change:

- ``cur`` (A, P) int64 placement; ``count`` (A, N) replica counts;
- ``slot_load`` (A, P) expert load / count; ``rank_load`` (A, G) their sums per rank;
- ``on_rank`` (A, N, G) slots of expert e on rank g (int8); ``held`` (A, N, G) bool, the
  *old* placement's membership (what counts as a move);
- ``moved`` (A, P) bool slots whose expert is new to their rank; ``moves`` (A,) their sum;
- ``goal`` (A,) the max rank load to reach; ``limit`` (A,) moves a layer may spend.

All updates index the flattened arrays (``row * width + column``): one gather or scatter
per array, which numpy does far faster than broadcasting a pair of index arrays.

:meth:`SearchState.run` is the round loop; the candidate changes it chooses from are
scored in :mod:`eplb_fsm.policy.movement.moves`; the one-pass replica-count fix that runs
before it, :func:`rebalance_counts`, is at the end of this module.
"""

from __future__ import annotations

import numpy as np

from eplb_fsm.policy.movement import native
from eplb_fsm.policy.movement.moves import FREE_COST, best_prefix, pair_swaps, repoints, widened_swap

__all__ = ["COUNT_CAP", "MAX_ROUNDS", "SearchState", "rebalance_counts"]

# Local-search rounds (every round handles all searched layers at once).
MAX_ROUNDS = 10
# Rounds that consider re-points at all ...
_REPOINT_ROUNDS = 3
# ... and only while more than this share of the live layers takes one.
_REPOINT_MIN_SHARE = 0.25
# Rounds at the start in which a layer with a useful re-point does only that.
_REPOINT_FIRST_ROUNDS = 2
# ... and the few layers without one (under this share of the live layers) wait a round
# for their swaps: a candidate pass costs about the same for a few layers as for all.
_SWAP_WAIT_SHARE = 0.25
# The search ends once fewer than this share of the searched layers are still live: a
# round costs nearly as much for a handful of layers as for all of them, and the budget
# fallback closes what those few would still gain.
_FEW_LIVE_SHARE = 0.05


class SearchState:
    """The placement under repair for A layers, and its derived arrays (module docstring).

    Args:
        w: (A, N) float64 loads. cur: (A, P) int64 starting placement, no empty slot
            (taken over and updated in place); count (A, N) its replica counts and
            slot_load (A, P) its slot loads. held: (A, N, G) bool old membership.
        on_rank: (A, N, G) slot counts of ``cur`` (a narrow int type, see
            :func:`~eplb_fsm.policy.movement.placement.rank_counts`). goal, limit: (A,).
        num_ranks, num_nodes: G and the nodes (> 1 only in hierarchical mode, where
            every change stays inside a node).
    """

    def __init__(self, w, cur, count, slot_load, held, on_rank, goal, num_ranks, num_nodes, limit):
        self.L, self.P = cur.shape
        self.N = w.shape[1]
        self.G = num_ranks
        self.nodes = num_nodes
        self.S = self.P // num_ranks
        self.Gn = num_ranks // num_nodes
        self.w = np.ascontiguousarray(w)
        self.cur = np.ascontiguousarray(cur)
        self.count = np.ascontiguousarray(count)
        self.slot_load = np.ascontiguousarray(slot_load)
        self.rank_load = self.slot_load.reshape(self.L, num_ranks, self.S).sum(-1)
        self.held = np.ascontiguousarray(held)
        self.on_rank = np.ascontiguousarray(on_rank)
        self.goal = goal
        self.limit = limit
        self.rank_of_slot = np.arange(self.P) // self.S
        self.node_of_rank = np.arange(num_ranks) // self.Gn
        # flat bases: slot (layer, p) is layer * P + p, expert (layer, e) is layer * N + e
        self.rows = np.arange(self.L)
        self.slot_range = np.arange(self.S)
        self.slot_base = self.rows * self.P
        self.expert_base = (self.rows * self.N)[:, None]
        # flat views, current because every update is in place: per slot, per (layer, expert)
        # and per (layer, expert) row of G ranks; bool arrays also as int8 (0/1)
        self.cur_f, self.sl_f = self.cur.reshape(-1), self.slot_load.reshape(-1)
        self.w_f, self.count_f = self.w.reshape(-1), self.count.reshape(-1)
        self.on_rank_rows = self.on_rank.reshape(-1, num_ranks)
        self.held_rows = self.held.reshape(-1, num_ranks)
        self.held8 = self.held.reshape(-1).view(np.int8)
        self.moved = ~self.held8.view(bool)[(self.cur + self.expert_base) * num_ranks + self.rank_of_slot]
        self.moved_f = self.moved.reshape(-1)
        self.moved8 = self.moved_f.view(np.int8)
        self.moves = self.moved.sum(1)
        # node of every expert (fixed: repairs never move an expert to another node)
        node_of_expert = np.zeros(self.L * self.N, dtype=np.int64)
        if num_nodes > 1:
            node_of_expert[(self.cur + self.expert_base).ravel()] = np.tile(
                self.node_of_rank[self.rank_of_slot], self.L
            )
        self.node_of_expert = node_of_expert.reshape(self.L, self.N)
        self.rounds = 0

    # -- bookkeeping ------------------------------------------------------
    def set_slots(self, rows: np.ndarray, slots: np.ndarray, experts: np.ndarray, unique: bool = True) -> None:
        """Point ``slots`` of ``rows`` (distinct pairs) at ``experts``; counts and ``moves`` are the caller's job.

        ``unique``: no two changes share a (layer, rank), so plain fancy updates are exact;
        otherwise ``ufunc.at`` accumulates the repeats.
        """
        flat = rows * self.P + slots
        base = rows * (self.N * self.G) + self.rank_of_slot[slots]
        gone, come = base + self.cur_f[flat] * self.G, base + experts * self.G
        on_rank = self.on_rank.reshape(-1)
        if unique:
            on_rank[gone] -= 1
            on_rank[come] += 1
        else:
            np.subtract.at(on_rank, gone, 1)
            np.add.at(on_rank, come, 1)
        self.cur_f[flat] = experts
        self.moved8[flat] = 1 - self.held8[come]  # the new expert is new to the rank

    def swap(self, rows: np.ndarray, slot_a: np.ndarray, slot_b: np.ndarray) -> None:
        """Exchange the experts of ``slot_a`` and ``slot_b`` in ``rows``; no two pairs share a rank."""
        fa = rows * self.P + slot_a
        fb = rows * self.P + slot_b
        xa, xb, la, lb = self.cur_f[fa], self.cur_f[fb], self.sl_f[fa], self.sl_f[fb]
        self.set_slots(np.concatenate([rows, rows]), np.concatenate([slot_a, slot_b]), np.concatenate([xb, xa]))
        self.sl_f[fa] = lb
        self.sl_f[fb] = la
        rank_load = self.rank_load.reshape(-1)
        rank_load[rows * self.G + self.rank_of_slot[slot_a]] += lb - la
        rank_load[rows * self.G + self.rank_of_slot[slot_b]] += la - lb
        self.moves = self.moved.sum(1)

    def recount(self, rows: np.ndarray, slots: np.ndarray, new: np.ndarray, distinct: bool = True) -> None:
        """Re-point ``slots`` of ``rows`` at ``new`` experts, updating counts and the rows' loads.

        ``distinct``: at most one change per layer (a round's re-points); otherwise any number.
        """
        old = self.cur_f[rows * self.P + slots]
        if distinct:
            self.count_f[rows * self.N + old] -= 1
            self.count_f[rows * self.N + new] += 1
        else:
            np.subtract.at(self.count_f, rows * self.N + old, 1)
            np.add.at(self.count_f, rows * self.N + new, 1)
        self.set_slots(rows, slots, new, unique=distinct)
        touched = rows if distinct else np.unique(rows)
        flat = self.cur[touched] + self.expert_base[touched]  # (k, P) flat (layer, expert); counts >= 1
        load = self.w_f[flat] / self.count_f[flat]
        self.slot_load[touched] = load
        self.rank_load[touched] = load.reshape(len(touched), self.G, self.S).sum(-1)
        self.moves = self.moved.sum(1)

    # -- main loop ----------------------------------------------------------
    def run(self, budget: float, fixed_max: float, max_rounds: int = MAX_ROUNDS) -> None:
        """Search until every layer meets its goal, is stuck or out of moves, ``max_rounds``
        are spent, or the budget on the sum of layer maxima holds (``fixed_max``: the sum
        over the layers outside the search). In one C call where :mod:`.native` is usable."""
        if native.usable(self):
            native.run(self, budget, fixed_max, max_rounds)
            return
        layer_max = self.rank_load.max(1)
        live = layer_max > self.goal
        searched = np.flatnonzero(live)
        repoints_pay = True  # until a round where (almost) no layer takes one
        while self.rounds < max_rounds:
            lr = np.flatnonzero(live)
            n = lr.size
            if n == 0 or n < _FEW_LIVE_SHARE * searched.size:
                break
            self.rounds += 1
            RL, T = self.rank_load[lr], self.goal[lr]
            first_rounds = self.rounds <= _REPOINT_FIRST_ROUNDS
            if self.rounds <= _REPOINT_ROUNDS and repoints_pay:
                rp_eff, rp_rank, rp_new, rp_donor, rp_cost, rp_after = repoints(self, lr, RL, T)
                has_rp = np.isfinite(rp_eff)
                any_rp = bool(has_rp.any())
            else:
                any_rp = False
            # swaps: in the first rounds only for layers without a useful re-point
            if any_rp and first_rounds:
                sw_idx = np.flatnonzero(~has_rp)
                waiting = sw_idx.size <= _SWAP_WAIT_SHARE * n
                swaps = None if waiting else pair_swaps(self, lr[sw_idx], RL[sw_idx], T[sw_idx])
                if swaps is not None:
                    swaps = (sw_idx[swaps[0]],) + swaps[1:]  # pair layers index lr
            else:
                waiting = False
                swaps = pair_swaps(self, lr, RL, T)
            if swaps is not None:
                pr, eff, slot_a, slot_b, o, u, sw_cost, delta = swaps
            use_rp = has_rp if any_rp else None
            if any_rp and not first_rounds and swaps is not None:
                best_swap = np.full(n, -np.inf)  # a re-point must beat the layer's best swap
                np.maximum.at(best_swap, pr, eff)
                use_rp = has_rp & (rp_eff >= best_swap)
                any_rp = bool(use_rp.any())
            # the round's plan per layer: a re-point and/or swaps (next to a re-point, only
            # pairs of ranks it does not touch); ``after`` (n, G) its rank loads
            after = np.where(use_rp[:, None], rp_after, RL) if any_rp else RL.copy()
            cost = np.where(use_rp, rp_cost, 0) if any_rp else np.zeros(n, np.int64)
            acts = use_rp.copy() if any_rp else np.zeros(n, dtype=bool)
            if swaps is not None:
                pick = np.isfinite(eff)
                if any_rp:
                    # ranks holding the re-point's new expert or donor (only pairs elsewhere)
                    touched = (self.on_rank_rows[rp_new] > 0) | (self.on_rank_rows[rp_donor] > 0)
                    pick &= ~use_rp[pr] | (~touched[pr, o] & ~touched[pr, u])
                    # ... and only the first pairs whose cost, with the re-point's, fits the move limit
                    with_rp = pick & use_rp[pr]
                    paid = np.where(with_rp, np.maximum(sw_cost, 0), 0)
                    spent = np.cumsum(paid)
                    spent -= (spent - paid)[np.searchsorted(pr, pr)]  # within the layer (pairs contiguous)
                    pick &= ~with_rp | (spent + rp_cost[pr] <= (self.limit - self.moves)[lr[pr]])
                moved_load = np.where(pick, delta, 0.0)
                after[pr, o] -= moved_load  # pairs of a layer share no rank: no repeated index
                after[pr, u] += moved_load
                cost += np.bincount(pr, np.where(pick, sw_cost, 0), minlength=n).astype(np.int64)
                acts |= np.bincount(pr, pick, minlength=n) > 0
            else:
                pick = np.zeros(0, dtype=bool)
            # if this round can meet the budget, carry out only the layers' plans that cut
            # the sum of layer maxima most per moved slot, and stop after it
            need = fixed_max + float(layer_max[searched].sum()) - budget
            value = np.where(acts, layer_max[lr] - after.max(1), 0.0)
            last = need > 0 and value.sum() >= need
            if last:
                # a layer without a re-point may also carry out only its first (heaviest) pairs
                keep_pairs = np.full(n, np.iinfo(np.int64).max)
                if swaps is not None:
                    no_rp = ~use_rp if any_rp else np.ones(n, dtype=bool)
                    p_value, p_cost, p_keep = best_prefix(RL, value, cost, no_rp, pr, pick, o, u, delta, sw_cost)
                    if p_value.sum() >= need:
                        value, cost, keep_pairs = p_value, p_cost, p_keep
                order = np.lexsort((-value, -value / np.maximum(cost, FREE_COST)))
                take = np.zeros(n, dtype=bool)
                take[order[: int(np.searchsorted(np.cumsum(value[order]), need)) + 1]] = True
                if any_rp:
                    use_rp &= take
                    any_rp = bool(use_rp.any())
                if swaps is not None:
                    rank_in_layer = np.arange(pr.size) - np.searchsorted(pr, pr)
                    pick &= take[pr] & (rank_in_layer < keep_pairs[pr])
                acts &= take
            if pick.any():
                self.swap(lr[pr[pick]], slot_a[pick], slot_b[pick])
            taken = 0
            if any_rp:
                i = np.flatnonzero(use_rp)
                taken = i.size
                rows, donor = lr[i], rp_donor[i] - self.expert_base[lr[i], 0]
                # the freed slot: the first one of the chosen rank holding the donor
                first = self.slot_base[rows] + rp_rank[i] * self.S
                at = (self.cur_f[first[:, None] + self.slot_range] == donor[:, None]).argmax(1)
                self.recount(rows, rp_rank[i] * self.S + at, rp_new[i] - self.expert_base[lr[i], 0])
            repoints_pay = taken > _REPOINT_MIN_SHARE * n
            if last:
                break
            if not waiting and not acts.all():
                idle = lr[~acts]
                found = widened_swap(self, idle)
                live[idle[~found]] = False
            layer_max = self.rank_load.max(1)
            live &= (layer_max > self.goal) & (self.moves < self.limit)
            if fixed_max + float(layer_max[searched].sum()) <= budget:
                break

# --------------------------------------------------------------------------- replica counts
# Before the local search, one pass for experts far above the default's per-replica load.
# A hot expert with too few replicas keeps every rank that holds it overloaded, and the
# local search would need one re-point per missing replica, a round each. This pass gives
# all of them in one go: expert e wants ``ceil(w_e / cap) - c_e`` more replicas; an
# expert can spare the replicas it has above ``max(1, ceil(w_e / cap))``. In every
# (layer, node) as many replicas change hands as both sides allow: the neediest experts
# (largest load per replica) are served first and the experts that suffer least (smallest
# load per replica after giving one up) give first. A giver frees its slots on its
# lightest ranks, and the heaviest new replicas go to the lightest of those ranks. Every
# change is one re-pointed slot, within each layer's move limit.

# Experts whose load per replica exceeds this multiple of the default's largest load per
# replica get more replicas before the search.
COUNT_CAP = 2.0


def _node_major(node: np.ndarray, key: np.ndarray) -> np.ndarray:
    """Expert order by (node, key): ``(n, N), (n, N) -> (n, N)``."""
    span = np.abs(key).max(initial=0.0) * 4 + 1.0
    return np.argsort(node * span + key, axis=1, kind="stable")


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


def rebalance_counts(st: SearchState, cap: np.ndarray) -> None:
    """Re-point slots of ``st`` so that no expert's load per replica exceeds ``cap`` (A,) where
    givers allow (module docstring); updates ``st`` in place. In C where :mod:`.native` is usable."""
    if native.usable(st):
        native.rebalance_counts(st, cap)
        return
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
    order = np.argsort(cur * span + slot_load, axis=1, kind="stable")  # by expert, then rank load
    sorted_e = np.take_along_axis(cur, order, 1)
    first = np.cumsum(count, 1) - count
    pos = np.arange(P)[None, :] - np.take_along_axis(first, sorted_e, 1)
    freed = np.zeros((n, P), bool)
    np.put_along_axis(freed, order, pos < np.take_along_axis(gives, sorted_e, 1), 1)
    # freed slots node-major, lightest rank first; new replicas node-major, heaviest first
    slot_node = st.node_of_rank[st.rank_of_slot][None, :]
    total = moves.sum(1)
    kmax = int(total.max())
    slots = np.argsort(np.where(freed, slot_node * span + slot_load, np.inf), axis=1, kind="stable")[:, :kmax]
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
