"""The movement-aware policy: keep most of the old placement, repair what the new load breaks.

The default policy re-plans from scratch, so a small drift in load moves almost every
slot. This policy starts from the placement in use (``old_phy2log``) and changes as few
slots as it can while staying within a target fraction of the default's balancedness
(design section 2: sum over layers of mean rank load / sum over layers of max rank load).

Algorithm (numpy, vectorised over layers; docs/policies.md has the long version):

1. Plan with the default policy on the new load: its placement ``D`` is the reference
   (max rank load ``d_l`` per layer) and the fallback. Since the mean rank load does not
   depend on the placement, reaching ``target`` x the default's balancedness means
   ``sum_l max_l <= sum_l d_l / target``: one budget on the sum of per-layer maxima.
2. If the old placement fits the budget under the new load, keep it: zero moves.
3. Otherwise give each layer a max-load target ``T_l = min(m_l, lam * d_l)`` (``m_l`` the
   old placement's max), with the largest common ``lam >= 1 / target`` that fits the
   budget ("water level"): layers that are still good stay untouched and pay for the rest.
4. Repair every layer above its target by local search. The objective is the excess
   ``E = sum_g max(0, load_g - T_l)``; each step picks, per layer, the better of
   - a **re-point**: one slot of a lukewarm expert ``x`` (>= 2 replicas) takes a new
     replica of a hot expert ``y`` of the most loaded rank; it changes replica counts,
     so it relieves every rank holding ``y`` at once for one moved slot;
   - **swaps**: the ranks of each node are sorted by load and the k-th heaviest
     overloaded rank is paired with the k-th lightest; every pair swaps the two slots
     that remove the most excess per moved slot (disjoint pairs are applied together).
   Candidates are ranked by excess removed per moved slot, with moves counted against the
   *old* placement (a slot that gets back an expert its rank held is free again). When
   neither applies, the most loaded rank tries a swap with every other rank of its node.
5. A layer that cannot reach its target, or whose repair would move at least as much as
   the default, takes the default's placement instead, with its ranks renumbered to
   match the old ones (:func:`~eplb_fsm.policy.movement_cost.relabel_ranks`). Layers left
   slightly above their target are kept while the budget allows.
6. Inside every rank, experts that stay keep their old row
   (:func:`~eplb_fsm.policy.movement_cost.align_rows`).

Every placement it returns is valid: each expert keeps at least one replica, every rank
has P / G slots, and in hierarchical mode (``num_groups % num_nodes == 0`` and more
than one node) every group's replicas stay on one node, as the default's do.
"""

from __future__ import annotations

import dataclasses
import math
import types
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from eplb_fsm.policy.base import AbstractEplbPolicy, build_log2phy, check_rebalance_args
from eplb_fsm.policy.default import DefaultEplbPolicy
from eplb_fsm.policy.movement_cost import align_rows, rank_membership, relabel_ranks
from eplb_fsm.policy.registry import register_policy

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["DEFAULT_TARGET", "MovementAwarePolicy", "MovementPlan", "plan_movement"]

#: default fraction of the default policy's balancedness to reach (EplbConfig.movement_balancedness_target)
DEFAULT_TARGET = 0.99
# A layer whose repair has moved this fraction of what the default would move gives up
# and takes the (renumbered) default placement: past that point the saving is small.
_GIVE_UP_FRACTION = 0.5
# Local-search rounds; every round handles all layers at once.
_MAX_ROUNDS = 24
# Hot experts (taken from the most loaded rank) and donor experts tried per re-point round.
_HOT_CANDIDATES = 2
_DONOR_CANDIDATES = 6
# A swap that moves nothing (cost <= 0) is ranked as if it cost this much.
_FREE_COST = 0.5
_TOL = 1e-9


@dataclasses.dataclass
class MovementPlan:
    """A movement-aware placement and how it was reached (numpy arrays, per layer).

    ``phy2log`` (L, P); ``moved`` (L,) slots whose expert is new to their rank;
    ``default_phy2log`` / ``default_moved``: the default policy's placement and its moves;
    ``kept``: layer unchanged; ``repaired``: layer changed by local search; ``fallback``:
    layer took the (renumbered) default placement; ``rounds``: local-search rounds run.
    """

    phy2log: np.ndarray
    moved: np.ndarray
    default_phy2log: np.ndarray
    default_replica_count: np.ndarray
    default_moved: np.ndarray
    kept: np.ndarray
    repaired: np.ndarray
    fallback: np.ndarray
    rounds: int


# --------------------------------------------------------------------------- arguments


def _check_target(target: Any) -> float:
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not math.isfinite(target):
        raise ValueError(f"target must be a number in (0, 1], got {target!r}")
    if not 0.0 < float(target) <= 1.0:
        raise ValueError(f"target must be in (0, 1], got {target}")
    return float(target)


def _check_max_moves(max_moves: Any) -> int | None:
    if max_moves is None:
        return None
    if isinstance(max_moves, bool) or not isinstance(max_moves, (int, np.integer)) or max_moves < 0:
        raise ValueError(f"max_moves must be None or an integer >= 0 (moved slots per layer), got {max_moves!r}")
    return int(max_moves)


def _check_old(old_phy2log: Any, num_layers: int, num_slots: int, num_experts: int) -> np.ndarray:
    """The old placement as (L, P) int64; ValueError naming ``old_phy2log`` otherwise.

    ``check_rebalance_args`` has already checked its rank, layer count, dtype and range.
    """
    if hasattr(old_phy2log, "detach"):
        old = old_phy2log.detach().cpu().numpy()
    else:
        old = np.asarray(old_phy2log)
    old = old.astype(np.int64, copy=True)
    if old.shape != (num_layers, num_slots):
        raise ValueError(
            f"old_phy2log must have shape (layers, num_replicas) = ({num_layers}, {num_slots}), got {old.shape}"
        )
    width = num_experts + 1
    flat = np.where(old >= 0, old, num_experts) + width * np.arange(num_layers)[:, None]
    present = np.bincount(flat.ravel(), minlength=num_layers * width).reshape(num_layers, width)[:, :num_experts]
    missing = present == 0
    if missing.any():
        layer, expert = (int(i) for i in np.argwhere(missing)[0])
        raise ValueError(
            f"old_phy2log must place every expert at least once; layer {layer} has no slot for expert {expert}"
            f" ({int(missing.sum())} missing in all)"
        )
    return old


# --------------------------------------------------------------------------- helpers


def _counts(phy2log: np.ndarray, num_experts: int) -> np.ndarray:
    num_layers = phy2log.shape[0]
    width = num_experts + 1
    flat = np.where(phy2log >= 0, phy2log, num_experts) + width * np.arange(num_layers)[:, None]
    return np.bincount(flat.ravel(), minlength=num_layers * width).reshape(num_layers, width)[:, :num_experts]


def _slot_loads(w: np.ndarray, phy2log: np.ndarray, count: np.ndarray) -> np.ndarray:
    expert = np.maximum(phy2log, 0)
    load = np.take_along_axis(w, expert, 1) / np.maximum(np.take_along_axis(count, expert, 1), 1)
    return np.where(phy2log >= 0, load, 0.0)


def _water_level(current_max: np.ndarray, default_max: np.ndarray, budget: float) -> float:
    """Largest lam with sum(min(m, lam * d)) <= budget (m, d >= 0); inf when sum(m) fits."""
    if current_max.sum() <= budget:
        return math.inf
    ratio = np.where(default_max > 0, current_max / np.where(default_max > 0, default_max, 1.0), 0.0)
    order = np.argsort(ratio)
    r = ratio[order]
    m = current_max[order]
    d = default_max[order]
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


def _group_spans_nodes(old: np.ndarray, num_experts: int, num_groups: int, num_nodes: int) -> np.ndarray:
    """(L,) bool: some expert group has slots on more than one node."""
    num_layers, num_slots = old.shape
    group = np.where(old >= 0, old // (num_experts // num_groups), num_groups)
    node = np.arange(num_slots) // (num_slots // num_nodes)
    width = (num_groups + 1) * num_nodes
    flat = group * num_nodes + node[None, :] + width * np.arange(num_layers)[:, None]
    seen = np.bincount(flat.ravel(), minlength=num_layers * width).reshape(num_layers, num_groups + 1, num_nodes)
    return ((seen[:, :num_groups] > 0).sum(-1) > 1).any(-1)


def _fill_empty_slots(cur: np.ndarray, w: np.ndarray, rows: np.ndarray) -> None:
    """Give every empty slot (-1) of ``rows`` to the expert with the largest load per replica."""
    num_experts = w.shape[1]
    while True:
        empty = cur[rows] < 0
        todo = rows[empty.any(1)]
        if todo.size == 0:
            return
        slot = (cur[todo] < 0).argmax(1)
        per = w[todo] / np.maximum(_counts(cur[todo], num_experts), 1)
        cur[todo, slot] = per.argmax(1)


# --------------------------------------------------------------------------- local search


class _Repair:
    """Vectorised local search over the layers that miss their goal (see the module doc).

    State per layer: the placement ``cur`` (L, P), replica counts (L, N), slot loads
    (L, P), rank loads (L, G), how many slots of each expert each rank holds
    ``on_rank`` (L, N, G), and which slots are moved relative to the old placement.
    """

    def __init__(self, w, cur, held_before, on_rank, goal, num_ranks, num_nodes, limit):
        self.w = w
        self.cur = cur
        self.held = held_before  # (L, N, G) bool: expert e was on rank g in the old placement
        self.T = goal
        self.G = num_ranks
        self.nodes = num_nodes
        self.limit = limit  # (L,) moves a layer may spend
        self.L, self.P = cur.shape
        self.N = w.shape[1]
        self.S = self.P // num_ranks
        self.Gn = num_ranks // num_nodes
        self.rank_of_slot = np.arange(self.P) // self.S
        self.node_of_rank = np.arange(num_ranks) // self.Gn
        self.count = _counts(cur, self.N)
        self.sl = _slot_loads(w, cur, self.count)
        self.RL = self.sl.reshape(self.L, num_ranks, self.S).sum(-1)
        self.on_rank = on_rank  # updated in place
        rows = np.arange(self.L)
        self.moved = ~self.held[rows[:, None], np.maximum(cur, 0), self.rank_of_slot[None, :]]
        self.moves = self.moved.sum(1)
        # node of every expert (fixed: repairs never move an expert to another node)
        self.node_of_expert = np.zeros((self.L, self.N), dtype=np.int64)
        self.node_of_expert[rows[:, None], np.maximum(cur, 0)] = self.node_of_rank[self.rank_of_slot][None, :]
        self.rounds = 0

    # -- bookkeeping ------------------------------------------------------
    def _set_slots(self, rows: np.ndarray, slots: np.ndarray, experts: np.ndarray) -> None:
        """Point ``slots`` of ``rows`` (distinct pairs) at ``experts``; counts are the caller's job."""
        ranks = self.rank_of_slot[slots]
        np.subtract.at(self.on_rank, (rows, self.cur[rows, slots], ranks), 1)
        np.add.at(self.on_rank, (rows, experts, ranks), 1)
        self.cur[rows, slots] = experts
        now = ~self.held[rows, experts, ranks]
        np.add.at(self.moves, rows, now.astype(np.int64) - self.moved[rows, slots])
        self.moved[rows, slots] = now

    def _swap(self, rows: np.ndarray, slot_a: np.ndarray, slot_b: np.ndarray) -> None:
        xa = self.cur[rows, slot_a]
        xb = self.cur[rows, slot_b]
        la = self.sl[rows, slot_a]
        lb = self.sl[rows, slot_b]
        self._set_slots(rows, slot_a, xb)
        self._set_slots(rows, slot_b, xa)
        self.sl[rows, slot_a] = lb
        self.sl[rows, slot_b] = la
        np.add.at(self.RL, (rows, self.rank_of_slot[slot_a]), lb - la)
        np.add.at(self.RL, (rows, self.rank_of_slot[slot_b]), la - lb)

    def _repoint(self, rows: np.ndarray, slots: np.ndarray, new: np.ndarray, old: np.ndarray) -> None:
        self.count[rows, old] -= 1
        self.count[rows, new] += 1
        self._set_slots(rows, slots, new)
        cur = self.cur[rows]
        self.sl[rows] = _slot_loads(self.w[rows], cur, self.count[rows])
        self.RL[rows] = self.sl[rows].reshape(len(rows), self.G, self.S).sum(-1)

    # -- candidate moves --------------------------------------------------
    def _swaps(self, lr: np.ndarray, RL: np.ndarray, T: np.ndarray):
        """Best swap of every (overloaded, light) rank pair, ``None`` when there is no pair.

        Returns ``(eff, slot_a, slot_b, rank_o, rank_u)``, each (n, K); ``eff`` is the
        excess removed per moved slot, -inf where the pair has no useful swap.
        """
        n, S = len(lr), self.S
        npair = self.Gn // 2
        if npair == 0:
            return None
        RLn = RL.reshape(n, self.nodes, self.Gn)
        k = int(min(npair, (RLn > T[:, None, None]).sum(-1).max(initial=0)))
        if k == 0:
            return None
        order = np.argsort(-RLn, axis=2, kind="stable")
        base = (np.arange(self.nodes) * self.Gn)[None, :, None]
        o = (order[:, :, :k] + base).reshape(n, -1)
        u = (order[:, :, ::-1][:, :, :k] + base).reshape(n, -1)
        a = np.take_along_axis(RL, o, 1) - T[:, None]  # excess of the heavy rank (> 0 when it counts)
        b = np.take_along_axis(RL, u, 1) - T[:, None]  # excess of the light rank (usually < 0)
        ar = np.arange(S)
        so = o[:, :, None] * S + ar  # (n, K, S) slots of the heavy rank
        su = u[:, :, None] * S + ar  # slots of the light rank
        l3 = lr[:, None, None]
        ea, eb = self.cur[l3, so], self.cur[l3, su]
        d = self.sl[l3, so][..., :, None] - self.sl[l3, su][..., None, :]  # load moved from o to u
        a4, b4 = a[..., None, None], b[..., None, None]
        gain = np.maximum(a4 - d, 0.0)
        np.subtract(np.maximum(a4, 0.0) + np.maximum(b4, 0.0), gain, out=gain)
        gain -= np.maximum(b4 + d, 0.0)
        o3, u3 = o[:, :, None], u[:, :, None]
        cost = (
            (~self.held[l3, eb, o3]).astype(np.int8)[..., None, :]
            + (~self.held[l3, ea, u3]).astype(np.int8)[..., :, None]
            - self.moved[l3, so].astype(np.int8)[..., :, None]
            - self.moved[l3, su].astype(np.int8)[..., None, :]
        )
        tol = _TOL * T[:, None, None, None]
        eff = np.where((gain > tol) & (ea[..., :, None] != eb[..., None, :]), gain / np.maximum(cost, _FREE_COST), -np.inf)
        # ties: the more even split of the pair's load
        key = (eff - 1e-9 * np.abs(a4 - b4 - 2 * d) / np.maximum(np.abs(a4) + np.abs(b4), 1e-300)).reshape(n, -1, S * S)
        best = key.argmax(2)
        eff = np.take_along_axis(eff.reshape(n, -1, S * S), best[..., None], 2)[..., 0]
        cost = np.take_along_axis(cost.reshape(n, -1, S * S), best[..., None], 2)[..., 0].astype(np.int64)
        ia, ib = np.divmod(best, S)
        slot_a = o * S + ia
        slot_b = u * S + ib
        # respect the move limit, heaviest pairs first
        good = np.isfinite(eff)
        room = (self.limit[lr] - self.moves[lr])[:, None]
        good &= np.cumsum(np.where(good, np.maximum(cost, 0), 0), 1) <= room
        return np.where(good, eff, -np.inf), slot_a, slot_b, o, u

    def _repoints(self, lr: np.ndarray, RL: np.ndarray, T: np.ndarray, E: np.ndarray):
        """Best re-point per layer: ``(eff (n,), slot, new expert, donor expert, touched ranks (n, G))``."""
        n, S, G = len(lr), self.S, self.G
        rows = np.arange(n)
        cur, w, count = self.cur[lr], self.w[lr], self.count[lr]
        top = RL.argmax(1)
        hot = cur[rows[:, None], top[:, None] * S + np.arange(S)]  # (n, S) experts of the max rank
        w_hot = np.take_along_axis(w, hot, 1)
        c_hot = np.take_along_axis(count, hot, 1)
        hot_on = self.on_rank[lr[:, None], hot]  # (n, S, G)
        relieved = RL[:, None, :] - hot_on * (w_hot / c_hot - w_hot / (c_hot + 1))[..., None]
        relief = E[:, None] - np.maximum(relieved - T[:, None, None], 0.0).sum(-1)
        ky = min(_HOT_CANDIDATES, S)
        pick = np.argsort(-relief, axis=1, kind="stable")[:, :ky]
        y = np.take_along_axis(hot, pick, 1)  # (n, ky)
        wy = np.take_along_axis(w_hot, pick, 1)
        cy = np.take_along_axis(c_hot, pick, 1)
        relieved = np.take_along_axis(relieved, pick[..., None], 1)  # (n, ky, G)
        # donors: experts whose loss of one replica adds the least load to each remaining one
        harm = np.where(count >= 2, w / np.maximum(count * (count - 1), 1), np.inf)
        kx = min(_DONOR_CANDIDATES, self.N)
        x = np.argpartition(harm, kx - 1, axis=1)[:, :kx] if kx < self.N else np.tile(np.arange(self.N), (n, 1))
        wx = np.take_along_axis(w, x, 1)
        cx = np.take_along_axis(count, x, 1)
        x_ok = cx >= 2
        x_on = self.on_rank[lr[:, None], x]  # (n, kx, G)
        grow = np.where(x_ok, wx / np.maximum(cx - 1, 1) - wx / np.maximum(cx, 1), 0.0)
        loads = relieved[:, :, None, :] + (x_on * grow[..., None])[:, None]  # (n, ky, kx, G)
        T4 = T[:, None, None, None]
        excess = np.maximum(loads - T4, 0.0)
        # the re-pointed slot (on rank g) drops its x replica and holds a y replica instead
        swing = (wy / (cy + 1))[:, :, None, None] - (wx / np.maximum(cx - 1, 1))[:, None, :, None]
        after = excess.sum(-1, keepdims=True) - excess + np.maximum(loads + swing - T4, 0.0)
        gain = E[:, None, None, None] - after
        lrG = lr[:, None, None]
        cost = (~self.held[lrG, y[:, :, None], np.arange(G)]).astype(np.int8)[:, :, None, :] - (
            ~self.held[lrG, x[:, :, None], np.arange(G)]
        ).astype(np.int8)[:, None, :, :]
        ok = (x_on > 0)[:, None] & x_ok[:, None, :, None] & (x[:, None, :] != y[:, :, None])[..., None]
        ok &= gain > _TOL * T4
        if self.nodes > 1:
            node = self.node_of_expert[lr]
            ok &= (np.take_along_axis(node, x, 1)[:, None, :] == np.take_along_axis(node, y, 1)[:, :, None])[..., None]
        ok &= (self.moves[lr][:, None, None, None] + cost) <= self.limit[lr][:, None, None, None]
        eff = np.where(ok, gain / np.maximum(cost, _FREE_COST), -np.inf).reshape(n, -1)
        best = eff.argmax(1)
        eff = eff[rows, best]
        iy, rest = np.divmod(best, kx * G)
        ix, rank = np.divmod(rest, G)
        new_expert = y[rows, iy]
        donor = x[rows, ix]
        # the slot: the first one of that rank holding the donor
        in_rank = cur.reshape(n, G, S)[rows, rank]
        slot = rank * S + (in_rank == donor[:, None]).argmax(1)
        touched = (self.on_rank[lr, new_expert] > 0) | (self.on_rank[lr, donor] > 0)
        return eff, slot, new_expert, donor, touched

    def _widened_swap(self, lr: np.ndarray) -> np.ndarray:
        """Best swap of the max rank with any slot of its node, for layers with no other move; returns found (n,)."""
        n, S, P = len(lr), self.S, self.P
        rows = np.arange(n)
        RL, T = self.RL[lr], self.T[lr]
        top = RL.argmax(1)
        sa = top[:, None] * S + np.arange(S)  # (n, S)
        ea = self.cur[lr[:, None], sa]
        eb = self.cur[lr]
        d = self.sl[lr[:, None], sa][:, :, None] - self.sl[lr][:, None, :]  # (n, S, P)
        a = (RL[rows, top] - T)[:, None, None]
        b = (RL - T[:, None])[:, self.rank_of_slot][:, None, :]
        gain = np.maximum(a, 0.0) + np.maximum(b, 0.0) - np.maximum(a - d, 0.0) - np.maximum(b + d, 0.0)
        q = self.rank_of_slot[None, None, :]
        lr3 = lr[:, None, None]
        cost = (
            (~self.held[lr3, eb[:, None, :], top[:, None, None]]).astype(np.int8)
            + (~self.held[lr3, ea[:, :, None], q]).astype(np.int8)
            - self.moved[lr[:, None], sa].astype(np.int8)[:, :, None]
            - self.moved[lr].astype(np.int8)[:, None, :]
        )
        ok = (gain > _TOL * T[:, None, None]) & (ea[:, :, None] != eb[:, None, :]) & (q != top[:, None, None])
        ok &= self.node_of_rank[self.rank_of_slot][None, None, :] == self.node_of_rank[top][:, None, None]
        ok &= (self.moves[lr][:, None, None] + cost) <= self.limit[lr][:, None, None]
        eff = np.where(ok, gain / np.maximum(cost, _FREE_COST), -np.inf).reshape(n, -1)
        best = eff.argmax(1)
        found = np.isfinite(eff[rows, best])
        ia, sb = np.divmod(best, P)
        if found.any():
            f = rows[found]
            self._swap(lr[f], sa[f, ia[f]], sb[f])
        return found

    # -- main loop ----------------------------------------------------------
    def run(self, live: np.ndarray, max_rounds: int, budget: float, fixed_max: float) -> None:
        """Search until every live layer meets its goal, is stuck or out of moves, or the
        budget on the sum of maxima holds (``fixed_max``: the layers outside the search)."""
        rows_all = np.arange(self.L)
        live = live & (self.RL.max(1) > self.T)
        searched = live.copy()
        while live.any() and self.rounds < max_rounds:
            self.rounds += 1
            lr = rows_all[live]
            RL, T = self.RL[lr], self.T[lr]
            E = np.maximum(RL - T[:, None], 0.0).sum(1)
            swaps = self._swaps(lr, RL, T)
            best_swap = swaps[0].max(1) if swaps is not None else np.full(len(lr), -np.inf)
            rp_eff, rp_slot, rp_new, rp_old, touched = self._repoints(lr, RL, T, E)
            use_rp = np.isfinite(rp_eff) & (rp_eff >= best_swap)
            acted = use_rp.copy()
            if swaps is not None:
                eff, slot_a, slot_b, o, u = swaps
                i = np.arange(len(lr))[:, None]
                # next to a re-point, only pairs of ranks it does not touch
                free = ~use_rp[:, None] | (~touched[i, o] & ~touched[i, u])
                pick = np.isfinite(eff) & free
                pi, pk = np.nonzero(pick)
                if pi.size:
                    self._swap(lr[pi], slot_a[pi, pk], slot_b[pi, pk])
                acted |= pick.any(1)
            if use_rp.any():
                i = np.nonzero(use_rp)[0]
                self._repoint(lr[i], rp_slot[i], rp_new[i], rp_old[i])
            if not acted.all():
                idle = lr[~acted]
                found = self._widened_swap(idle)
                live[idle[~found]] = False
            layer_max = self.RL.max(1)
            live &= (layer_max > self.T) & (self.moves < self.limit)
            if fixed_max + float(layer_max[searched].sum()) <= budget:
                break


# --------------------------------------------------------------------------- planning


def _on_rank(phy2log: np.ndarray, num_experts: int, num_ranks: int) -> np.ndarray:
    """(L, N, G) int64: slots of expert e on rank g (empty slots ignored)."""
    num_layers, num_slots = phy2log.shape
    rank = np.arange(num_slots) // (num_slots // num_ranks)
    width = (num_experts + 1) * num_ranks
    flat = np.where(phy2log >= 0, phy2log, num_experts) * num_ranks + rank[None, :] + width * np.arange(num_layers)[:, None]
    out = np.bincount(flat.ravel(), minlength=num_layers * width)
    return out.reshape(num_layers, num_experts + 1, num_ranks)[:, :num_experts]


def _default_placement(weight32: "torch.Tensor", num_slots: int, groups: int, nodes: int, num_ranks: int) -> np.ndarray:
    """The default policy's phy2log (L, P) on validated input, without building log2phy."""
    try:
        from eplb_fsm.policy.default import rebalance_hierarchical

        result = rebalance_hierarchical(weight32, num_slots, groups, nodes, num_ranks)
        phy = np.asarray(result[0], dtype=np.int64)
        if phy.shape == (weight32.shape[0], num_slots):
            return phy
    except (ImportError, TypeError, ValueError, IndexError):  # pragma: no cover - API drift
        pass
    return DefaultEplbPolicy.rebalance_experts(weight32, num_slots, groups, nodes, num_ranks)[0].numpy()


def plan_movement(
    weight: "torch.Tensor | np.ndarray",
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_ranks: int,
    old_phy2log: "torch.Tensor | np.ndarray | None",
    target: float = DEFAULT_TARGET,
    max_moves: int | None = None,
) -> MovementPlan:
    """Movement-aware placement with diagnostics (see the module docstring for the algorithm).

    Arguments are those of ``rebalance_experts`` plus ``target`` (fraction of the default's
    balancedness to reach, in (0, 1]) and ``max_moves`` (moved slots allowed per layer,
    None for no limit; when the limit and the target disagree, the limit wins).
    With ``old_phy2log=None`` the plan is the default's. Raises ``ValueError`` naming the
    argument for bad input.
    """
    import torch

    target = _check_target(target)
    max_moves = _check_max_moves(max_moves)
    weight32, num_slots, groups, nodes, num_ranks = check_rebalance_args(
        weight, num_replicas, num_groups, num_nodes, num_ranks, old_phy2log
    )
    num_layers, num_experts = weight32.shape
    d_phy = _default_placement(weight32, num_slots, groups, nodes, num_ranks)
    d_count = _counts(d_phy, num_experts)
    none = np.zeros(num_layers, dtype=bool)
    if old_phy2log is None:
        zeros = np.zeros(num_layers, np.int64)
        return MovementPlan(d_phy, zeros, d_phy, d_count, zeros.copy(), none.copy(), none.copy(), ~none, 0)
    old = _check_old(old_phy2log, num_layers, num_slots, num_experts)

    # loads in float64 from the caller's values (the default casts to float32 itself)
    if isinstance(weight, torch.Tensor):
        w = weight.detach().cpu().to(torch.float64).numpy()
    else:
        w = np.asarray(weight, dtype=np.float64)
    slots_per_rank = num_slots // num_ranks
    rows = np.arange(num_layers)
    rank_of_slot = np.arange(num_slots) // slots_per_rank

    def max_load(phy: np.ndarray, count: np.ndarray) -> np.ndarray:
        return _slot_loads(w, phy, count).reshape(num_layers, num_ranks, slots_per_rank).sum(-1).max(1)

    d_max = max_load(d_phy, d_count)
    budget = float(d_max.sum()) / target

    hierarchical = nodes > 1
    has_empty = (old < 0).any(1)
    # layers the search cannot start from (hierarchical mode): a group spread over nodes,
    # or empty slots, which only a node-aware fill could place
    forced = (_group_spans_nodes(old, num_experts, groups, nodes) | has_empty) if hierarchical else none.copy()
    cur = old.copy()
    if (has_empty & ~forced).any():
        _fill_empty_slots(cur, w, rows[has_empty & ~forced])
    cur_max = max_load(cur, _counts(cur, num_experts))

    on_rank = _on_rank(old, num_experts, num_ranks)
    held = on_rank > 0  # (L, N, G): expert e was on rank g
    filled = rows[has_empty & ~forced]
    if filled.size:
        rank_of = np.broadcast_to(rank_of_slot, (filled.size, num_slots))
        new_slot = old[filled] < 0
        np.add.at(on_rank, (np.broadcast_to(filled[:, None], new_slot.shape)[new_slot], cur[filled][new_slot],
                            rank_of[new_slot]), 1)

    def moved_count(phy: np.ndarray) -> np.ndarray:
        return ((phy >= 0) & ~held[rows[:, None], np.maximum(phy, 0), rank_of_slot[None, :]]).sum(1)

    d_moved = moved_count(d_phy)
    if not forced.any() and not has_empty.any() and cur_max.sum() <= budget * (1 + _TOL):
        return MovementPlan(old, np.zeros(num_layers, np.int64), d_phy, d_count, d_moved, ~none, none.copy(),
                            none.copy(), 0)

    free = ~forced
    lam = _water_level(cur_max[free], d_max[free], budget - float(d_max[forced].sum()))
    goal = np.minimum(cur_max, lam * d_max) if math.isfinite(lam) else cur_max.copy()
    goal = np.where(forced, d_max, goal) * (1 - _TOL)
    active = free & (cur_max > goal)
    limit = np.maximum((_GIVE_UP_FRACTION * d_moved).astype(np.int64), 1)
    if max_moves is not None:
        limit = np.minimum(limit, max_moves)

    repair = _Repair(w, cur, held, on_rank, goal, num_ranks, nodes, limit)
    fixed_max = float(np.where(forced, d_max, cur_max)[~active].sum())
    repair.run(active.copy(), _MAX_ROUNDS, budget, fixed_max)
    cur = repair.cur
    new_max = repair.RL.max(1)
    new_moves = repair.moves

    # per layer: the repaired placement or the renumbered default
    fallback = forced | (active & (new_moves >= d_moved))
    chosen_max = np.where(fallback, d_max, np.where(active, new_max, cur_max))
    excess = chosen_max.sum() - budget
    if excess > _TOL * budget:
        # the layers furthest above the default's max fall back first
        cand = rows[active & ~fallback & (new_max > d_max)]
        cand = cand[np.argsort(-(new_max - d_max)[cand], kind="stable")]
        saved = np.cumsum(new_max[cand] - d_max[cand])
        fallback[cand[: int(np.searchsorted(saved, excess)) + 1]] = True
    out = cur
    fallback_rows = rows[fallback]
    if fallback_rows.size:
        relabeled = relabel_ranks(d_phy[fallback_rows], held[fallback_rows].transpose(0, 2, 1), num_ranks, nodes)
        relabeled = align_rows(old[fallback_rows], relabeled, num_ranks)
        if max_moves is not None:
            # a fallback that breaks the move limit is not taken (unless the layer must change)
            over = moved_count_rows(held[fallback_rows], relabeled, rank_of_slot) > max_moves
            over &= ~forced[fallback_rows]
            fallback[fallback_rows[over]] = False
            relabeled, fallback_rows = relabeled[~over], fallback_rows[~over]
        out[fallback_rows] = relabeled
    moved = moved_count(out)
    changed = (out != old).any(1)
    return MovementPlan(
        phy2log=out,
        moved=moved,
        default_phy2log=d_phy,
        default_replica_count=d_count,
        default_moved=d_moved,
        kept=~changed,
        repaired=changed & ~fallback,
        fallback=fallback,
        rounds=repair.rounds,
    )


def moved_count_rows(held: np.ndarray, phy: np.ndarray, rank_of_slot: np.ndarray) -> np.ndarray:
    """Moved slots per row of ``phy`` (R, P) given ``held`` (R, N, G) of the old placement."""
    rows = np.arange(phy.shape[0])
    return ((phy >= 0) & ~held[rows[:, None], np.maximum(phy, 0), rank_of_slot[None, :]]).sum(1)


# --------------------------------------------------------------------------- policy


class _ClassOrInstanceMethod:
    """Bind a function to the instance when called on one, else to the class.

    ``MovementAwarePolicy.rebalance_experts(...)`` then uses the class defaults and
    ``MovementAwarePolicy(target=0.95).rebalance_experts(...)`` the instance's settings,
    with one signature for both.
    """

    def __init__(self, func: Callable[..., Any]) -> None:
        self.__func__ = func
        self.__doc__ = func.__doc__
        self.__name__ = func.__name__

    def __get__(self, instance: Any, owner: type | None = None) -> Callable[..., Any]:
        return types.MethodType(self.__func__, instance if instance is not None else owner)


def _rebalance_experts(
    policy: Any,
    weight: "torch.Tensor",
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_ranks: int,
    old_phy2log: "torch.Tensor | None" = None,
) -> tuple["torch.Tensor", "torch.Tensor", "torch.Tensor"]:
    """Return ``(phy2log (L, P), log2phy (L, N, P-N+1), replica_count (L, N))``, int64 CPU tensors.

    Without ``old_phy2log`` this is exactly the default policy. With it, the placement
    keeps as much of ``old_phy2log`` as the balancedness target allows (module docstring).
    Called on the class it uses ``target=0.99, max_moves=None``; on an instance, the
    instance's settings.
    """
    import torch

    if old_phy2log is None:
        return DefaultEplbPolicy.rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_ranks)
    plan = plan_movement(
        weight, num_replicas, num_groups, num_nodes, num_ranks, old_phy2log,
        target=policy.target, max_moves=policy.max_moves,
    )
    num_experts = plan.default_replica_count.shape[1]
    log2phy, replica_count = build_log2phy(plan.phy2log, num_experts, int(num_replicas) - num_experts + 1)
    return torch.from_numpy(np.ascontiguousarray(plan.phy2log)), torch.from_numpy(log2phy), torch.from_numpy(replica_count)


class MovementAwarePolicy(AbstractEplbPolicy):
    """Keeps the old placement and repairs it; moves far fewer slots than the default.

    Args:
        target: fraction of the default policy's balancedness (on the same load) the
            placement must reach, in (0, 1]; 1.0 asks for the default's quality and moves
            only what the default's renumbered placement would not. Default 0.99
            (``EplbConfig.movement_balancedness_target``).
        max_moves: at most this many moved slots per layer (None: no limit). A layer that
            cannot reach the target within it keeps its best repair and the target may be
            missed: the limit wins.

    ``MovementAwarePolicy.rebalance_experts(...)`` (on the class) uses the defaults;
    ``MovementAwarePolicy(target=0.95).rebalance_experts(...)`` uses its own settings.
    """

    name = "movement_aware"
    target: float = DEFAULT_TARGET
    max_moves: int | None = None

    def __init__(self, target: float = DEFAULT_TARGET, max_moves: int | None = None) -> None:
        self.target = _check_target(target)
        self.max_moves = _check_max_moves(max_moves)

    @classmethod
    def from_config(cls, config: Any) -> "MovementAwarePolicy":
        """An instance with ``config.movement_balancedness_target`` as its target."""
        return cls(target=config.movement_balancedness_target)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(target={self.target}, max_moves={self.max_moves})"

    rebalance_experts = _ClassOrInstanceMethod(_rebalance_experts)  # type: ignore[assignment]


register_policy(MovementAwarePolicy.name, MovementAwarePolicy)
