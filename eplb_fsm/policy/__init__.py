"""Placement policies: the interface, the registry, the default policy and quality bounds."""

from eplb_fsm.policy.base import AbstractEplbPolicy
from eplb_fsm.policy.bounds import (
    balancedness_bound,
    balancedness_per_layer,
    max_load_lower_bound,
    placement_balancedness,
    rank_loads,
)
from eplb_fsm.policy.default import DefaultEplbPolicy, balanced_packing, replicate_experts
from eplb_fsm.policy.registry import available_policies, get_policy, register_policy
from eplb_fsm.policy.movement import MovementAwarePolicy  # noqa: F401  (registers "movement_aware")

__all__ = [
    "AbstractEplbPolicy",
    "DefaultEplbPolicy",
    "available_policies",
    "balanced_packing",
    "balancedness_bound",
    "balancedness_per_layer",
    "get_policy",
    "max_load_lower_bound",
    "placement_balancedness",
    "rank_loads",
    "register_policy",
    "replicate_experts",
]
