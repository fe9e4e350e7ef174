"""The movement-aware policy: keep most of the old placement, repair what the new load breaks.

The default policy re-plans from scratch, so a small drift in load moves almost every
slot. This policy starts from the placement in use (``old_phy2log``) and changes as few
slots as it can while staying within a target fraction of the default's balancedness
(design section 2: sum over layers of mean rank load / sum over layers of max rank load).
A slot is *moved* when its new expert was not on its rank before (its weights cross the
network); changes inside a rank are free. docs/policies.md has the long version.

The flow of :func:`plan_movement`, numpy and vectorised over layers throughout:

1. Plan with the default policy on the new load: its placement is the reference (max
   rank load ``d_l`` per layer) and the fallback; reaching ``target`` x its
   balancedness is one budget on the sum of per-layer maxima.
2. If the old placement fits the budget under the new load, keep it: zero moves.
3. Per-layer goals that share the budget (:mod:`~eplb_fsm.policy.movement_budget`).
4. Replica counts far off the default's fixed in one pass
   (:mod:`~eplb_fsm.policy.movement_counts`), then a local search of re-points and swaps,
   all layers per round (:mod:`~eplb_fsm.policy.movement_search`,
   :mod:`~eplb_fsm.policy.movement_moves`).
5. Fallback: a layer whose old max rank load is above 1.5x the default's is re-planned
   without a search; a layer whose repair would move as much as the default, or that
   gave up after moving half as much, and, if the budget is still missed, the layers
   furthest above the default's max, take the default's placement with its ranks
   renumbered and rows aligned to the old ones
   (:func:`~eplb_fsm.policy.movement_cost.renumbered_default`), which moves less than
   the default's own numbering and never more.

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
from eplb_fsm.policy.default import DefaultEplbPolicy, rebalance_hierarchical
from eplb_fsm.policy.movement_budget import layer_goals
from eplb_fsm.policy.movement_cost import (
    expert_counts,
    membership,
    moves_per_layer,
    rank_counts,
    renumbered_default,
    slot_loads,
)
from eplb_fsm.policy.movement_counts import COUNT_CAP, rebalance_counts
from eplb_fsm.policy.movement_search import SearchState
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
# When fewer than this share of the layers that must change would be searched (the others
# are re-planned anyway, as after a large drift), they are re-planned too: repairing them
# saves a small part of the rearrangement's moves, and a search round costs about the
# same time for a few layers as for all of them (numpy's per-call cost dominates).
_SEARCH_MIN_SHARE = 1 / 3
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


def _check_old(old_phy2log: Any, num_layers: int, num_slots: int, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
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


# --------------------------------------------------------------------------- helpers


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
        per = w[todo] / np.maximum(expert_counts(cur[todo], num_experts), 1)
        cur[todo, slot] = per.argmax(1)


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
    d_phy, d_count = rebalance_hierarchical(weight32, num_slots, groups, nodes, num_ranks)
    none = np.zeros(num_layers, dtype=bool)
    if old_phy2log is None:
        zeros = np.zeros(num_layers, np.int64)
        return MovementPlan(d_phy, zeros, d_phy, d_count, zeros.copy(), none.copy(), none.copy(), ~none, 0)
    old, old_count = _check_old(old_phy2log, num_layers, num_slots, num_experts)

    # loads in float64 from the caller's values (the default casts to float32 itself)
    if isinstance(weight, torch.Tensor):
        w = weight.detach().cpu().to(torch.float64).numpy()
    else:
        w = np.asarray(weight, dtype=np.float64)
    shape = (num_layers, num_ranks, num_slots // num_ranks)
    rows = np.arange(num_layers)
    d_max = slot_loads(w, d_phy, d_count).reshape(shape).sum(-1).max(1)
    budget = float(d_max.sum()) / target * (1 - _BUDGET_MARGIN)

    has_empty = (old < 0).any(1)
    # layers the search cannot start from (hierarchical mode): a group spread over nodes,
    # or empty slots, which only a node-aware fill could place
    forced = (_group_spans_nodes(old, num_experts, groups, nodes) | has_empty) if nodes > 1 else none.copy()
    cur = old.copy()
    cur_count = old_count
    if has_empty.any():
        _fill_empty_slots(cur, w, rows[has_empty & ~forced])
        cur_count = expert_counts(cur, num_experts)
    cur_loads = slot_loads(w, cur, cur_count).reshape(shape).sum(-1)
    cur_max = cur_loads.max(1)
    keep = not forced.any() and not has_empty.any() and cur_max.sum() <= budget
    d_moved = np.full(num_layers, -1, dtype=np.int64)
    if not (keep and not diagnostics):
        held = membership(old, num_experts, num_ranks)  # (L, N, G): a move is an expert new to its rank
        if diagnostics:
            d_moved = moves_per_layer(held, d_phy)
    if keep:
        return MovementPlan(old, np.zeros(num_layers, np.int64), d_phy, d_count, d_moved, ~none, none.copy(), none.copy(), 0)

    goal = layer_goals(cur_loads, d_max, forced, budget, nodes)
    active = ~forced & (cur_max > goal)
    # far worse than a fresh plan: re-plan the layer (renumbered default) without searching
    replan = active & (cur_max > _REPLAN_RATIO * d_max)
    active &= ~replan
    if active.sum() < _SEARCH_MIN_SHARE * (active | replan).sum():
        replan |= active
        active[:] = False

    act = rows[active]
    new_max = cur_max.copy()
    new_moves = np.zeros(num_layers, np.int64)
    if has_empty.any():
        new_moves[has_empty] = moves_per_layer(held[has_empty], cur[has_empty])
    out = cur
    rounds = 0
    if act.size:
        if not diagnostics:
            d_moved[act] = moves_per_layer(held[act], d_phy[act])
        limit = np.maximum((_GIVE_UP_FRACTION * d_moved[act]).astype(np.int64), 1)
        if max_moves is not None:
            limit = np.minimum(limit, max_moves)
        sel = slice(None) if act.size == num_layers else act  # a view, not a copy, when all layers search
        st = SearchState(w[sel], cur[act], held[sel], rank_counts(cur[act], num_experts, num_ranks), goal[act],
                         num_ranks, nodes, limit)
        rebalance_counts(st, COUNT_CAP * (w[sel] / np.maximum(d_count[sel], 1)).max(1))
        fixed_max = float(np.where(forced, d_max, cur_max)[~active].sum())
        st.run(budget, fixed_max)
        out[act] = st.cur
        new_max[act] = st.rank_load.max(1)
        new_moves[act] = st.moves
        rounds = st.rounds

    # per layer: the repaired placement or the renumbered default
    if not diagnostics:
        need = ~active & has_empty & ~replan
        d_moved[need] = moves_per_layer(held[need], d_phy[need])
    fallback = forced | replan | ((active | has_empty) & (new_moves >= d_moved))
    excess = np.where(fallback, d_max, new_max).sum() - budget
    if excess > 0:
        # the layers furthest above the default's max fall back first
        cand = rows[~fallback & (new_max > d_max)]
        cand = cand[np.argsort(-(new_max - d_max)[cand], kind="stable")]
        saved = np.cumsum(new_max[cand] - d_max[cand])
        fallback[cand[: int(np.searchsorted(saved, excess)) + 1]] = True
    fb = rows[fallback]
    if fb.size:
        renumbered, fb_moved = renumbered_default(old[fb], held[fb], d_phy[fb], num_ranks, nodes)
        if max_moves is not None:
            # a fallback that breaks the move limit is not taken (unless the layer must change)
            over = (fb_moved > max_moves) & ~forced[fb]
            fallback[fb[over]] = False
            renumbered, fb = renumbered[~over], fb[~over]
        out[fb] = renumbered
    changed = (out != old).any(1)
    if diagnostics:
        moved = np.zeros(num_layers, np.int64)
        moved[changed] = moves_per_layer(held[changed], out[changed])
    else:
        moved = np.full(num_layers, -1, dtype=np.int64)
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
