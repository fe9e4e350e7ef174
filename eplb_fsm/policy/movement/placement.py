"""Placement arrays of the movement-aware policy: what a change moves, and the checked inputs.

A slot is *moved* when the expert it holds after a rearrangement was not on its rank
before: its weights must cross the network. Everything that stays on a rank is free,
whatever row it ends up in. All functions are numpy, vectorised over layers; inputs are
int64 arrays with -1 for an empty slot.

Move counting:

- :func:`moved_mask` ``old (L, P), new (L, P) -> (L, P)`` bool: the moved slots (its
  sum per layer is what ``scenarios.json`` calls ``moved_slots``).
- :func:`rank_membership` ``phy2log (L, P) -> (L, G, N)`` bool: expert e was on rank g.
- The helpers the policy shares: :func:`membership` (the same as ``(L, N, G)``, which is
  what it keeps as ``held``), :func:`rank_counts`, :func:`expert_counts`,
  :func:`slot_loads` and :func:`moves_per_layer`, which counts moves against ``held``
  with one flat gather instead of comparing placements slot by slot.

Inputs (settings, the old placement, and where a search may start):

- :func:`check_target`, :func:`check_max_moves`: the policy's settings, ``ValueError``
  naming the setting otherwise.
- :func:`check_old`: ``old_phy2log`` as an (L, P) int64 array plus its replica counts;
  ``ValueError`` naming ``old_phy2log`` if it does not fit or drops an expert.
- :func:`group_spans_nodes`: layers whose old placement breaks the hierarchical rule
  (a group on more than one node); the search cannot start from those.
- :func:`fill_empty_slots`: an empty slot (-1, elastic scale-up) gets the expert with
  the largest load per replica (under a move limit or in hierarchical mode: among those
  already on its rank), so the search starts from a full placement.
- :class:`ClassOrInstanceMethod`: how ``rebalance_experts`` finds its settings (the
  class defaults, or an instance's).

Placements that cost less (rank renumbering, row alignment) are in
:mod:`eplb_fsm.policy.movement.targets`.
"""

from __future__ import annotations

import numbers
import types
from typing import Any, Callable

import numpy as np

from eplb_fsm.maps import as_count, as_finite_float, checked_int64, host_array
from eplb_fsm.policy.movement import native

__all__ = [
    "ClassOrInstanceMethod",
    "check_max_moves",
    "check_old",
    "check_target",
    "expert_counts",
    "fill_empty_slots",
    "group_spans_nodes",
    "membership",
    "moved_mask",
    "moves_per_layer",
    "rank_counts",
    "rank_index",
    "rank_membership",
    "slot_loads",
]

# the largest max_moves: the move limits and counts are int64 arrays
_INT64_MAX = 2**63 - 1


def expert_counts(phy2log: np.ndarray, num_experts: int) -> np.ndarray:
    """``(L, P) -> (L, N)`` int64: replicas of every expert (empty slots ignored)."""
    num_layers = phy2log.shape[0]
    width = num_experts + 1  # column N collects the empty slots and is dropped
    flat = np.where(phy2log >= 0, phy2log, num_experts) + width * np.arange(num_layers)[:, None]
    return np.bincount(flat.ravel(), minlength=num_layers * width).reshape(num_layers, width)[:, :num_experts]


def rank_index(phy2log: np.ndarray, num_experts: int, num_ranks: int) -> np.ndarray:
    """``(L, P) -> (L, P)``: flat index of (layer, expert, rank) of every slot in an (L, N, G) array; -1 if empty."""
    num_layers, num_slots = phy2log.shape
    rank = np.arange(num_slots) // (num_slots // num_ranks)
    flat = (phy2log + num_experts * np.arange(num_layers)[:, None]) * num_ranks + rank
    return np.where(phy2log >= 0, flat, -1) if (phy2log < 0).any() else flat


def membership(phy2log: np.ndarray, num_experts: int, num_ranks: int) -> np.ndarray:
    """``(L, P) -> (L, N, G)`` bool: expert e has a slot on rank g (empty slots ignored).

    A scatter of L * P flags, without the int64 count array a bincount would allocate
    (L * N * G of them: megabytes at DeepSeek-V3 sizes, fresh pages on every call).
    """
    num_layers = phy2log.shape[0]
    flat = rank_index(phy2log, num_experts, num_ranks).ravel()
    out = np.zeros(num_layers * num_experts * num_ranks, dtype=bool)
    out[flat[flat >= 0] if flat.size and flat.min() < 0 else flat] = True
    return out.reshape(num_layers, num_experts, num_ranks)


def rank_counts(phy2log: np.ndarray, num_experts: int, num_ranks: int) -> np.ndarray:
    """``(L, P) -> (L, N, G)``: slots of expert e on rank g (empty slots ignored).

    The narrowest integer type that holds P / G (int8 up to 127 slots per rank), for the
    same reason as :func:`membership`: the flags, plus one for every further copy of an
    expert on a rank (found by sorting each rank's S entries).
    """
    num_layers, num_slots = phy2log.shape
    slots_per_rank = num_slots // num_ranks
    if slots_per_rank < 128 and native.enabled():  # one pass in C
        return native.rank_counts(phy2log, num_experts, num_ranks)
    dtype = np.int8 if slots_per_rank < 128 else np.int16 if slots_per_rank < 32768 else np.int64
    flat = rank_index(phy2log, num_experts, num_ranks)
    out = membership(phy2log, num_experts, num_ranks).reshape(-1).astype(dtype)
    same = np.sort(flat.reshape(-1, slots_per_rank), axis=1)
    again = (same[:, 1:] == same[:, :-1]) & (same[:, 1:] >= 0)
    if again.any():
        np.add.at(out, same[:, 1:][again], 1)
    return out.reshape(num_layers, num_experts, num_ranks)


def slot_loads(w: np.ndarray, phy2log: np.ndarray, count: np.ndarray) -> np.ndarray:
    """``w (L, N), phy2log (L, P), count (L, N) -> (L, P)``: expert load / replica count, 0 if empty."""
    num_experts = w.shape[1]
    flat = np.maximum(phy2log, 0) + num_experts * np.arange(phy2log.shape[0])[:, None]
    load = w.ravel()[flat] / np.maximum(count.ravel()[flat], 1)
    return np.where(phy2log >= 0, load, 0.0) if (phy2log < 0).any() else load


def moves_per_layer(held: np.ndarray, new: np.ndarray) -> np.ndarray:
    """``held (L, N, G)`` bool (old membership), ``new (L, P)`` -> ``(L,)`` moved slots of ``new``."""
    num_layers, num_experts, num_ranks = held.shape
    num_slots = new.shape[1]
    rank = np.arange(num_slots) // (num_slots // num_ranks)
    flat = (np.maximum(new, 0) + num_experts * np.arange(num_layers)[:, None]) * num_ranks + rank
    moved = ~held.ravel()[flat]
    if (new < 0).any():
        moved &= new >= 0
    return moved.sum(1)


def _checked_placement(value: Any, name: str, num_ranks: Any, num_experts: int | None = None) -> tuple[np.ndarray, int]:
    """``value`` as an (L, P) int64 placement and ``num_ranks`` as an int; ``ValueError`` naming the
    argument unless ``num_ranks`` is an integer >= 1 dividing P and every entry is -1 (empty) or an
    expert >= 0 (below ``num_experts`` when given)."""
    arr = checked_int64(value, name)
    if arr.ndim != 2:
        raise ValueError(f"{name} must be 2-D (layers, slots), got shape {arr.shape}")
    num_ranks = as_count(num_ranks, "num_ranks")
    if arr.shape[1] % num_ranks:
        raise ValueError(f"num_ranks ({num_ranks}) must divide the number of slots ({arr.shape[1]})")
    if arr.size and (arr.min() < -1 or (num_experts is not None and arr.max() >= num_experts)):
        rule = f"in [-1, num_experts) = [-1, {num_experts})" if num_experts is not None else ">= -1"
        raise ValueError(f"{name} entries must be {rule} (-1: an empty slot)")
    return arr, num_ranks


def rank_membership(phy2log: np.ndarray, num_ranks: int, num_experts: int) -> np.ndarray:
    """``(L, P) -> (L, G, N)`` bool: ``out[l, g, e]`` when some slot of rank g holds e in layer l.

    ``ValueError`` naming the argument unless ``num_ranks`` and ``num_experts`` are integers
    >= 1, ``num_ranks`` divides P and every entry is in [-1, ``num_experts``).
    """
    num_experts = as_count(num_experts, "num_experts")
    phy2log, num_ranks = _checked_placement(phy2log, "phy2log", num_ranks, num_experts)
    return membership(phy2log, num_experts, num_ranks).transpose(0, 2, 1)


def moved_mask(old_phy2log: np.ndarray, new_phy2log: np.ndarray, num_ranks: int) -> np.ndarray:
    """``(L, P)`` bool: slots whose new expert was not on their rank in the old placement.

    Empty new slots (-1) are never moved. ``ValueError`` naming the argument unless both
    placements have one 2-D shape with entries >= -1 and ``num_ranks`` is an integer >= 1
    dividing P (slot p is on rank p // (P / G)).
    """
    # checked: a uint64 2**64 - 1 must not wrap to -1 (an empty slot, never moved)
    old, num_ranks = _checked_placement(old_phy2log, "old_phy2log", num_ranks)
    new, _ = _checked_placement(new_phy2log, "new_phy2log", num_ranks)
    if old.shape != new.shape:
        raise ValueError(f"old and new placements must have the same 2-D shape, got {old.shape} and {new.shape}")
    num_layers, num_slots = new.shape
    num_experts = max(int(max(old.max(initial=-1), new.max(initial=-1))) + 1, 1)
    held = membership(old, num_experts, num_ranks)
    rank = np.arange(num_slots) // (num_slots // num_ranks)
    flat = (np.maximum(new, 0) + num_experts * np.arange(num_layers)[:, None]) * num_ranks + rank
    return (new >= 0) & ~held.ravel()[flat]


def check_target(target: Any) -> float:
    """``target`` as a float; any real number but a bool (numpy's float32 too), in (0, 1].

    Read as the config reads ``movement_balancedness_target``: 10**400 or a huge Fraction is a
    ``ValueError`` naming ``target``, not the OverflowError ``float()`` raises on it.
    """
    rule = "a number in (0, 1]"
    value = as_finite_float(target, "target", rule)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"target must be {rule}, got {target!r}")
    return value


def check_max_moves(max_moves: Any) -> int | None:
    """``max_moves`` as an int: None, or an integer (not a bool) in [0, 2**63 - 1] (the int64 move counts)."""
    if max_moves is None:
        return None
    if isinstance(max_moves, bool) or not isinstance(max_moves, numbers.Integral) or not 0 <= max_moves <= _INT64_MAX:
        raise ValueError(
            f"max_moves must be None or an integer in [0, 2**63 - 1] (moved slots per layer), got {max_moves!r}"
        )
    return int(max_moves)


def check_old(old_phy2log: Any, num_layers: int, num_slots: int, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """The old placement as (L, P) int64 and its replica counts (L, N); ValueError naming ``old_phy2log``.

    ``check_rebalance_args`` has already checked its rank, layer count, dtype and range.
    """
    old = host_array(old_phy2log, "old_phy2log").astype(np.int64, copy=True)
    if old.shape != (num_layers, num_slots):
        raise ValueError(
            f"old_phy2log must have shape (layers, num_replicas) = ({num_layers}, {num_slots}), got {old.shape}"
        )
    count = expert_counts(old, num_experts)
    missing = count == 0
    if missing.any():
        layer, expert = (int(i) for i in np.argwhere(missing)[0])
        raise ValueError(
            f"old_phy2log must place every expert at least once; layer {layer} has no slot for expert {expert}"
            f" ({int(missing.sum())} missing in all)"
        )
    return old, count


def group_spans_nodes(old: np.ndarray, num_experts: int, num_groups: int, num_nodes: int) -> np.ndarray:
    """(L,) bool: some expert group has slots on more than one node."""
    num_layers, num_slots = old.shape
    group = np.where(old >= 0, old // (num_experts // num_groups), num_groups)
    node = np.arange(num_slots) // (num_slots // num_nodes)
    width = (num_groups + 1) * num_nodes
    flat = group * num_nodes + node[None, :] + width * np.arange(num_layers)[:, None]
    seen = np.bincount(flat.ravel(), minlength=num_layers * width).reshape(num_layers, num_groups + 1, num_nodes)
    return ((seen[:, :num_groups] > 0).sum(-1) > 1).any(-1)


def fill_empty_slots(cur: np.ndarray, w: np.ndarray, rows: np.ndarray, num_ranks: int | None = None) -> None:
    """Give every empty slot (-1) of ``rows`` to the expert with the largest load per replica.

    With ``num_ranks`` the choice is limited to the experts the slot's rank already holds
    in ``cur`` as passed in (a copy there moves nothing), and is free only for a rank that
    holds none: what a move limit needs, at some cost in balance.
    """
    num_experts = w.shape[1]
    on_rank = None
    if num_ranks is not None:
        on_rank = membership(cur[rows], num_experts, num_ranks)  # (len(rows), N, G), before any fill
        slots_per_rank = cur.shape[1] // num_ranks
    while True:
        pending = np.flatnonzero((cur[rows] < 0).any(1))
        if pending.size == 0:
            return
        todo = rows[pending]
        slot = (cur[todo] < 0).argmax(1)
        per = w[todo] / np.maximum(expert_counts(cur[todo], num_experts), 1)
        if on_rank is not None:
            local = on_rank[pending, :, slot // slots_per_rank]  # (len(todo), N)
            per = np.where(local | ~local.any(1, keepdims=True), per, -np.inf)
        cur[todo, slot] = per.argmax(1)


class ClassOrInstanceMethod:
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
