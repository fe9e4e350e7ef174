"""The movement-aware policy: keep most of the old placement, repair what the new load breaks.

Modules, in the order :func:`plan_movement` uses them (each imports only those above it):

- :mod:`.placement`: move counting (:func:`~.placement.moved_mask`) and input checks;
- :mod:`.targets`: per-layer goals that share the budget, and the default placement
  renumbered to move least (the fallback);
- :mod:`.moves`: candidate changes of the local search, scored for all layers at once;
- :mod:`.search`: the replica-count fix and the local search's round loop;
- :mod:`.policy`: :func:`plan_movement` and :class:`MovementAwarePolicy` (registered
  as ``"movement_aware"``).
"""

from eplb_fsm.policy.movement.placement import moved_mask, rank_membership
from eplb_fsm.policy.movement.policy import DEFAULT_TARGET, MovementAwarePolicy, MovementPlan, plan_movement

__all__ = ["DEFAULT_TARGET", "MovementAwarePolicy", "MovementPlan", "moved_mask", "plan_movement", "rank_membership"]
