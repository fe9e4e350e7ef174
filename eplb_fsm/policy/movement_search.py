"""The movement-aware policy's local search: every round, all layers still above their goal.

:class:`SearchState` holds the placement being repaired for the searched layers (A of
them) and everything the candidate scores need, kept up to date change by change:

- ``cur`` (A, P) int64 placement; ``count`` (A, N) replica counts;
- ``slot_load`` (A, P) expert load / count; ``rank_load`` (A, G) their sums per rank;
- ``on_rank`` (A, N, G) slots of expert e on rank g; ``held`` (A, N, G) bool, the *old*
  placement's membership (what counts as a move);
- ``moved`` (A, P) bool slots whose expert is new to their rank; ``moves`` (A,) their sum;
- ``goal`` (A,) the max rank load to reach; ``limit`` (A,) moves a layer may spend.

All updates index the flattened arrays (``row * width + column``): one gather or scatter
per array, which numpy does far faster than broadcasting a pair of index arrays.

:meth:`SearchState.run` is the round loop; the candidate changes it chooses from are
scored in :mod:`eplb_fsm.policy.movement_moves` and the one-pass replica-count fix in
:mod:`eplb_fsm.policy.movement_counts`.
"""

from __future__ import annotations

import numpy as np

from eplb_fsm.policy.movement_cost import expert_counts, slot_loads
from eplb_fsm.policy.movement_moves import FREE_COST, best_prefix, pair_swaps, repoints, widened_swap

__all__ = ["MAX_ROUNDS", "SearchState"]

# Local-search rounds (every round handles all searched layers at once).
MAX_ROUNDS = 10
# Rounds that consider re-points at all ...
_REPOINT_ROUNDS = 3
# ... and only while more than this share of the live layers takes one.
_REPOINT_MIN_SHARE = 0.2
# Rounds at the start in which a layer with a useful re-point does only that.
_REPOINT_FIRST_ROUNDS = 2


class SearchState:
    """The placement under repair for A layers, and its derived arrays (module docstring).

    Args:
        w: (A, N) float64 loads. cur: (A, P) int64 starting placement, no empty slot
            (taken over and updated in place). held: (A, N, G) bool old membership.
        on_rank: (A, N, G) int64 slot counts of ``cur``. goal, limit: (A,).
        num_ranks, num_nodes: G and the nodes (> 1 only in hierarchical mode, where
            every change stays inside a node).
    """

    def __init__(self, w, cur, held, on_rank, goal, num_ranks, num_nodes, limit):
        self.w = w
        self.cur = np.ascontiguousarray(cur)
        self.held = np.ascontiguousarray(held)
        self.on_rank = np.ascontiguousarray(on_rank)
        self.goal = goal
        self.limit = limit
        self.L, self.P = cur.shape
        self.N = w.shape[1]
        self.G = num_ranks
        self.nodes = num_nodes
        self.S = self.P // num_ranks
        self.Gn = num_ranks // num_nodes
        self.rank_of_slot = np.arange(self.P) // self.S
        self.node_of_rank = np.arange(num_ranks) // self.Gn
        self.count = np.ascontiguousarray(expert_counts(self.cur, self.N))
        self.slot_load = slot_loads(w, self.cur, self.count)
        self.rank_load = self.slot_load.reshape(self.L, num_ranks, self.S).sum(-1)
        rows = np.arange(self.L)
        # flat index of (layer, expert) and of (layer, expert, rank of the slot) per slot
        self.expert_base = (rows * self.N)[:, None]
        self.moved = ~self.held.reshape(-1)[(self.cur + self.expert_base) * num_ranks + self.rank_of_slot]
        self.moves = self.moved.sum(1)
        # node of every expert (fixed: repairs never move an expert to another node)
        node_of_expert = np.zeros(self.L * self.N, dtype=np.int64)
        node_of_expert[(self.cur + self.expert_base).ravel()] = np.tile(self.node_of_rank[self.rank_of_slot], self.L)
        self.node_of_expert = node_of_expert.reshape(self.L, self.N)
        self.rounds = 0

    # -- bookkeeping ------------------------------------------------------
    def set_slots(self, rows: np.ndarray, slots: np.ndarray, experts: np.ndarray, unique: bool = True) -> None:
        """Point ``slots`` of ``rows`` (distinct pairs) at ``experts``; counts are the caller's job.

        ``unique``: no two changes share a (layer, rank), so plain fancy updates are exact;
        otherwise ``ufunc.at`` accumulates the repeats.
        """
        ranks = self.rank_of_slot[slots]
        flat = rows * self.P + slots
        cur = self.cur.reshape(-1)
        base = rows * (self.N * self.G) + ranks
        on_rank = self.on_rank.reshape(-1)
        gone, come = base + cur[flat] * self.G, base + experts * self.G
        if unique:
            on_rank[gone] -= 1
            on_rank[come] += 1
        else:
            np.subtract.at(on_rank, gone, 1)
            np.add.at(on_rank, come, 1)
        cur[flat] = experts
        now = ~self.held.reshape(-1)[come]
        moved = self.moved.reshape(-1)
        self.moves += np.bincount(rows, now.astype(np.int64) - moved[flat], minlength=self.L).astype(np.int64)
        moved[flat] = now

    def swap(self, rows: np.ndarray, slot_a: np.ndarray, slot_b: np.ndarray) -> None:
        """Exchange the experts of ``slot_a`` and ``slot_b`` in ``rows``; no two pairs share a rank."""
        fa = rows * self.P + slot_a
        fb = rows * self.P + slot_b
        cur = self.cur.reshape(-1)
        sl = self.slot_load.reshape(-1)
        xa, xb, la, lb = cur[fa], cur[fb], sl[fa], sl[fb]
        self.set_slots(np.concatenate([rows, rows]), np.concatenate([slot_a, slot_b]), np.concatenate([xb, xa]))
        sl[fa] = lb
        sl[fb] = la
        rank_load = self.rank_load.reshape(-1)
        rank_load[rows * self.G + self.rank_of_slot[slot_a]] += lb - la
        rank_load[rows * self.G + self.rank_of_slot[slot_b]] += la - lb

    def recount(self, rows: np.ndarray, slots: np.ndarray, new: np.ndarray, distinct: bool = True) -> None:
        """Re-point ``slots`` of ``rows`` at ``new`` experts, updating counts and the rows' loads.

        ``distinct``: at most one change per layer (a round's re-points); otherwise any number.
        """
        old = self.cur.reshape(-1)[rows * self.P + slots]
        count = self.count.reshape(-1)
        if distinct:
            count[rows * self.N + old] -= 1
            count[rows * self.N + new] += 1
        else:
            np.subtract.at(count, rows * self.N + old, 1)
            np.add.at(count, rows * self.N + new, 1)
        self.set_slots(rows, slots, new, unique=distinct)
        touched = rows if distinct else np.unique(rows)
        self.slot_load[touched] = slot_loads(self.w[touched], self.cur[touched], self.count[touched])
        self.rank_load[touched] = self.slot_load[touched].reshape(len(touched), self.G, self.S).sum(-1)

    # -- main loop ----------------------------------------------------------
    def run(self, budget: float, fixed_max: float) -> None:
        """Search until every layer meets its goal, is stuck or out of moves, the rounds are
        spent, or the budget on the sum of layer maxima holds (``fixed_max``: the sum over
        the layers outside the search)."""
        layer_max = self.rank_load.max(1)
        live = layer_max > self.goal
        searched = np.flatnonzero(live)
        repoints_pay = True  # until a round where (almost) no layer takes one
        while self.rounds < MAX_ROUNDS:
            lr = np.flatnonzero(live)
            n = lr.size
            if n == 0:
                break
            self.rounds += 1
            RL, T = self.rank_load[lr], self.goal[lr]
            first_rounds = self.rounds <= _REPOINT_FIRST_ROUNDS
            if self.rounds <= _REPOINT_ROUNDS and repoints_pay:
                rp_eff, rp_slot, rp_new, touched, rp_cost, rp_after = repoints(self, lr, RL, T)
                has_rp = np.isfinite(rp_eff)
                any_rp = bool(has_rp.any())
            else:
                any_rp = False
            # swaps: in the first rounds only for layers without a useful re-point
            if any_rp and first_rounds:
                sw_idx = np.flatnonzero(~has_rp)
                swaps = pair_swaps(self, lr[sw_idx], RL[sw_idx], T[sw_idx]) if sw_idx.size else None
                if swaps is not None:
                    swaps = (sw_idx[swaps[0]],) + swaps[1:]  # pair layers index lr
            else:
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
                    pick &= ~use_rp[pr] | (~touched[pr, o] & ~touched[pr, u])
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
                self.recount(lr[i], rp_slot[i], rp_new[i])
            repoints_pay = taken > _REPOINT_MIN_SHARE * n
            if last:
                break
            if not acts.all():
                idle = lr[~acts]
                found = widened_swap(self, idle)
                live[idle[~found]] = False
            layer_max = self.rank_load.max(1)
            live &= (layer_max > self.goal) & (self.moves < self.limit)
            if fixed_max + float(layer_max[searched].sum()) <= budget:
                break
