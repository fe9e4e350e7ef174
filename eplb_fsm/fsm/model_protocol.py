"""The MoE model protocol: what a model must expose for the controller to balance it.

A model (the engine's main model, or a speculative-decoding drafter) follows the
protocol when it has these attributes and this one method:

- ``num_moe_layers`` L, ``num_logical_experts`` N, ``num_physical_experts`` P = N + R,
  ``num_local_physical_experts`` S = P / G (G = EP ranks), ``num_redundant_experts`` R,
  ``num_expert_groups`` (experts come in groups of N / groups contiguous ids; 1 = none);
- ``expert_weights``: a list over the L MoE layers, each a list of tensors shaped
  ``(S, ...)``: this rank's rows of every per-expert parameter (e.g. up and down
  projections, scales). Row i holds the expert of global slot ``rank * S + i``.
  The controller moves rows in place; the tensors must stay the same objects;
- ``set_eplb_state(load_pass, log2phy, replica_count)``: called by the controller
  with the ``(L, P)`` int64 tensor the model adds its routed token counts into on
  every forward pass, and the ``(L, N, K)`` / ``(L, N)`` int64 maps the router must
  use. It is called again (same tensors, updated in place) each time a layer's maps
  change, so a model that copies the maps elsewhere can refresh its copy.

``validate_model`` checks all of it and raises ``ValueError`` naming the attribute and
the rule, before the controller changes anything.

Elastic EP (docs/elastic.md) uses two optional members: ``non_expert_weights`` (the
tensors every rank holds whole; a joining rank receives them in place) and
``set_ep_world(rank, world_size)`` (called when the group changes; S stays, P and R
follow). Without the latter the controller updates ``num_physical_experts`` and
``num_redundant_experts`` itself.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

import torch

from eplb_fsm.maps import as_count

REQUIRED_INTS = (
    "num_moe_layers",
    "num_logical_experts",
    "num_physical_experts",
    "num_local_physical_experts",
    "num_redundant_experts",
    "num_expert_groups",
)


@runtime_checkable
class MoEModel(Protocol):
    """Structural type of a model the controller can balance (see the module doc)."""

    num_moe_layers: int
    num_logical_experts: int
    num_physical_experts: int
    num_local_physical_experts: int
    num_redundant_experts: int
    num_expert_groups: int
    expert_weights: Sequence[Sequence[torch.Tensor]]

    def set_eplb_state(
        self, load_pass: torch.Tensor, log2phy: torch.Tensor, replica_count: torch.Tensor
    ) -> None: ...


def _int_attr(model: Any, name: str) -> int:
    if not hasattr(model, name):
        raise ValueError(f"model has no attribute {name!r} (required by the MoE protocol)")
    return as_count(getattr(model, name), f"model.{name}", minimum=None)  # bools refused: True is not a count


def validate_model(model: Any, world_size: int, config_redundant: int | None = None) -> dict[str, int]:
    """Check that ``model`` follows the protocol for an EP group of ``world_size`` ranks.

    Returns the model's shape as a dict (the ``REQUIRED_INTS`` names). Raises
    ``ValueError`` naming the attribute and the broken rule. ``config_redundant``,
    if given, must equal the model's ``num_redundant_experts``.
    """
    shape = {name: _int_attr(model, name) for name in REQUIRED_INTS}
    L = shape["num_moe_layers"]
    N = shape["num_logical_experts"]
    P = shape["num_physical_experts"]
    S = shape["num_local_physical_experts"]
    R = shape["num_redundant_experts"]
    groups = shape["num_expert_groups"]
    if L < 1:
        raise ValueError(f"model.num_moe_layers must be >= 1, got {L}")
    if N < 1:
        raise ValueError(f"model.num_logical_experts must be >= 1, got {N}")
    if R < 0:
        raise ValueError(f"model.num_redundant_experts must be >= 0, got {R}")
    if P != N + R:
        raise ValueError(
            f"model.num_physical_experts ({P}) must equal num_logical_experts + num_redundant_experts ({N} + {R})"
        )
    if world_size < 1 or P % world_size:
        raise ValueError(f"model.num_physical_experts ({P}) must be divisible by the EP world size ({world_size})")
    if S != P // world_size:
        raise ValueError(
            f"model.num_local_physical_experts ({S}) must equal num_physical_experts / world size "
            f"({P} / {world_size} = {P // world_size})"
        )
    if groups < 1 or N % groups:
        raise ValueError(f"model.num_expert_groups ({groups}) must be >= 1 and divide num_logical_experts ({N})")
    if config_redundant is not None and config_redundant != R:
        raise ValueError(
            f"model.num_redundant_experts ({R}) differs from config.num_redundant_experts ({config_redundant})"
        )
    setter = getattr(model, "set_eplb_state", None)
    if not callable(setter):
        raise ValueError("model has no callable set_eplb_state(load_pass, log2phy, replica_count)")
    weights = getattr(model, "expert_weights", None)
    if weights is None:
        raise ValueError("model has no attribute 'expert_weights' (required by the MoE protocol)")
    try:
        num_weight_layers = len(weights)
    except TypeError:
        raise ValueError("model.expert_weights must be a list over MoE layers of lists of tensors") from None
    if num_weight_layers != L:
        raise ValueError(f"model.expert_weights has {num_weight_layers} layers, num_moe_layers is {L}")
    for layer, tensors in enumerate(weights):
        if isinstance(tensors, torch.Tensor) or len(tensors) == 0:
            raise ValueError(f"model.expert_weights[{layer}] must be a non-empty list of tensors")
        for i, tensor in enumerate(tensors):
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"model.expert_weights[{layer}][{i}] must be a tensor, got {type(tensor).__name__}")
            if tensor.dim() < 1 or tensor.shape[0] != S:
                raise ValueError(
                    f"model.expert_weights[{layer}][{i}] must have {S} rows (one per local slot), "
                    f"got shape {tuple(tensor.shape)}"
                )
            if not tensor.is_contiguous():
                raise ValueError(f"model.expert_weights[{layer}][{i}] must be contiguous (rows are moved in place)")
    return shape


def bytes_per_slot(model: Any, layer: int) -> int:
    """Bytes one slot's weights take in ``layer`` (what one moved slot sends)."""
    return sum(tensor[0].numel() * tensor.element_size() for tensor in model.expert_weights[layer])
