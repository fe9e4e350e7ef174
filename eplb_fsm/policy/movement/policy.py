"""The movement-aware policy: keep most of the old placement, repair what the new load breaks.

The default policy re-plans from scratch, so a small drift in load moves almost every
slot. This policy starts from the placement in use (``old_phy2log``) and changes as few
slots as it can while staying within a target fraction of the default's balancedness
(docs/design.md §2: sum over layers of mean rank load / sum over layers of max rank load).
A slot is *moved* when its new expert was not on its rank before (its weights cross the
network); changes inside a rank are free. docs/policies.md has the long version.

The flow of :func:`plan_movement`, numpy and vectorised over layers throughout:

1. Plan with the default policy on the new load: its placement is the reference (max
   rank load ``d_l`` per layer) and the fallback; reaching ``target`` x its
   balancedness is one budget on the sum of per-layer maxima.
2. If the old placement fits the budget under the new load, keep it: zero moves.
3. Per-layer goals that share the budget (:mod:`~eplb_fsm.policy.movement.targets`).
   A layer whose old max rank load is above 1.5x the default's is re-planned without a
   search (under a move limit, only if that re-plan fits it; else it is searched, and so
   may spend the whole limit, as may any layer whose re-plan does not fit); when fewer
   than a third of the layers that must change are left to search (a large drift), the
   search is cut to one round (little to save, and a round costs about as much time for
   a few layers as for all).
4. Replica counts far off the default's fixed in one pass
   (:func:`~eplb_fsm.policy.movement.search.rebalance_counts`), then a local search of re-points and swaps,
   all layers per round (:mod:`~eplb_fsm.policy.movement.search`,
   :mod:`~eplb_fsm.policy.movement.moves`).
5. Fallback: re-planned layers, a layer whose repair would move as much as the default
   (or that gave up after moving half as much), and, if the budget is still missed, the
   layers furthest above the default's max take the default's placement with its ranks
   renumbered and rows aligned to the old ones
   (:func:`~eplb_fsm.policy.movement.targets.renumbered_default`), which moves less
   than the default's own numbering and never more.

Every placement it returns is valid: each expert keeps at least one replica, every rank
has P / G slots, and in hierarchical mode every group's replicas stay on one node.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from eplb_fsm.policy.base import AbstractEplbPolicy, build_log2phy, check_rebalance_args
from eplb_fsm.policy.default import DefaultEplbPolicy, rebalance_hierarchical, slots_of_experts
from eplb_fsm.policy.movement.placement import (
    ClassOrInstanceMethod,
    check_max_moves,
    check_old,
    check_target,
    expert_counts,
    fill_empty_slots,
    group_spans_nodes,
    membership,
    moves_per_layer,
    rank_counts,
    slot_loads,
)
from eplb_fsm.policy.movement.search import COUNT_CAP, MAX_ROUNDS, SearchState, rebalance_counts
from eplb_fsm.policy.movement.targets import layer_goals, renumbered_default
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
# are re-planned anyway, as after a large drift), the search gets only _BRIEF_ROUNDS
# rounds: they take the cheap repairs, and the fallback closes the rest. A round costs
# about the same time for a few layers as for all of them (numpy's per-call cost
# dominates), so a full search would cost several default plans for a small saving.
_SEARCH_MIN_SHARE = 1 / 3
_BRIEF_ROUNDS = 1
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
    for no limit; when the limit and the target disagree, the limit wins; the layers
    that move past it are listed in :class:`MovementAwarePolicy`) and
    ``diagnostics`` (compute ``moved`` / ``default_moved`` for every layer; when False,
    layers that did not need them hold -1). With ``old_phy2log=None`` the plan is the
    default's. Raises ``ValueError`` naming the argument for bad input.
    """
    import torch

    target = check_target(target)
    max_moves = check_max_moves(max_moves)
    weight32, num_slots, groups, nodes, num_ranks = check_rebalance_args(
        weight, num_replicas, num_groups, num_nodes, num_ranks, old_phy2log
    )
    num_layers, num_experts = weight32.shape
    # the default's placement: reference, fallback, and its replica counts (no log2phy)
    d_phy, d_count = rebalance_hierarchical(weight32, num_slots, groups, nodes, num_ranks)
    none = np.zeros(num_layers, dtype=bool)
    unknown = np.full(num_layers, -1, dtype=np.int64)
    if old_phy2log is None:
        zeros = np.zeros(num_layers, np.int64)
        return MovementPlan(d_phy, zeros, d_phy, d_count, zeros.copy(), none.copy(), none.copy(), ~none, 0)
    old, old_count = check_old(old_phy2log, num_layers, num_slots, num_experts)

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
    forced = none.copy()
    if nodes > 1:
        # layers the search cannot start from (hierarchical mode): a group spread over nodes
        # (no repair is searched for), or a rank with no expert at all, whose fill could pick
        # any group; an empty slot on a rank that holds experts copies one (same node)
        empty_rank = (old.reshape(shape) < 0).all(-1).any(-1)
        forced = group_spans_nodes(old, num_experts, groups, nodes) | empty_rank
    cur, cur_count = old.copy(), old_count
    if has_empty.any():
        # under a move limit, or to keep groups on their node, an empty slot takes an expert
        # its rank already holds (no move)
        local = max_moves is not None or nodes > 1
        fill_empty_slots(cur, w, rows[has_empty & ~forced], num_ranks if local else None)
        cur_count = expert_counts(cur, num_experts)
    cur_slot_loads = slot_loads(w, cur, cur_count)  # (L, P)
    cur_loads = cur_slot_loads.reshape(shape).sum(-1)  # (L, G)
    cur_max = cur_loads.max(1)
    keep = not forced.any() and not has_empty.any() and cur_max.sum() <= budget
    if keep and not diagnostics:
        return MovementPlan(
            old, np.zeros(num_layers, np.int64), d_phy, d_count, unknown, ~none, none.copy(), none.copy(), 0
        )
    held = membership(old, num_experts, num_ranks)  # (L, N, G): a move is an expert new to its rank
    # a copy: layers that need the default's moves get them filled in below, and ``moved``
    # must stay -1 (not computed) rather than report them
    d_moved = moves_per_layer(held, d_phy) if diagnostics else unknown.copy()
    if keep:
        return MovementPlan(
            old, np.zeros(num_layers, np.int64), d_phy, d_count, d_moved, ~none, none.copy(), none.copy(), 0
        )

    goal = layer_goals(cur_loads, d_max, forced, budget, nodes)
    active = ~forced & (cur_max > goal)
    # far worse than a fresh plan: re-plan the layer (renumbered default) without searching
    replan = active & (cur_max > _REPLAN_RATIO * d_max)
    # under a move limit, a layer whose renumbered default moves more than it allows cannot fall back (it would
    # keep its old placement, the worst layers untouched): it is searched, and may spend the whole limit
    no_fallback = none.copy()
    # each layer's renumbered default, computed once (``have_renum``: the layers it is computed for)
    renum, renum_moved, have_renum = np.empty_like(old), np.zeros(num_layers, np.int64), none.copy()
    if max_moves is not None and active.any():
        renum[active], renum_moved[active] = renumbered_default(old[active], held[active], d_phy[active],
                                                                num_ranks, nodes)
        have_renum |= active
        no_fallback = active & (renum_moved > max_moves)
        replan &= ~no_fallback
    active &= ~replan
    brief = active.sum() < _SEARCH_MIN_SHARE * (active | replan).sum()

    # the search, on the active layers; the others keep their starting placement for now
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
            limit = np.where(no_fallback[act], max_moves, np.minimum(limit, max_moves))
        sel = slice(None) if act.size == num_layers else act  # views, not copies, when all layers search
        st = SearchState(w[sel], cur[act], cur_count[sel], cur_slot_loads[sel], held[sel],
                         rank_counts(cur[act], num_experts, num_ranks), goal[act], num_ranks, nodes, limit)
        rebalance_counts(st, COUNT_CAP * (w[sel] / np.maximum(d_count[sel], 1)).max(1))
        st.run(budget, fixed_max=float(np.where(forced, d_max, cur_max)[~active].sum()),
               max_rounds=_BRIEF_ROUNDS if brief else MAX_ROUNDS)
        out[act] = st.cur
        new_max[act] = st.rank_load.max(1)
        new_moves[act] = st.moves
        rounds = st.rounds

    # per layer: the repaired placement or the renumbered default
    if not diagnostics and has_empty.any():
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
        need = fb[~have_renum[fb]]
        if need.size:
            renum[need], renum_moved[need] = renumbered_default(old[need], held[need], d_phy[need], num_ranks, nodes)
        fb_moved = renum_moved[fb]
        renumbered = renum[fb]
        if max_moves is not None:
            # a fallback that breaks the move limit is not taken, unless the layer is forced: its old
            # placement spreads a group over nodes or has a rank with no expert, and the policy
            # searches no node-valid repair for those: the (renumbered) default is all it has
            over = (fb_moved > max_moves) & ~forced[fb]
            fallback[fb[over]] = False
            renumbered, fb = renumbered[~over], fb[~over]
        out[fb] = renumbered
    changed = (out != old).any(1)
    moved = unknown
    if diagnostics:
        moved = np.zeros(num_layers, np.int64)
        moved[changed] = moves_per_layer(held[changed], out[changed])
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
    max_replicas = plan.phy2log.shape[1] - num_experts + 1
    if (plan.phy2log >= 0).all():  # full, as the plans are: the default's one-pass inversion
        replica_count = expert_counts(plan.phy2log, num_experts)
        log2phy = slots_of_experts(plan.phy2log, replica_count, max_replicas)
    else:
        log2phy, replica_count = build_log2phy(plan.phy2log, num_experts, max_replicas)
    return (
        torch.from_numpy(np.ascontiguousarray(plan.phy2log)),
        torch.from_numpy(log2phy),
        torch.from_numpy(replica_count),
    )


class MovementAwarePolicy(AbstractEplbPolicy):
    """Keeps the old placement and repairs it; moves far fewer slots than the default.

    Args:
        target: fraction of the default policy's balancedness (on the same load) to
            reach, in (0, 1]. Lower moves less. Default 0.99
            (``EplbConfig.movement_balancedness_target``).
        max_moves: at most this many moved slots per layer (None: no limit; else an integer
            in [0, 2**63 - 1], ``ValueError`` naming it otherwise). A layer that
            cannot reach its goal within it keeps its best repair, and the target may then
            be missed: the limit wins. Two exceptions: in hierarchical mode
            (``num_groups % num_nodes == 0``, more than one node) a layer whose old
            placement puts a group on more than one node, or has a rank whose slots are all
            empty (a new rank), takes the renumbered default whatever it moves. The policy
            does not search those layers for a node-valid repair (one within the limit may
            exist, e.g. swapping two slots back); it takes the one node-valid placement it
            has. In flat mode, an empty slot on a rank that held no expert gets an expert
            new to it. Every other empty slot, in either mode, takes an expert already on
            its rank (no move, and its group stays on its node).

    ``MovementAwarePolicy.rebalance_experts(...)`` (on the class) uses the defaults;
    ``MovementAwarePolicy(target=0.95).rebalance_experts(...)`` uses its own settings.
    Without ``old_phy2log`` it is exactly the default policy.
    """

    name = "movement_aware"
    target: float = DEFAULT_TARGET
    max_moves: int | None = None

    def __init__(self, target: float = DEFAULT_TARGET, max_moves: int | None = None) -> None:
        self.target = check_target(target)
        self.max_moves = check_max_moves(max_moves)

    @classmethod
    def from_config(cls, config: Any) -> "MovementAwarePolicy":
        """An instance with ``config.movement_balancedness_target`` as its target."""
        return cls(target=config.movement_balancedness_target)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(target={self.target}, max_moves={self.max_moves})"

    rebalance_experts = ClassOrInstanceMethod(_rebalance_experts)  # type: ignore[assignment]


register_policy(MovementAwarePolicy.name, MovementAwarePolicy)
