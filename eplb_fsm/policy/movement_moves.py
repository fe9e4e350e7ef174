"""Candidate changes of the movement-aware local search, scored for all live layers at once.

Every function reads a :class:`~eplb_fsm.policy.movement_search.SearchState` ``st``
and the live layers ``lr`` (n,) with their rank loads ``RL`` (n, G) and goals ``T``
(n,). A change is scored by the *excess* it removes, ``sum_g max(0, load_g - goal)``,
per moved slot, where moves are counted against the old placement: handing a rank back
an expert it held is free, and changing an already moved slot costs nothing extra.

- :func:`repoints`: one slot of a donor expert (>= 2 replicas) takes a new replica of a
  hot expert of the most loaded rank. Replica counts change, so it relieves every rank
  holding the hot expert (and loads every rank holding the donor) for one moved slot.
- :func:`pair_swaps`: in every node the k-th most loaded rank above the goal swaps its
  best slot with one of the k-th lightest rank; pairs share no rank.
- :func:`widened_swap`: for a layer with neither, its most loaded rank against the
  lightest ranks of its node; applied at once.
- :func:`best_prefix`: how much of a layer's pair list to carry out in the last round.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from eplb_fsm.policy.movement_search import SearchState

__all__ = ["FREE_COST", "best_prefix", "pair_swaps", "repoints", "widened_swap"]

# A change that moves nothing (cost <= 0) is ranked as if it cost this much.
FREE_COST = 0.5
# Hot experts (from the most loaded rank) and donor experts tried per re-point.
_HOT_CANDIDATES = 2
_DONOR_CANDIDATES = 6
# Lightest ranks tried by the widened swap of a layer that has no other move.
_WIDE_PARTNERS = 8
# Even-split tie-break weight in swap scores (load units per load unit).
_TIE = 1e-4
# float32 swap scoring: an improvement must exceed this fraction of the goal.
_SWAP_TOL = 1e-5
# 1 / max(cost, FREE_COST) for a swap's cost in moved slots (-2 .. 2).
_INV_COST = np.array([1.0 / max(c, FREE_COST) for c in range(-2, 3)], dtype=np.float32)
_TOL = 1e-9


def _not_held(st: "SearchState", rows: np.ndarray, experts: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """1 where the old placement did not have ``experts`` on ``ranks`` in ``rows`` (int8, broadcast)."""
    return (~st.held.reshape(-1)[(rows * st.N + experts) * st.G + ranks]).astype(np.int8)


def repoints(st: "SearchState", lr: np.ndarray, RL: np.ndarray, T: np.ndarray):
    """Best re-point per layer: ``(eff, slot, new expert, touched ranks (n, G), cost, loads after (n, G))``.

    ``eff`` (n,) is the excess removed per moved slot, -inf where no re-point helps
    within the move limit. Tried: the 2 experts of the
    most loaded rank whose extra replica relieves most, times the 6 donors whose other
    replicas gain least, times every rank holding the donor (the freed slot's rank).
    Arrays are (n, hot, donor, G); indices into the state are flat.
    """
    n, S, G, N = len(lr), st.S, st.G, st.N
    rows = np.arange(n)
    eb = (lr * N)[:, None]  # flat (layer, expert) base
    w, count, on_rank = st.w.reshape(-1), st.count.reshape(-1), st.on_rank.reshape(st.L * N, G)
    E = np.maximum(RL - T[:, None], 0.0).sum(1)  # (n,) current excess
    top = RL.argmax(1)
    hot = eb + st.cur.reshape(-1)[(lr * st.P + top * S)[:, None] + np.arange(S)]  # (n, S) flat experts of the max rank
    w_hot, c_hot = w[hot], count[hot]
    relieved = RL[:, None, :] - on_rank[hot] * (w_hot / c_hot - w_hot / (c_hot + 1))[..., None]  # (n, S, G)
    T3 = T[:, None, None]
    relief = E[:, None] - np.maximum(relieved - T3, 0.0).sum(-1)
    ky = min(_HOT_CANDIDATES, S)
    pick = (np.argsort(-relief, axis=1, kind="stable")[:, :ky] + (rows * S)[:, None]).ravel()
    y = hot.reshape(-1)[pick].reshape(n, ky)  # flat (layer, expert) of the hot candidates
    wy, cy = w_hot.reshape(-1)[pick].reshape(n, ky), c_hot.reshape(-1)[pick].reshape(n, ky)
    relieved = relieved.reshape(n * S, G)[pick].reshape(n, ky, 1, G)
    # donors: experts whose loss of one replica adds the least load to each remaining one
    w_l, c_l = (st.w, st.count) if n == st.L else (st.w[lr], st.count[lr])
    harm = np.where(c_l >= 2, w_l / np.maximum(c_l * (c_l - 1), 1), np.inf)
    kx = min(_DONOR_CANDIDATES, N)
    x = eb + (np.argpartition(harm, kx - 1, axis=1)[:, :kx] if kx < N else np.arange(N))  # (n, kx) flat
    wx, cx = w[x], count[x]
    x_ok = cx >= 2
    cx1 = np.maximum(cx - 1, 1)
    x_on = on_rank[x]  # (n, kx, G)
    grow = np.where(x_ok, wx / cx1 - wx / np.maximum(cx, 1), 0.0)
    loads = relieved + (x_on * grow[..., None])[:, None]  # (n, ky, kx, G)
    T4 = T3[..., None]
    excess = np.maximum(loads - T4, 0.0)
    # the re-pointed slot (on rank g) drops its x replica and holds a y replica instead
    swing = ((wy / (cy + 1))[:, :, None] - (wx / cx1)[:, None, :])[..., None]
    after = excess.sum(-1, keepdims=True) - excess
    after += np.maximum(loads + swing - T4, 0.0)
    gain = E[:, None, None, None] - after
    held = st.held.reshape(-1, G)
    cost = (held[x].view(np.int8)[:, None] - held[y].view(np.int8)[:, :, None])  # moved: not held by g before
    ok = (x_on > 0)[:, None] & (x_ok[:, None] & (x[:, None, :] != y[:, :, None]))[..., None]
    ok &= gain > _TOL * T4
    if st.nodes > 1:
        node = st.node_of_expert.reshape(-1)
        ok &= (node[x][:, None, :] == node[y][:, :, None])[..., None]
    ok &= cost <= (st.limit[lr] - st.moves[lr])[:, None, None, None]
    eff = np.where(ok, gain / np.maximum(cost, FREE_COST), -np.inf).reshape(n, -1)
    best = eff.argmax(1)
    eff = eff[rows, best]
    iy, rest = np.divmod(best, kx * G)
    ix, rank = np.divmod(rest, G)
    new_expert, donor = y[rows, iy], x[rows, ix]
    # the slot: the first one of that rank holding the donor
    in_rank = st.cur.reshape(-1)[(lr * st.P + rank * S)[:, None] + np.arange(S)]
    slot = rank * S + (in_rank == (donor - eb[:, 0])[:, None]).argmax(1)
    touched = (on_rank[new_expert] > 0) | (on_rank[donor] > 0)
    after = loads[rows, iy, ix]  # (n, G) rank loads after the re-point
    after[rows, rank] += swing[rows, iy, ix, 0]
    return eff, slot, new_expert - eb[:, 0], touched, cost[rows, iy, ix, rank].astype(np.int64), after


def pair_swaps(st: "SearchState", lr: np.ndarray, RL: np.ndarray, T: np.ndarray):
    """Best swap of every (overloaded, light) rank pair of the layers ``lr``; None if no pair.

    In every node the k-th most loaded rank, while above the goal and k < ranks / 2,
    is paired with the k-th lightest, so pairs never share a rank. Returns
    ``(pair_layer, eff, slot_a, slot_b, rank_o, rank_u, cost, delta)``, each (M,),
    pairs of a layer contiguous and heaviest first: ``pair_layer`` indexes ``lr``;
    ``eff`` is the excess removed per moved slot (-inf: no useful swap or over the move
    limit); ``delta`` the load moved from o to u.
    """
    n, S, Gn = len(lr), st.S, st.Gn
    if Gn < 2 or n == 0:
        return None
    half = Gn // 2
    order = np.argsort(-RL.reshape(n, st.nodes, Gn), axis=2) + (np.arange(st.nodes) * Gn)[:, None]  # ranks, heaviest first
    heavy = order[:, :, :half]
    # pairs: (layer, node, k) while the k-th heaviest rank is above the goal
    pr, pn, pk = np.nonzero(RL[np.arange(n)[:, None, None], heavy] > T[:, None, None])
    if pr.size == 0:
        return None
    o = heavy[pr, pn, pk]
    u = order[pr, pn, Gn - 1 - pk]  # the k-th lightest
    rows = lr[pr]
    t = T[pr]
    a = RL[pr, o] - t  # excess of the heavy rank (> 0)
    b = RL[pr, u] - t  # excess of the light rank (usually < 0)
    ar = np.arange(S)
    fo = (rows * st.P + o * S)[:, None] + ar  # (M, S) flat slots of the heavy rank
    fu = (rows * st.P + u * S)[:, None] + ar  # ... of the light rank
    cur, sl, moved = st.cur.reshape(-1), st.slot_load.reshape(-1), st.moved.reshape(-1)
    ea, eb = cur[fo], cur[fu]
    la, lb = sl[fo], sl[fu]
    # d[m, i, j]: load that swapping slot i of o with slot j of u moves from o to u
    # (float32 is plenty to rank candidates; two replicas of one expert give d == 0)
    d = la.astype(np.float32)[:, :, None] - lb.astype(np.float32)[:, None, :]
    a3 = a.astype(np.float32)[:, None, None]
    b3 = b.astype(np.float32)[:, None, None]
    # excess removed: max(a,0) - max(a-d,0) + max(b,0) - max(b+d,0), and a > 0
    gain = np.minimum(a3, d)
    gain -= np.maximum(b3 + d, 0.0)
    gain += np.maximum(b3, 0.0)
    # moved slots added: each slot's new state minus its current one
    r2 = rows[:, None]
    cost_a = _not_held(st, r2, eb, o[:, None]) - moved[fu]  # o's slot gets eb
    cost_b = _not_held(st, r2, ea, u[:, None]) - moved[fo]  # u's slot gets ea
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
    # useful swaps only, within the move limit (heaviest pairs of a layer first)
    good = eff > _SWAP_TOL * T[pr]
    spent = np.cumsum(np.where(good, np.maximum(cost, 0), 0))
    first = np.searchsorted(pr, pr)  # pairs of a layer are contiguous
    spent_in_layer = spent - np.where(first > 0, spent[first - 1], 0)
    good &= spent_in_layer <= (st.limit[rows] - st.moves[rows])
    delta = la[m, ia] - lb[m, ib]
    return pr, np.where(good, eff, -np.inf), o * S + ia, u * S + ib, o, u, cost, delta


def widened_swap(st: "SearchState", lr: np.ndarray) -> np.ndarray:
    """For layers with no other move: the best swap of the max rank with one of the lightest
    ranks of its node (not only its paired one), applied. Returns found (n,) bool."""
    n, S = len(lr), st.S
    rows = np.arange(n)
    RL, T = st.rank_load[lr], st.goal[lr]
    top = RL.argmax(1)
    # partner ranks: the lightest ranks of the same node
    same = st.node_of_rank[None, :] == st.node_of_rank[top][:, None]
    same[rows, top] = False
    k = min(_WIDE_PARTNERS, st.Gn - 1)
    if k <= 0:
        return np.zeros(n, dtype=bool)
    partners = np.argsort(np.where(same, RL, np.inf), axis=1, kind="stable")[:, :k]  # (n, k)
    ok_partner = np.take_along_axis(same, partners, 1)
    sa = top[:, None] * S + np.arange(S)  # (n, S)
    sb = (partners[:, :, None] * S + np.arange(S)).reshape(n, -1)  # (n, k*S)
    base = (lr * st.P)[:, None]
    cur, sl, moved = st.cur.reshape(-1), st.slot_load.reshape(-1), st.moved.reshape(-1)
    ea, eb = cur[base + sa], cur[base + sb]
    d = sl[base + sa][:, :, None] - sl[base + sb][:, None, :]  # (n, S, k*S)
    a = (RL[rows, top] - T)[:, None, None]
    b = np.repeat(np.take_along_axis(RL, partners, 1) - T[:, None], S, axis=1)[:, None, :]
    gain = np.maximum(a, 0.0) + np.maximum(b, 0.0) - np.maximum(a - d, 0.0) - np.maximum(b + d, 0.0)
    q = np.repeat(partners, S, axis=1)  # rank of each partner slot
    l2 = lr[:, None]
    cost_a = _not_held(st, l2, eb, top[:, None]).astype(np.int64) - moved[base + sb]  # top's slot gets eb
    cost_b = _not_held(st, l2[:, :, None], ea[:, :, None], q[:, None, :]).astype(np.int64) - moved[base + sa][:, :, None]
    cost = cost_b + cost_a[:, None, :]
    ok = (gain > _TOL * T[:, None, None]) & np.repeat(ok_partner, S, axis=1)[:, None, :]
    ok &= (st.moves[lr][:, None, None] + cost) <= st.limit[lr][:, None, None]
    eff = np.where(ok, gain / np.maximum(cost, FREE_COST), -np.inf).reshape(n, -1)
    best = eff.argmax(1)
    found = np.isfinite(eff[rows, best])
    ia, ib = np.divmod(best, sb.shape[1])
    if found.any():
        f = rows[found]
        st.swap(lr[f], sa[f, ia[f]], sb[f, ib[f]])
    return found


def best_prefix(RL, value, cost, no_rp, pr, pick, o, u, delta, sw_cost):
    """For layers without a re-point (``no_rp``): the prefix of their picked pairs (heaviest
    first) with the best reduction of the layer max per moved slot.

    Args are the round's plan (see ``SearchState.run``): per layer ``RL`` (n, G),
    ``value``/``cost``/``no_rp`` (n,); per pair ``pr``, ``pick``, ``o``, ``u``,
    ``delta``, ``sw_cost`` (M,). Returns (value, cost, pairs to keep) per layer.
    """
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
    eff = np.where(v > 0, v / np.maximum(c, FREE_COST), -np.inf)
    j = eff.argmax(1)
    rows = np.arange(n)
    better = no_rp & np.isfinite(eff[rows, j]) & (eff[rows, j] > value / np.maximum(cost, FREE_COST))
    keep = np.where(better, j + 1, np.iinfo(np.int64).max)
    return np.where(better, v[rows, j], value), np.where(better, c[rows, j], cost), keep
