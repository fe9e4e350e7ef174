"""Per-layer goals for the movement-aware policy: how far each layer's max rank load must drop.

The mean rank load of a layer does not depend on the placement, so reaching ``target`` x
the default's balancedness (sum over layers of mean / sum over layers of max) means
``sum_l max_l <= budget = sum_l d_l / target``, where ``d_l`` is the default's max rank
load: one budget on the sum of per-layer maxima, which layers may share. This module
splits it into per-layer goals:

- :func:`lagrange_levels` (flat mode): as few ranks as possible above their goal, since
  every rank above it costs moved slots to fix;
- :func:`water_level` (hierarchical mode, where node totals cannot change): one common
  fraction above ``d_l`` for every layer;
- :func:`layer_goals` picks between them and applies the floors.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["GOAL_FLOOR", "NODE_SLACK", "lagrange_levels", "layer_goals", "water_level"]

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
    """
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
