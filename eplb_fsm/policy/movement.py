"""The movement-aware policy: keep most of the old placement, repair what the new load breaks.

The default policy re-plans from scratch, so a small drift in load moves almost every
slot. This policy starts from the placement in use (``old_phy2log``) and changes as few
slots as it can while staying within a target fraction of the default's balancedness
(design section 2: sum over layers of mean rank load / sum over layers of max rank load).
A slot is *moved* when its new expert was not on its rank before (its weights cross the
network); changes inside a rank are free.

Algorithm (numpy, vectorised over layers; docs/policies.md has the long version):

1. Plan with the default policy on the new load: its placement is the reference (max
   rank load ``d_l`` per layer) and the fallback. The mean rank load does not depend on
   the placement, so reaching ``target`` x the default's balancedness means
   ``sum_l max_l <= sum_l d_l / target``: one budget on the sum of per-layer maxima.
2. If the old placement fits the budget under the new load, keep it: zero moves.
3. Give every layer a max-load goal so that the goals fit the budget while as few ranks
   as possible sit above them (a price per rank to fix, bisected: Lagrangian
   relaxation); in hierarchical mode, where node totals cannot change, a common
   fraction above the default's max instead ("water level").
4. Replica counts: experts whose load per replica is far above the default's largest
   get extra replicas in one pass, from experts that can spare them.
5. Local search, a few rounds, every round all layers at once. The objective is the
   excess ``sum_g max(0, load_g - goal)``; candidate changes are ranked by excess
   removed per moved slot, counted against the *old* placement (a slot that gets back
   an expert its rank held is free again):
   - a **re-point**: one slot of a donor expert (>= 2 replicas) takes a new replica of a
     hot expert of the most loaded rank; it changes replica counts, so it relieves every
     rank holding that expert for one moved slot;
   - **swaps**: in every node the k-th most loaded overloaded rank is paired with the
     k-th lightest rank and the pair swaps its best two slots (pairs are disjoint, so a
     round applies them together);
   - a layer with neither tries the most loaded rank against the lightest ranks.
   The first rounds prefer re-points (they fix many ranks at once). A round that can meet
   the budget only carries out the layers' plans that reduce the sum of maxima most per
   moved slot, and the search stops there.
6. Fallback: a layer whose old max rank load is above 1.5x the default's is re-planned
   without a search; a layer whose repair would move as much as the default, or that
   gave up after moving half as much, and, if the budget is still missed, the layers
   furthest above the default's max, take the default's placement with its ranks
   renumbered to match the old ones (:func:`~eplb_fsm.policy.movement_cost.relabel_ranks`)
   and rows aligned (:func:`~eplb_fsm.policy.movement_cost.align_rows`), which moves
   less than the default's own numbering and never more. Other layers left above their
   goal are kept: the budget is over the sum of maxima, not per layer.

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
from eplb_fsm.policy.movement_cost import align_rows, relabel_ranks
from eplb_fsm.policy.registry import register_policy

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["DEFAULT_TARGET", "MovementAwarePolicy", "MovementPlan", "plan_movement"]

#: default fraction of the default policy's balancedness to reach (EplbConfig.movement_balancedness_target)
DEFAULT_TARGET = 0.99

# -- tuning (module constants: the same for every rank, so every rank plans the same) --
# A layer whose repair has moved this fraction of what the default would move gives up
# and takes the (renumbered) default placement: past that point the saving is small.
_GIVE_UP_FRACTION = 0.5
# A layer whose old placement has a max rank load above this multiple of the default's
# is re-planned (renumbered default) without a search: repairing it would take too long.
_REPLAN_RATIO = 1.5
# Local-search rounds (every round handles all layers at once).
_MAX_ROUNDS = 10
# Rounds that consider re-points at all.
_REPOINT_ROUNDS = 3
# ... and only while more than this share of the searched layers takes one.
_REPOINT_MIN_SHARE = 0.1
# Rounds at the start in which a layer with a useful re-point does only that.
_REPOINT_FIRST_ROUNDS = 2
# Hot experts (from the most loaded rank) and donor experts tried per re-point.
_HOT_CANDIDATES = 2
_DONOR_CANDIDATES = 6
# Lightest ranks tried by the widened swap of a layer that has no other move.
_WIDE_PARTNERS = 8
# Count pass: experts whose load per replica exceeds this multiple of the default's
# largest load per replica get more replicas before the search.
_COUNT_CAP = 1.25
# Goals never go below this multiple of the default's max rank load (flat mode) ...
_GOAL_FLOOR = 1.006
# ... nor, in hierarchical mode, below this fraction above the busiest node's mean.
_NODE_SLACK = 0.01
# A swap or re-point that moves nothing (cost <= 0) is ranked as if it cost this much.
_FREE_COST = 0.5
# Even-split tie-break weight in swap scores (load units per load unit).
_TIE = 1e-4
# float32 swap scoring: an improvement must exceed this fraction of the goal.
_SWAP_TOL = 1e-5
# 1 / max(cost, _FREE_COST) for a swap's cost in moved slots (-2 .. 2).
_INV_COST = np.array([1.0 / max(c, _FREE_COST) for c in range(-2, 3)], dtype=np.float32)
_TOL = 1e-9
# The budget is met with this relative margin, so float rounding never lands below target.
_BUDGET_MARGIN = 1e-7


@dataclasses.dataclass
class MovementPlan:
    """A movement-aware placement and how it was reached (numpy arrays, per layer).

    ``phy2log`` (L, P); ``moved`` (L,) slots whose expert is new to their rank (-1 where
    not computed, see ``plan_movement(diagnostics=...)``); ``default_phy2log`` /
    ``default_replica_count`` / ``default_moved``: the default policy's placement, its
    counts and its moves (same convention); ``kept``: layer unchanged; ``repaired``:
    layer changed by local search; ``fallback``: layer took the renumbered default
    placement; ``rounds``: local-search rounds run.
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
    missing = _counts(old, num_experts) == 0
    if missing.any():
        layer, expert = (int(i) for i in np.argwhere(missing)[0])
        raise ValueError(
            f"old_phy2log must place every expert at least once; layer {layer} has no slot for expert {expert}"
            f" ({int(missing.sum())} missing in all)"
        )
    return old


# --------------------------------------------------------------------------- helpers


def _counts(phy2log: np.ndarray, num_experts: int) -> np.ndarray:
    """(L, N) replicas of every expert (empty slots ignored)."""
    num_layers = phy2log.shape[0]
    width = num_experts + 1
    flat = np.where(phy2log >= 0, phy2log, num_experts) + width * np.arange(num_layers)[:, None]
    return np.bincount(flat.ravel(), minlength=num_layers * width).reshape(num_layers, width)[:, :num_experts]


def _on_rank(phy2log: np.ndarray, num_experts: int, num_ranks: int) -> np.ndarray:
    """(L, N, G) int64: slots of expert e on rank g (empty slots ignored)."""
    num_layers, num_slots = phy2log.shape
    rank = np.arange(num_slots) // (num_slots // num_ranks)
    width = (num_experts + 1) * num_ranks
    flat = np.where(phy2log >= 0, phy2log, num_experts) * num_ranks + rank[None, :] + width * np.arange(num_layers)[:, None]
    out = np.bincount(flat.ravel(), minlength=num_layers * width)
    return out.reshape(num_layers, num_experts + 1, num_ranks)[:, :num_experts]


def _slot_loads(w: np.ndarray, phy2log: np.ndarray, count: np.ndarray) -> np.ndarray:
    """(L, P) load of every slot: its expert's load / replica count (0 for empty slots)."""
    expert = np.maximum(phy2log, 0)
    r = np.arange(phy2log.shape[0])[:, None]
    load = w[r, expert] / np.maximum(count[r, expert], 1)
    return np.where(phy2log >= 0, load, 0.0)


def _moved_per_layer(old: np.ndarray, new: np.ndarray, num_ranks: int) -> np.ndarray:
    """(L,) slots of ``new`` whose expert was on none of its rank's slots in ``old``."""
    num_layers, num_slots = new.shape
    if num_layers == 0:
        return np.zeros(0, dtype=np.int64)
    s = num_slots // num_ranks
    o = old.reshape(num_layers, num_ranks, 1, s)
    n = new.reshape(num_layers, num_ranks, s, 1)
    stayed = (n == o).any(-1)
    return ((n[..., 0] >= 0) & ~stayed).reshape(num_layers, -1).sum(1)


def _water_level(current_max: np.ndarray, default_max: np.ndarray, budget: float) -> float:
    """Largest lam with sum(min(m, lam * d)) <= budget (m, d >= 0); inf when sum(m) fits."""
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


def _lagrange_levels(rank_loads: np.ndarray, floor: np.ndarray, budget: float) -> np.ndarray:
    """Per-layer max-load goals with ``sum(goal) <= budget`` that leave the fewest ranks to fix.

    A layer whose goal is below k of its ranks must fix those k (the cost), and no goal
    goes below ``floor``; with the ranks sorted, fixing k ranks gives the goal
    ``max(R[l, k], floor[l])``. Each layer takes the k that maximises (reduction of its
    max - mu * k) for a price mu per rank; mu is bisected to the largest price whose
    plan still fits the budget (a Lagrangian relaxation of the knapsack).
    """
    num_layers, num_ranks = rank_loads.shape
    r = -np.sort(-rank_loads, axis=1)
    level = np.concatenate([np.maximum(r, floor[:, None]), floor[:, None]], axis=1)  # (L, G+1)
    reduction = level[:, :1] - level
    need = float(r[:, 0].sum()) - budget
    if need <= 0:
        return r[:, 0].copy()
    k = np.arange(num_ranks + 1)
    rows = np.arange(num_layers)

    def plans(mu: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        pick = (reduction[None] - mu[:, None, None] * k).argmax(2)  # (M, L)
        return pick, np.take_along_axis(reduction[None], pick[:, :, None], 2)[:, :, 0].sum(1)

    # a geometric grid of prices, then a linear one between the two that bracket the need
    # (a few vectorised passes instead of a long bisection loop)
    hi = float(reduction.max()) + 1.0
    mu = hi * 0.5 ** np.arange(40.0)[::-1]  # ascending
    lo_mu, hi_mu = 0.0, hi
    best = np.full(num_layers, num_ranks)
    for _ in range(2):
        pick, total = plans(mu)
        ok = total >= need  # True for small prices, False for large ones
        if ok.any():
            i = int(np.nonzero(ok)[0].max())
            best, lo_mu = pick[i], float(mu[i])
            hi_mu = float(mu[i + 1]) if i + 1 < mu.size else hi_mu
        else:
            hi_mu = float(mu[0])
        mu = np.linspace(lo_mu, hi_mu, 66)[1:-1]
    return level[rows, best]


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
        todo = rows[(cur[rows] < 0).any(1)]
        if todo.size == 0:
            return
        slot = (cur[todo] < 0).argmax(1)
        per = w[todo] / np.maximum(_counts(cur[todo], num_experts), 1)
        cur[todo, slot] = per.argmax(1)


def _default_placement(weight32: "torch.Tensor", num_slots: int, groups: int, nodes: int, num_ranks: int) -> np.ndarray:
    """The default policy's phy2log (L, P) on validated input, without building log2phy."""
    try:
        from eplb_fsm.policy.default import rebalance_hierarchical

        phy = np.asarray(rebalance_hierarchical(weight32, num_slots, groups, nodes, num_ranks)[0], dtype=np.int64)
        if phy.shape == (weight32.shape[0], num_slots):
            return phy
    except (ImportError, TypeError, ValueError, IndexError):  # pragma: no cover - internal API drift
        pass
    return DefaultEplbPolicy.rebalance_experts(weight32, num_slots, groups, nodes, num_ranks)[0].numpy()


# --------------------------------------------------------------------------- local search


class _Repair:
    """Vectorised local search over the layers that miss their goal (see the module doc).

    State per layer: the placement ``cur`` (L, P), replica counts (L, N), slot loads
    (L, P), rank loads ``RL`` (L, G), how many slots of each expert each rank holds
    ``on_rank`` (L, N, G), which (expert, rank) pairs the old placement had ``held``
    (L, N, G), and which slots are moved relative to the old placement.
    """

    def __init__(self, w, cur, held_before, on_rank, goal, num_ranks, num_nodes, limit):
        self.w = w
        self.cur = cur
        self.held = held_before
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
        self.moved = ~self.held[rows[:, None], cur, self.rank_of_slot[None, :]]
        self.moves = self.moved.sum(1)
        # node of every expert (fixed: repairs never move an expert to another node)
        self.node_of_expert = np.zeros((self.L, self.N), dtype=np.int64)
        self.node_of_expert[rows[:, None], cur] = self.node_of_rank[self.rank_of_slot][None, :]
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
        self.sl[rows] = _slot_loads(self.w[rows], self.cur[rows], self.count[rows])
        self.RL[rows] = self.sl[rows].reshape(len(rows), self.G, self.S).sum(-1)

    # -- candidate moves --------------------------------------------------
    def _swaps(self, lr: np.ndarray, RL: np.ndarray, T: np.ndarray):
        """Best swap of every (overloaded, light) rank pair of the layers ``lr``; None if no pair.

        In every node the k-th most loaded rank, while above the goal and k < ranks / 2,
        is paired with the k-th lightest, so pairs never share a rank. Returns
        ``(pair_layer, eff, slot_a, slot_b, rank_o, rank_u, cost, delta)``, each (M,):
        ``pair_layer`` indexes ``lr``; ``eff`` is the excess removed per moved slot (-inf:
        no useful swap or over the move limit); ``delta`` the load moved from o to u.
        """
        n, S, Gn = len(lr), self.S, self.Gn
        if Gn < 2 or n == 0:
            return None
        RLn = RL.reshape(n, self.nodes, Gn)
        order = np.argsort(-RLn, axis=2)
        half = Gn // 2
        heavy = order[:, :, :half]
        light = order[:, :, ::-1][:, :, :half]
        pr, pn, pk = np.nonzero(np.take_along_axis(RLn, heavy, 2) > T[:, None, None])
        if pr.size == 0:
            return None
        o = heavy[pr, pn, pk] + pn * Gn
        u = light[pr, pn, pk] + pn * Gn
        rows = lr[pr]
        a = RL[pr, o] - T[pr]  # excess of the heavy rank (> 0)
        b = RL[pr, u] - T[pr]  # excess of the light rank (usually < 0)
        ar = np.arange(S)
        so = o[:, None] * S + ar  # (M, S) slots of the heavy rank
        su = u[:, None] * S + ar  # slots of the light rank
        r2 = rows[:, None]
        ea, eb = self.cur[r2, so], self.cur[r2, su]
        # d[m, i, j]: load that swapping slot i of o with slot j of u moves from o to u
        # (float32 is plenty to rank candidates; two replicas of one expert give d == 0)
        d = self.sl[r2, so].astype(np.float32)[:, :, None] - self.sl[r2, su].astype(np.float32)[:, None, :]
        a3 = a.astype(np.float32)[:, None, None]
        b3 = b.astype(np.float32)[:, None, None]
        # excess removed: max(a,0) - max(a-d,0) + max(b,0) - max(b+d,0), and a > 0
        gain = np.minimum(a3, d)
        gain -= np.maximum(b3 + d, 0.0)
        gain += np.maximum(b3, 0.0)
        # moved slots added: each slot's new state minus its current one
        cost_a = (~self.held[r2, eb, o[:, None]]).astype(np.int8) - self.moved[r2, su]  # o's slot gets eb
        cost_b = (~self.held[r2, ea, u[:, None]]).astype(np.int8) - self.moved[r2, so]  # u's slot gets ea
        cost = cost_b[:, :, None] + cost_a[:, None, :]
        gain *= _INV_COST[cost + 2]
        # ties (e.g. every swap that fixes the heavy rank): the most even split of the pair
        d -= (0.5 * (a - b)).astype(np.float32)[:, None, None]
        np.abs(d, out=d)
        d *= _TIE
        gain -= d
        flat = gain.reshape(len(pr), S * S)
        best = flat.argmax(1)
        m = np.arange(len(pr))
        eff = flat[m, best].astype(np.float64)
        ia, ib = np.divmod(best, S)
        cost = cost_b[m, ia].astype(np.int64) + cost_a[m, ib]
        slot_a = o * S + ia
        slot_b = u * S + ib
        # useful swaps only, within the move limit (heaviest pairs of a layer first)
        good = eff > _SWAP_TOL * T[pr]
        spent = np.cumsum(np.where(good, np.maximum(cost, 0), 0))
        first = np.searchsorted(pr, pr)  # pairs of a layer are contiguous
        spent_in_layer = spent - np.where(first > 0, spent[first - 1], 0)
        good &= spent_in_layer <= (self.limit[rows] - self.moves[rows])
        delta = self.sl[rows, slot_a] - self.sl[rows, slot_b]
        return pr, np.where(good, eff, -np.inf), slot_a, slot_b, o, u, cost, delta

    def _repoints(self, lr: np.ndarray, RL: np.ndarray, T: np.ndarray, E: np.ndarray):
        """Best re-point per layer: ``(eff, slot, new expert, donor, touched ranks (n, G), cost, loads after (n, G))``."""
        n, S, G = len(lr), self.S, self.G
        rows = np.arange(n)
        cur, w, count = self.cur[lr], self.w[lr], self.count[lr]
        top = RL.argmax(1)
        hot = cur[rows[:, None], top[:, None] * S + np.arange(S)]  # (n, S) experts of the max rank
        r1 = rows[:, None]
        w_hot = w[r1, hot]
        c_hot = count[r1, hot]
        hot_on = self.on_rank[lr[:, None], hot]  # (n, S, G)
        relieved = RL[:, None, :] - hot_on * (w_hot / c_hot - w_hot / (c_hot + 1))[..., None]
        relief = E[:, None] - np.maximum(relieved - T[:, None, None], 0.0).sum(-1)
        ky = min(_HOT_CANDIDATES, S)
        pick = np.argsort(-relief, axis=1, kind="stable")[:, :ky]
        y = hot[r1, pick]  # (n, ky)
        wy = w_hot[r1, pick]
        cy = c_hot[r1, pick]
        relieved = relieved[r1, pick]  # (n, ky, G)
        # donors: experts whose loss of one replica adds the least load to each remaining one
        harm = np.where(count >= 2, w / np.maximum(count * (count - 1), 1), np.inf)
        kx = min(_DONOR_CANDIDATES, self.N)
        x = np.argpartition(harm, kx - 1, axis=1)[:, :kx] if kx < self.N else np.tile(np.arange(self.N), (n, 1))
        wx = w[r1, x]
        cx = count[r1, x]
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
            ok &= (node[r1, x][:, None, :] == node[r1, y][:, :, None])[..., None]
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
        after = loads[rows, iy, ix]  # (n, G) rank loads after the re-point
        after[rows, rank] += swing[rows, iy, ix, 0]
        return eff, slot, new_expert, donor, touched, cost[rows, iy, ix, rank].astype(np.int64), after

    def _widened_swap(self, lr: np.ndarray) -> np.ndarray:
        """For layers with no other move: the best swap of the max rank with one of the
        lightest ranks of its node (not only its paired one). Returns found (n,)."""
        n, S = len(lr), self.S
        rows = np.arange(n)
        RL, T = self.RL[lr], self.T[lr]
        top = RL.argmax(1)
        # partner ranks: the lightest ranks of the same node
        same = self.node_of_rank[None, :] == self.node_of_rank[top][:, None]
        same[rows, top] = False
        k = min(_WIDE_PARTNERS, self.Gn - 1)
        if k <= 0:
            return np.zeros(n, dtype=bool)
        partners = np.argsort(np.where(same, RL, np.inf), axis=1, kind="stable")[:, :k]  # (n, k)
        ok_partner = np.take_along_axis(same, partners, 1)
        sa = top[:, None] * S + np.arange(S)  # (n, S)
        sb = (partners[:, :, None] * S + np.arange(S)).reshape(n, -1)  # (n, k*S)
        l2 = lr[:, None]
        ea, eb = self.cur[l2, sa], self.cur[l2, sb]
        d = self.sl[l2, sa][:, :, None] - self.sl[l2, sb][:, None, :]  # (n, S, k*S)
        a = (RL[rows, top] - T)[:, None, None]
        b = np.repeat(np.take_along_axis(RL, partners, 1) - T[:, None], S, axis=1)[:, None, :]
        gain = np.maximum(a, 0.0) + np.maximum(b, 0.0) - np.maximum(a - d, 0.0) - np.maximum(b + d, 0.0)
        q = np.repeat(partners, S, axis=1)  # rank of each partner slot
        cost_a = (~self.held[l2, eb, top[:, None]]).astype(np.int64) - self.moved[l2, sb]  # (n, k*S): top's slot gets eb
        cost_b = (~self.held[l2[:, :, None], ea[:, :, None], q[:, None, :]]).astype(np.int64) - self.moved[l2, sa][:, :, None]
        cost = cost_b + cost_a[:, None, :]
        ok = (gain > _TOL * T[:, None, None]) & np.repeat(ok_partner, S, axis=1)[:, None, :]
        ok &= (self.moves[lr][:, None, None] + cost) <= self.limit[lr][:, None, None]
        eff = np.where(ok, gain / np.maximum(cost, _FREE_COST), -np.inf).reshape(n, -1)
        best = eff.argmax(1)
        found = np.isfinite(eff[rows, best])
        ia, ib = np.divmod(best, sb.shape[1])
        if found.any():
            f = rows[found]
            self._swap(lr[f], sa[f, ia[f]], sb[f, ib[f]])
        return found

    # -- replica counts -----------------------------------------------------
    def rebalance_counts(self, rows: np.ndarray, cap: np.ndarray) -> None:
        """Give extra replicas to experts whose load per replica exceeds ``cap`` (L,), in one pass.

        Expert e wants ``ceil(w_e / cap) - c_e`` more replicas; an expert can spare the
        replicas it has above ``max(1, ceil(w_e / cap))``. In every (layer, node) as many
        replicas change hands as both sides allow: the neediest experts (largest load per
        replica) are served first and the experts that suffer least (smallest load per
        replica after giving one up) give first. A giver frees its slots on its lightest
        ranks, and the heaviest new replicas go to the lightest of those ranks. Every
        change is one re-pointed slot.
        """
        if rows.size == 0:
            return
        w, count = self.w[rows], self.count[rows]
        floor = np.maximum(np.ceil(w / np.maximum(cap[rows], 1e-300)[:, None] - 1e-9), 1).astype(np.int64)
        need = np.maximum(floor - count, 0)
        some = need.any(1)
        if not some.any():
            return
        rows, w, count, floor, need = rows[some], w[some], count[some], floor[some], need[some]
        n, N, P, width = rows.size, self.N, self.P, self.nodes
        spare = np.maximum(count - floor, 0)
        node = self.node_of_expert[rows]  # (n, N)
        flat_node = (node + width * np.arange(n)[:, None]).ravel()
        total_need = np.bincount(flat_node, need.ravel(), minlength=n * width).reshape(n, width)
        total_spare = np.bincount(flat_node, spare.ravel(), minlength=n * width).reshape(n, width)
        moves = np.minimum(total_need, total_spare).astype(np.int64)  # replicas changing hands per node
        # within the layer's move limit (each change moves at most one slot), nodes in order
        room = np.maximum(self.limit[rows] - self.moves[rows], 0)[:, None]
        moves = np.clip(room - (np.cumsum(moves, 1) - moves), 0, moves)
        if not moves.any():
            return

        def node_major(key: np.ndarray) -> np.ndarray:
            """Expert order by (node, key): (n, N)."""
            span = np.abs(key).max(initial=0.0) * 4 + 1.0
            return np.argsort(node * span + key, axis=1)

        def take(amount: np.ndarray, order: np.ndarray) -> np.ndarray:
            """Take up to moves[node] units from ``amount`` (n, N), experts in ``order``."""
            a = np.take_along_axis(amount, order, 1)
            nd = np.take_along_axis(node, order, 1)
            cum = np.cumsum(a, 1)
            start_of_node = np.take_along_axis(cum - a, np.argmax(nd[:, :, None] == np.arange(width), 1), 1)
            before = cum - a - np.take_along_axis(start_of_node, nd, 1)  # units of this node before e
            got = np.clip(np.take_along_axis(moves, nd, 1) - before, 0, a)
            out = np.zeros_like(amount)
            np.put_along_axis(out, order, got, 1)
            return out

        per = w / count
        take_order = node_major(-per)  # neediest first
        gets = take(need, take_order)
        gives = take(spare, node_major(w / np.maximum(count - 1, 1)))  # least harmed first
        # each giver frees its slots on its lightest ranks
        cur = self.cur[rows]
        slot_load = self.RL[rows][:, self.rank_of_slot]  # (n, P) load of each slot's rank
        span = slot_load.max(initial=0.0) * 4 + 1.0
        order = np.argsort(cur * span + slot_load, axis=1)  # by expert, then rank load
        sorted_e = np.take_along_axis(cur, order, 1)
        first = np.cumsum(count, 1) - count
        pos = np.arange(P)[None, :] - np.take_along_axis(first, sorted_e, 1)
        freed = np.zeros((n, P), bool)
        np.put_along_axis(freed, order, pos < np.take_along_axis(gives, sorted_e, 1), 1)
        # freed slots node-major, lightest rank first; new replicas node-major, heaviest first
        slot_node = self.node_of_rank[self.rank_of_slot][None, :]
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
        slots, new_e = slots[valid], taker[valid]
        old_e = self.cur[r, slots]
        np.subtract.at(self.count, (r, old_e), 1)
        np.add.at(self.count, (r, new_e), 1)
        self._set_slots(r, slots, new_e)
        self.sl[rows] = _slot_loads(self.w[rows], self.cur[rows], self.count[rows])
        self.RL[rows] = self.sl[rows].reshape(n, self.G, self.S).sum(-1)

    def _best_prefix(self, RL, value, cost, use_rp, pr, pick, o, u, delta, sw_cost):
        """For layers without a re-point: the prefix of their picked pairs (heaviest first)
        with the best reduction of the layer max per moved slot. Returns (value, cost,
        pairs to keep) per layer."""
        n, G = RL.shape
        pos = np.arange(pr.size) - np.searchsorted(pr, pr)  # position of a pair in its layer
        J = int(pos.max()) + 1
        step = np.zeros((n, J, G))
        moved_load = np.where(pick, delta, 0.0)
        np.add.at(step, (pr, pos, o), -moved_load)
        np.add.at(step, (pr, pos, u), moved_load)
        after = RL[:, None, :] + np.cumsum(step, axis=1)  # (n, J, G) loads after the first j+1 pairs
        v = RL.max(1)[:, None] - after.max(2)
        c = np.zeros((n, J), np.int64)
        np.add.at(c, (pr, pos), np.where(pick, sw_cost, 0))
        c = np.cumsum(c, axis=1)
        eff = np.where(v > 0, v / np.maximum(c, _FREE_COST), -np.inf)
        j = eff.argmax(1)
        rows = np.arange(n)
        better = ~use_rp & np.isfinite(eff[rows, j]) & (
            eff[rows, j] > value / np.maximum(cost, _FREE_COST))
        keep = np.where(better, j + 1, np.iinfo(np.int64).max)
        return np.where(better, v[rows, j], value), np.where(better, c[rows, j], cost), keep

    # -- main loop ----------------------------------------------------------
    def run(self, live: np.ndarray, budget: float, fixed_max: float) -> None:
        """Search until every live layer meets its goal, is stuck or out of moves, the rounds
        are spent, or the budget on the sum of layer maxima holds (``fixed_max``: the sum
        over the layers outside the search)."""
        rows_all = np.arange(self.L)
        live = live & (self.RL.max(1) > self.T)
        searched = live.copy()
        repoints_pay = True  # until a round where (almost) no layer takes one
        while live.any() and self.rounds < _MAX_ROUNDS:
            lr = rows_all[live]
            self.rounds += 1
            n = lr.size
            RL, T = self.RL[lr], self.T[lr]
            E = np.maximum(RL - T[:, None], 0.0).sum(1)
            if self.rounds <= _REPOINT_ROUNDS and repoints_pay:
                rp_eff, rp_slot, rp_new, rp_old, touched, rp_cost, rp_after = self._repoints(lr, RL, T, E)
            else:
                rp_eff = np.full(n, -np.inf)
                rp_cost = np.zeros(n, np.int64)
                rp_after = RL
                touched = np.zeros((n, self.G), dtype=bool)
            has_rp = np.isfinite(rp_eff)
            # swaps: in the first rounds only for layers without a useful re-point
            if self.rounds <= _REPOINT_FIRST_ROUNDS:
                sw_idx = np.nonzero(~has_rp)[0]
            else:
                sw_idx = np.arange(n)
            swaps = self._swaps(lr[sw_idx], RL[sw_idx], T[sw_idx]) if sw_idx.size else None
            best_swap = np.full(n, -np.inf)
            if swaps is not None:
                pr, eff, slot_a, slot_b, o, u, sw_cost, delta = swaps
                pr = sw_idx[pr]  # index into lr
                np.maximum.at(best_swap, pr, eff)
            if self.rounds <= _REPOINT_FIRST_ROUNDS:
                use_rp = has_rp
            else:
                use_rp = has_rp & (rp_eff >= best_swap)
            # the round's plan per layer: a re-point and/or swaps (next to a re-point, only
            # pairs of ranks it does not touch)
            after = np.where(use_rp[:, None], rp_after, RL)
            cost = np.where(use_rp, rp_cost, 0)
            if swaps is not None:
                pick = np.isfinite(eff) & (~use_rp[pr] | (~touched[pr, o] & ~touched[pr, u]))
                moved_load = np.where(pick, delta, 0.0)
                np.add.at(after, (pr, o), -moved_load)
                np.add.at(after, (pr, u), moved_load)
                cost = cost + np.bincount(pr, np.where(pick, sw_cost, 0), minlength=n).astype(np.int64)
                acts = use_rp | (np.bincount(pr, pick, minlength=n) > 0)
            else:
                pick = np.zeros(0, dtype=bool)
                acts = use_rp.copy()
            # if this round can meet the budget, carry out only the layers' plans that cut
            # the sum of layer maxima most per moved slot, and stop after it
            need = fixed_max + float(self.RL[searched].max(1).sum()) - budget
            value = np.where(acts, RL.max(1) - after.max(1), 0.0)
            last = False
            if need > 0 and value.sum() >= need:
                # a layer without a re-point may also carry out only its first (heaviest) pairs
                keep_pairs = np.full(n, np.iinfo(np.int64).max)
                if swaps is not None:
                    p_value, p_cost, p_keep = self._best_prefix(RL, value, cost, use_rp, pr, pick, o, u, delta, sw_cost)
                    if p_value.sum() >= need:
                        value, cost, keep_pairs = p_value, p_cost, p_keep
                order = np.lexsort((-value, -value / np.maximum(cost, _FREE_COST)))
                take = np.zeros(n, dtype=bool)
                take[order[: int(np.searchsorted(np.cumsum(value[order]), need)) + 1]] = True
                use_rp &= take
                if swaps is not None:
                    rank_in_layer = np.arange(pr.size) - np.searchsorted(pr, pr)
                    pick &= take[pr] & (rank_in_layer < keep_pairs[pr])
                acts &= take
                last = True
            if pick.any():
                self._swap(lr[pr[pick]], slot_a[pick], slot_b[pick])
            if use_rp.any():
                i = np.nonzero(use_rp)[0]
                self._repoint(lr[i], rp_slot[i], rp_new[i], rp_old[i])
            repoints_pay = bool(use_rp.sum() > _REPOINT_MIN_SHARE * n)
            if last:
                break
            if not acts.all():
                idle = lr[~acts]
                found = self._widened_swap(idle)
                live[idle[~found]] = False
            layer_max = self.RL.max(1)
            live &= (layer_max > self.T) & (self.moves < self.limit)
            if fixed_max + float(layer_max[searched].sum()) <= budget:
                break


# --------------------------------------------------------------------------- planning


def plan_movement(
    weight: "torch.Tensor | np.ndarray",
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_ranks: int,
    old_phy2log: "torch.Tensor | np.ndarray | None",
    target: float = DEFAULT_TARGET,
    max_moves: int | None = None,
    diagnostics: bool = True,
) -> MovementPlan:
    """Movement-aware placement with diagnostics (see the module docstring for the algorithm).

    Arguments are those of ``rebalance_experts`` plus ``target`` (fraction of the default's
    balancedness to reach, in (0, 1]), ``max_moves`` (moved slots allowed per layer, None
    for no limit; when the limit and the target disagree, the limit wins) and
    ``diagnostics`` (compute ``moved`` / ``default_moved`` for every layer; when False,
    layers that did not need them hold -1). With ``old_phy2log=None`` the plan is the
    default's. Raises ``ValueError`` naming the argument for bad input.
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
    unknown = np.full(num_layers, -1, dtype=np.int64)

    def rank_loads(phy: np.ndarray, count: np.ndarray) -> np.ndarray:
        return _slot_loads(w, phy, count).reshape(num_layers, num_ranks, slots_per_rank).sum(-1)

    d_max = rank_loads(d_phy, d_count).max(1)
    budget = float(d_max.sum()) / target * (1 - _BUDGET_MARGIN)

    hierarchical = nodes > 1
    has_empty = (old < 0).any(1)
    # layers the search cannot start from (hierarchical mode): a group spread over nodes,
    # or empty slots, which only a node-aware fill could place
    forced = (_group_spans_nodes(old, num_experts, groups, nodes) | has_empty) if hierarchical else none.copy()
    cur = old.copy()
    if (has_empty & ~forced).any():
        _fill_empty_slots(cur, w, rows[has_empty & ~forced])
    cur_loads = rank_loads(cur, _counts(cur, num_experts))
    cur_max = cur_loads.max(1)
    d_moved = _moved_per_layer(old, d_phy, num_ranks) if diagnostics else unknown.copy()
    if not forced.any() and not has_empty.any() and cur_max.sum() <= budget:
        moved = np.zeros(num_layers, np.int64)
        return MovementPlan(old, moved, d_phy, d_count, d_moved, ~none, none.copy(), none.copy(), 0)

    # per-layer goals on the max rank load that fit the budget
    free = ~forced
    free_budget = budget - float(d_max[forced].sum())
    if hierarchical:
        # repairs stay inside nodes, so node totals are fixed: no goal below the busiest
        # node's mean rank load, and a common fraction above the default's max for all
        node_floor = cur_loads.reshape(num_layers, nodes, num_ranks // nodes).mean(-1).max(1) * (1 + _NODE_SLACK)
        lam = _water_level(cur_max[free], d_max[free], free_budget)
        goal = np.minimum(cur_max, lam * d_max) if math.isfinite(lam) else cur_max.copy()
        goal = np.maximum(goal, np.minimum(node_floor, cur_max))
    else:
        goal = cur_max.copy()
        goal[free] = _lagrange_levels(cur_loads[free], d_max[free] * _GOAL_FLOOR, free_budget)
    goal = np.where(forced, d_max, goal) * (1 - _TOL)
    active = free & (cur_max > goal)
    # far worse than a fresh plan: re-plan the layer (renumbered default) without searching
    replan = active & (cur_max > _REPLAN_RATIO * d_max)
    active &= ~replan

    act = rows[active]
    new_max = cur_max.copy()
    new_moves = np.zeros(num_layers, np.int64)
    if has_empty.any():
        new_moves[has_empty] = _moved_per_layer(old[has_empty], cur[has_empty], num_ranks)
    out = cur
    rounds = 0
    if act.size:
        if not diagnostics:
            d_moved[act] = _moved_per_layer(old[act], d_phy[act], num_ranks)
        limit = np.maximum((_GIVE_UP_FRACTION * d_moved[act]).astype(np.int64), 1)
        if max_moves is not None:
            limit = np.minimum(limit, max_moves)
        on_rank = _on_rank(cur[act], num_experts, num_ranks)
        held = on_rank > 0 if not has_empty[act].any() else _on_rank(old[act], num_experts, num_ranks) > 0
        repair = _Repair(w[act], cur[act], held, on_rank, goal[act], num_ranks, nodes, limit)
        per_replica_cap = _COUNT_CAP * (w[act] / np.maximum(d_count[act], 1)).max(1)
        repair.rebalance_counts(np.arange(act.size), per_replica_cap)
        fixed_max = float(np.where(forced, d_max, cur_max)[~active].sum())
        repair.run(np.ones(act.size, dtype=bool), budget, fixed_max)
        out[act] = repair.cur
        new_max[act] = repair.RL.max(1)
        new_moves[act] = repair.moves
        rounds = repair.rounds

    # per layer: the repaired placement or the renumbered default
    if not diagnostics:
        need = ~active & has_empty & ~replan
        d_moved[need] = _moved_per_layer(old[need], d_phy[need], num_ranks)
    fallback = forced | replan | ((active | has_empty) & (new_moves >= d_moved))
    chosen_max = np.where(fallback, d_max, new_max)
    excess = chosen_max.sum() - budget
    if excess > 0:
        # the layers furthest above the default's max fall back first
        cand = rows[~fallback & (new_max > d_max)]
        cand = cand[np.argsort(-(new_max - d_max)[cand], kind="stable")]
        saved = np.cumsum(new_max[cand] - d_max[cand])
        fallback[cand[: int(np.searchsorted(saved, excess)) + 1]] = True
    fallback_rows = rows[fallback]
    if fallback_rows.size:
        held_fb = _on_rank(old[fallback_rows], num_experts, num_ranks) > 0
        relabeled = relabel_ranks(d_phy[fallback_rows], held_fb.transpose(0, 2, 1), num_ranks, nodes)
        fb_moved = _moved_per_layer(old[fallback_rows], relabeled, num_ranks)
        plain_moved = _moved_per_layer(old[fallback_rows], d_phy[fallback_rows], num_ranks)
        worse = fb_moved > plain_moved  # the greedy renumbering can lose: keep the default's numbering
        relabeled[worse] = d_phy[fallback_rows[worse]]
        fb_moved = np.minimum(fb_moved, plain_moved)
        relabeled = align_rows(old[fallback_rows], relabeled, num_ranks)
        if max_moves is not None:
            # a fallback that breaks the move limit is not taken (unless the layer must change)
            over = (fb_moved > max_moves) & ~forced[fallback_rows]
            fallback[fallback_rows[over]] = False
            relabeled, fallback_rows = relabeled[~over], fallback_rows[~over]
        out[fallback_rows] = relabeled
    changed = (out != old).any(1)
    if diagnostics:
        moved = np.zeros(num_layers, np.int64)
        moved[changed] = _moved_per_layer(old[changed], out[changed], num_ranks)
    else:
        moved = unknown
    return MovementPlan(
        phy2log=out,
        moved=moved,
        default_phy2log=d_phy,
        default_replica_count=d_count,
        default_moved=d_moved,
        kept=~changed,
        repaired=changed & ~fallback,
        fallback=fallback & changed,
        rounds=rounds,
    )


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
        target=policy.target, max_moves=policy.max_moves, diagnostics=False,
    )
    num_experts = plan.default_replica_count.shape[1]
    log2phy, replica_count = build_log2phy(plan.phy2log, num_experts, plan.phy2log.shape[1] - num_experts + 1)
    return torch.from_numpy(np.ascontiguousarray(plan.phy2log)), torch.from_numpy(log2phy), torch.from_numpy(replica_count)


class MovementAwarePolicy(AbstractEplbPolicy):
    """Keeps the old placement and repairs it; moves far fewer slots than the default.

    Args:
        target: fraction of the default policy's balancedness (on the same load) to
            reach, in (0, 1]. Lower moves less. Default 0.99
            (``EplbConfig.movement_balancedness_target``).
        max_moves: at most this many moved slots per layer (None: no limit). A layer that
            cannot reach its goal within it keeps its best repair, and the target may then
            be missed: the limit wins.

    ``MovementAwarePolicy.rebalance_experts(...)`` (on the class) uses the defaults;
    ``MovementAwarePolicy(target=0.95).rebalance_experts(...)`` uses its own settings.
    Without ``old_phy2log`` it is exactly the default policy.
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
