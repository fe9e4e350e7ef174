"""How good a placement is, and how good any placement could be.

Balancedness is defined once, on rank loads, by :func:`eplb_fsm.stats.balancedness`:
sum over layers of the mean rank load / sum over layers of the max rank load. Here a
placement's rank loads come from :func:`rank_loads`: a slot's load is its expert's load
divided by the expert's replica count (empty slots, -1, carry nothing);
:func:`placement_balancedness` scores a placement that way, and
:func:`balancedness_per_layer` gives the per-layer ratios (1.0 for a layer without load).

The bound: no placement of P slots on G ranks can have a max rank load below
``max(total / G, min over replica counts c (sum c = P, c_e >= 1) of max_e w_e / c_e)``;
the inner minimum is reached by greedy replication (each extra slot to the expert with
the largest w_e / c_e). ``balancedness_bound`` is sum(mean) / sum(that bound), an upper
limit for the balancedness of any placement.

All functions take numpy arrays or torch tensors and compute in float64 numpy. Loads
must be finite and >= 0 and their total over all layers must be finite in float64 (so
every layer's is), counts (``num_ranks``, ``num_replicas``) integers >= 1, and
``num_replicas`` below 2**31 (``REPLICAS_LIMIT``, as the policies): ``ValueError`` naming
the argument otherwise. The load rules are :func:`eplb_fsm.stats.checked_loads64`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from eplb_fsm.maps import as_count, checked_int64, host_array
from eplb_fsm.policy.base import REPLICAS_LIMIT

__all__ = [
    "balancedness_bound",
    "balancedness_per_layer",
    "max_load_lower_bound",
    "placement_balancedness",
    "rank_loads",
]


def _to_numpy(x: Any, name: str) -> np.ndarray:
    arr = host_array(x, name)
    if arr.ndim != 2:
        raise ValueError(f"{name} must be 2-D (layers, ...), got shape {arr.shape}")
    return arr


def _weight64(weight: Any) -> np.ndarray:
    """``weight`` (L, N) as float64; ``ValueError`` naming ``weight`` for what ``checked_loads64`` refuses."""
    from eplb_fsm.stats import checked_loads64   # here, not at the top: stats imports torch, `eplb-fsm --help` must not

    return checked_loads64(_to_numpy(weight, "weight"), "weight")


def rank_loads(phy2log: Any, weight: Any, num_ranks: int) -> np.ndarray:
    """Load of every rank: ``phy2log (L, P), weight (L, N) -> (L, G)`` float64.

    Slot p is on rank p // (P / G); it carries ``weight[l, e] / replica_count[l, e]`` for
    its expert e, or nothing when empty (-1).
    """
    p2l = _to_numpy(phy2log, "phy2log")
    w = _weight64(weight)
    num_ranks = as_count(num_ranks, "num_ranks")
    if not np.issubdtype(p2l.dtype, np.integer):
        raise ValueError(f"phy2log must hold integers, got dtype {p2l.dtype}")
    num_layers, num_slots = p2l.shape
    if w.shape[0] != num_layers:
        raise ValueError(f"weight has {w.shape[0]} layers but phy2log has {num_layers}")
    if num_slots % num_ranks != 0:
        raise ValueError(f"num_ranks ({num_ranks}) must divide the number of slots ({num_slots})")
    num_experts = w.shape[1]
    p2l = checked_int64(p2l, "phy2log")  # a uint64 2**64 - 1 must not wrap to -1 (an empty slot)
    if p2l.size and (p2l.min() < -1 or p2l.max() >= num_experts):
        raise ValueError(f"phy2log entries must be in [-1, {num_experts})")
    valid = p2l >= 0
    expert = np.where(valid, p2l, 0)
    flat = expert + num_experts * np.arange(num_layers)[:, None]
    counts = np.bincount(flat[valid], minlength=num_layers * num_experts).reshape(num_layers, num_experts)
    slot_load = np.take_along_axis(w, expert, axis=1) / np.maximum(np.take_along_axis(counts, expert, axis=1), 1)
    slot_load = np.where(valid, slot_load, 0.0)
    return slot_load.reshape(num_layers, num_ranks, num_slots // num_ranks).sum(-1)


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    out = np.ones_like(num, dtype=np.float64)
    np.divide(num, den, out=out, where=den > 0)
    return out


def balancedness_per_layer(phy2log: Any, weight: Any, num_ranks: int) -> np.ndarray:
    """Per-layer mean rank load / max rank load, ``(L,)`` float64; 1.0 for a layer without load."""
    loads = rank_loads(phy2log, weight, num_ranks)
    return _ratio(loads.mean(axis=1), loads.max(axis=1))


def placement_balancedness(phy2log: Any, weight: Any, num_ranks: int) -> float:
    """Balancedness of a placement under a load: :func:`eplb_fsm.stats.balancedness` of its
    :func:`rank_loads` (``phy2log (L, P), weight (L, N)``); 1.0 if there is no load."""
    # imported here: the policy package imports no torch until a policy runs, and stats does
    from eplb_fsm.stats import balancedness

    return balancedness(rank_loads(phy2log, weight, num_ranks))


def max_load_lower_bound(weight: Any, num_replicas: int, num_ranks: int) -> np.ndarray:
    """Lowest max rank load any placement of ``num_replicas`` slots on ``num_ranks`` ranks can reach.

    ``weight (L, N) -> (L,)`` float64: ``max(total / G, best max per-replica load)``, the
    latter from greedy replication (optimal for minimising max_e w_e / c_e). ``num_replicas``
    must be in [N, 2**31), the policies' range. The greedy starts from :func:`_head_start`,
    so it takes about 3 N steps per layer rather than P - N (for loads in float64's normal range: with
    subnormal loads the head start's rounding margin dominates and up to P - N remain); the result is the same.
    """
    w = _weight64(weight)
    num_layers, num_experts = w.shape
    num_replicas = as_count(num_replicas, "num_replicas")
    if num_replicas >= REPLICAS_LIMIT:
        raise ValueError(f"num_replicas must be below 2**31 (the policies' limit), got {num_replicas}")
    num_ranks = as_count(num_ranks, "num_ranks")
    if num_replicas < num_experts:
        raise ValueError(f"num_replicas ({num_replicas}) must be >= the number of experts ({num_experts})")
    count = _head_start(w, num_replicas)
    per_replica = w / count
    # counts are integers below 2**31 and their sums below 2**53: exact in float64
    left = num_replicas - count.sum(axis=1).astype(np.int64)
    rows = np.arange(num_layers) if num_experts else np.arange(0)
    for step in range(int(left.max(initial=0))):
        rows = rows[left[rows] > step]
        if rows.size == 0:   # also (L, 0): no expert to take a slot (argmax of nothing raises)
            break
        expert = per_replica[rows].argmax(axis=1)
        # a row whose largest per-replica load is 0 is at its optimum already: its max cannot fall further
        busy = per_replica[rows, expert] > 0
        rows, expert = rows[busy], expert[busy]
        if rows.size == 0:
            break
        count[rows, expert] += 1
        per_replica[rows, expert] = w[rows, expert] / count[rows, expert]
    return np.maximum(w.sum(axis=1) / num_ranks, per_replica.max(axis=1, initial=0.0))


def _head_start(w: np.ndarray, num_replicas: int) -> np.ndarray:
    """``(L, N)`` float64 replica counts >= 1 from which greedy replication reaches the same optimum.

    Greedy (one slot at a time to an expert with the largest ``fl(w_e / c_e)``) ends at the
    optimum v* from any start whose counts are at most ``need_e(v*)``, the fewest replicas
    that bring expert e to v* or below: until the max reaches v*, every step raises a count
    still below its need, and after ``P - sum(start)`` steps all needs are met. The start is
    a lower bound of ``need_e(v_hi) <= need_e(v*)``, where ``v_hi >= v*`` is the max of a
    proportional allocation that fits in P slots. ``fl(x) >= x (1 - 2**-53) - 2**-1075``
    (rounding, also among subnormals), so ``need_e(v) >= w_e (1 - 2**-53) / (v + 2**-1075)``;
    the start takes ``floor(w_e / d) - 1`` with ``d = v_hi (1 + 1e-9) + 2**-1074`` above that
    denominator, clipped to [1, P]. The counts left to place are then about 3 N per layer (loads in the
    normal range; with subnormal ones the 2**-1074 term dominates ``d`` and the start gains little).
    """
    num_experts = w.shape[1]
    extra = num_replicas - num_experts
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        total = w.sum(axis=1, keepdims=True)
        share = np.where(total > 0, w / np.where(total > 0, total, 1.0), 0.0)
        alloc = 1.0 + np.floor(share * (extra * (1.0 - 1e-9)))
        # the margin keeps the rounded allocation within P; a row it does not is given one each
        alloc = np.where(alloc.sum(axis=1, keepdims=True) <= num_replicas, alloc, 1.0)
        v_hi = (w / alloc).max(axis=1, keepdims=True, initial=0.0)
        start = np.clip(np.floor(w / (v_hi * (1.0 + 1e-9) + 2.0**-1074)) - 1.0, 1.0, float(num_replicas))
    # never taken when v_hi >= v*, as above; a row that still overflowed would start from one each
    return np.where(start.sum(axis=1, keepdims=True) <= num_replicas, start, 1.0)


def balancedness_bound(weight: Any, num_replicas: int, num_ranks: int) -> float:
    """Highest balancedness any placement can reach: sum(total / G) / sum(max_load_lower_bound)."""
    w = _weight64(weight)
    bound = max_load_lower_bound(w, num_replicas, num_ranks)
    total = float(bound.sum())
    return float((w.sum(axis=1) / num_ranks).sum() / total) if total > 0 else 1.0
