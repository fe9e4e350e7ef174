"""Inputs of the movement-aware policy: settings, the old placement, and where a search may start.

- :func:`check_target`, :func:`check_max_moves`: the policy's settings, ``ValueError``
  naming the setting otherwise.
- :func:`check_old`: ``old_phy2log`` as an (L, P) int64 array plus its replica counts;
  ``ValueError`` naming ``old_phy2log`` if it does not fit or drops an expert.
- :func:`group_spans_nodes`: layers whose old placement breaks the hierarchical rule
  (a group on more than one node); the search cannot start from those.
- :func:`fill_empty_slots`: an empty slot (-1, elastic scale-up) gets the expert with
  the largest load per replica, so the search starts from a full placement.
- :class:`ClassOrInstanceMethod`: how ``rebalance_experts`` finds its settings (the
  class defaults, or an instance's).
"""

from __future__ import annotations

import math
import types
from typing import Any, Callable

import numpy as np

from eplb_fsm.policy.movement_cost import expert_counts

__all__ = [
    "ClassOrInstanceMethod",
    "check_max_moves",
    "check_old",
    "check_target",
    "fill_empty_slots",
    "group_spans_nodes",
]


def check_target(target: Any) -> float:
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not math.isfinite(target):
        raise ValueError(f"target must be a number in (0, 1], got {target!r}")
    if not 0.0 < float(target) <= 1.0:
        raise ValueError(f"target must be in (0, 1], got {target}")
    return float(target)


def check_max_moves(max_moves: Any) -> int | None:
    if max_moves is None:
        return None
    if isinstance(max_moves, bool) or not isinstance(max_moves, (int, np.integer)) or max_moves < 0:
        raise ValueError(f"max_moves must be None or an integer >= 0 (moved slots per layer), got {max_moves!r}")
    return int(max_moves)


def check_old(old_phy2log: Any, num_layers: int, num_slots: int, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """The old placement as (L, P) int64 and its replica counts (L, N); ValueError naming ``old_phy2log``.

    ``check_rebalance_args`` has already checked its rank, layer count, dtype and range.
    """
    old = old_phy2log.detach().cpu().numpy() if hasattr(old_phy2log, "detach") else np.asarray(old_phy2log)
    old = old.astype(np.int64, copy=True)
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


def fill_empty_slots(cur: np.ndarray, w: np.ndarray, rows: np.ndarray) -> None:
    """Give every empty slot (-1) of ``rows`` to the expert with the largest load per replica."""
    num_experts = w.shape[1]
    while True:
        todo = rows[(cur[rows] < 0).any(1)]
        if todo.size == 0:
            return
        slot = (cur[todo] < 0).argmax(1)
        per = w[todo] / np.maximum(expert_counts(cur[todo], num_experts), 1)
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
