"""Candidate changes of the movement-aware local search, scored for all live layers at once.

(``st`` is not annotated: its class lives in :mod:`~eplb_fsm.policy.movement.search`,
which imports this module, and this module must not import it back.)

Every function reads a :class:`~eplb_fsm.policy.movement.search.SearchState` ``st``
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

This numpy code defines the results; where :mod:`~eplb_fsm.policy.movement.native` is
usable the whole search runs in C instead, scoring the same candidates one layer at a time
(its orders come from stable sorts here, so the C loops can rebuild them exactly).
"""

from __future__ import annotations

import numpy as np


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
_TOL = 1e-9


def repoints(st, lr: np.ndarray, RL: np.ndarray, T: np.ndarray):
    """Best re-point per layer: ``(eff, rank, new expert, donor, cost, loads after (n, G))``.

    ``eff`` (n,) is the excess removed per moved slot, -inf where no re-point helps
    within the move limit; the donor gives up one slot on ``rank`` to a replica of the
    new expert (both flat (layer, expert) indices). Tried: the 2 experts of the most
    loaded rank whose extra replica relieves most, times the 6 donors whose other
    replicas gain least, times every rank holding the donor (the freed slot's rank).
    Arrays are (n, hot, donor, G).
    """
    n, S, G, N = len(lr), st.S, st.G, st.N
    rows = st.rows[:n]
    eb = st.expert_base[lr]  # (n, 1) flat (layer, expert) base
    w, count, on_rank = st.w_f, st.count_f, st.on_rank_rows
    E = np.maximum(RL - T[:, None], 0.0).sum(1)  # (n,) current excess
    hot = eb + st.cur_f[(st.slot_base[lr] + RL.argmax(1) * S)[:, None] + st.slot_range]  # (n, S) max rank's experts
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
    x = eb + (np.argsort(harm, axis=1, kind="stable")[:, :kx] if kx < N else np.arange(N))  # (n, kx) flat
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
    held = st.held8.reshape(-1, G)
    cost = held[x][:, None] - held[y][:, :, None]  # moved slots added: y new to rank g, x was held there
    ok = (x_on > 0)[:, None] & (x_ok[:, None] & (x[:, None, :] != y[:, :, None]))[..., None]
    ok &= gain > _TOL * T4
    if st.nodes > 1:
        node = st.node_of_expert.reshape(-1)
        ok &= (node[x][:, None, :] == node[y][:, :, None])[..., None]
    ok &= cost <= (st.limit[lr] - st.moves[lr])[:, None, None, None]
    eff = np.where(ok, gain / np.maximum(cost, FREE_COST), -np.inf).reshape(n, -1)
    best = eff.argmax(1)
    iy, rest = np.divmod(best, kx * G)
    ix, rank = np.divmod(rest, G)
    after = loads[rows, iy, ix]  # (n, G) rank loads after the re-point
    after[rows, rank] += swing[rows, iy, ix, 0]
    return eff[rows, best], rank, y[rows, iy], x[rows, ix], cost[rows, iy, ix, rank].astype(np.int64), after


def pair_swaps(st, lr: np.ndarray, RL: np.ndarray, T: np.ndarray):
    """Best swap of every (overloaded, light) rank pair of the layers ``lr``; None if no pair.

    In every node the k-th most loaded rank, while above the goal and k < ranks / 2,
    is paired with the k-th lightest, so pairs never share a rank. Returns
    ``(pair_layer, eff, slot_a, slot_b, rank_o, rank_u, cost, delta)``, each (M,),
    pairs of a layer contiguous and heaviest first: ``pair_layer`` indexes ``lr``;
    ``eff`` is the excess removed per moved slot (-inf: no useful swap or over the move
    limit); ``delta`` the load moved from o to u.
    """
    n, S, G, Gn = len(lr), st.S, st.G, st.Gn
    if Gn < 2 or n == 0:
        return None
    half = Gn // 2
    order = np.argsort(-RL.reshape(n, st.nodes, Gn), axis=2, kind="stable")  # ranks of each node, heaviest first
    if st.nodes > 1:
        order += (np.arange(st.nodes) * Gn)[:, None]
    heavy = order[:, :, :half]
    # pairs: (layer, node, k) while the k-th heaviest rank is above the goal
    pr, pn, pk = np.nonzero(RL[st.rows[:n, None, None], heavy] > T[:, None, None])
    if pr.size == 0:
        return None
    o = heavy[pr, pn, pk]
    u = order[pr, pn, Gn - 1 - pk]  # the k-th lightest
    rows = lr[pr]
    t = T[pr]
    RL_flat = RL.reshape(-1)
    a = RL_flat[pr * G + o] - t  # excess of the heavy rank (> 0)
    b = RL_flat[pr * G + u] - t  # excess of the light rank (usually < 0)
    base = st.slot_base[rows]
    fo = (base + o * S)[:, None] + st.slot_range  # (M, S) flat slots of the heavy rank
    fu = (base + u * S)[:, None] + st.slot_range  # ... of the light rank
    ea, eb = st.cur_f[fo], st.cur_f[fu]
    la, lb = st.sl_f[fo], st.sl_f[fu]
    # d[m, i, j]: load that swapping slot i of o with slot j of u moves from o to u
    # (float32 is plenty to rank candidates; two replicas of one expert give d == 0)
    d = la.astype(np.float32)[:, :, None] - lb.astype(np.float32)[:, None, :]
    a3 = a.astype(np.float32)[:, None, None]
    b3 = b.astype(np.float32)[:, None, None]
    # excess removed: max(a,0) - max(a-d,0) + max(b,0) - max(b+d,0), and a > 0
    gain = np.minimum(a3, d)
    gain -= np.maximum(b3 + d, 0.0)
    gain += np.maximum(b3, 0.0)
    # moved slots added (int8): each slot's new state (its new expert not held by its
    # rank before) minus its current one
    rN = st.expert_base[rows]
    cost_a = 1 - st.held8[(rN + eb) * G + o[:, None]] - st.moved8[fu]  # o's slot gets eb
    cost_b = 1 - st.held8[(rN + ea) * G + u[:, None]] - st.moved8[fo]  # u's slot gets ea
    cost = cost_b[:, :, None] + cost_a[:, None, :]
    gain /= np.maximum(cost, np.float32(FREE_COST))  # by 2, 1 or 0.5: exact in float32
    # ties (e.g. every swap that fixes the heavy rank): the most even split of the pair
    d -= (0.5 * (a - b)).astype(np.float32)[:, None, None]
    np.abs(d, out=d)
    d *= _TIE
    gain -= d
    best = gain.reshape(len(pr), S * S).argmax(1)
    m = np.arange(len(pr))
    ia, ib = np.divmod(best, S)
    eff = gain[m, ia, ib].astype(np.float64)
    cost = cost_b[m, ia].astype(np.int64) + cost_a[m, ib]
    # useful swaps only, within the move limit (heaviest pairs of a layer first)
    good = eff > _SWAP_TOL * t
    paid = np.where(good, np.maximum(cost, 0), 0)
    spent = np.cumsum(paid)
    spent -= (spent - paid)[np.searchsorted(pr, pr)]  # pairs of a layer are contiguous: spent within it
    good &= spent <= st.limit[rows] - st.moves[rows]
    delta = la[m, ia] - lb[m, ib]
    return pr, np.where(good, eff, -np.inf), o * S + ia, u * S + ib, o, u, cost, delta


def widened_swap(st, lr: np.ndarray) -> np.ndarray:
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
    fa, fb = st.slot_base[lr][:, None] + sa, st.slot_base[lr][:, None] + sb
    ea, eb = st.cur_f[fa], st.cur_f[fb]
    d = st.sl_f[fa][:, :, None] - st.sl_f[fb][:, None, :]  # (n, S, k*S)
    a = (RL[rows, top] - T)[:, None, None]
    b = np.repeat(np.take_along_axis(RL, partners, 1) - T[:, None], S, axis=1)[:, None, :]
    gain = np.maximum(a, 0.0) + np.maximum(b, 0.0) - np.maximum(a - d, 0.0) - np.maximum(b + d, 0.0)
    q = np.repeat(partners, S, axis=1)  # rank of each partner slot
    rN = st.expert_base[lr]
    cost_a = 1 - st.held8[(rN + eb) * st.G + top[:, None]].astype(np.int64) - st.moved8[fb]  # top's slot gets eb
    cost_b = (1 - st.held8[((rN + ea) * st.G)[:, :, None] + q[:, None, :]].astype(np.int64)
              - st.moved8[fa][:, :, None])  # the partner's slot gets ea
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
