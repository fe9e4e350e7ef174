"""What the controller keeps for each balanced model (main model, drafter): maps, window, buffer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from eplb_fsm.fsm.model_protocol import bytes_per_slot, validate_model
from eplb_fsm.maps import ExpertMaps
from eplb_fsm.policy.base import is_hierarchical
from eplb_fsm.stats import LoadWindow
from eplb_fsm.transfer import TransferBuffer
from eplb_fsm.transfer.inputs import check_devices, check_movable, find_shared_memory

__all__ = ["ModelEntry", "build_model_entry", "check_weights_distinct"]


@dataclass
class ModelEntry:
    """One balanced model and what the controller keeps for it."""

    name: str
    model: Any
    index: int
    layer_offset: int            # global index of its layer 0 (models' layers are concatenated)
    num_layers: int
    num_logical: int
    num_physical: int
    num_local: int
    num_groups: int
    maps: ExpertMaps
    window: LoadWindow
    log2phy: torch.Tensor        # (L, N, K) handed to the model, updated in place
    replica_count: torch.Tensor  # (L, N) handed to the model, updated in place
    buffer: Any                  # transfer.TransferBuffer (one layer)
    slot_bytes: list[int]        # bytes of one slot's weights, per layer
    spare_buffer: Any = None     # the second TransferBuffer (async_prefetch), made on first use

    def describe(self) -> dict:
        return {
            "model": self.name,
            "layers": self.num_layers,
            "layer_offset": self.layer_offset,
            "logical": self.num_logical,
            "physical": self.num_physical,
            "local": self.num_local,
            "groups": self.num_groups,
            "slot_bytes": self.slot_bytes[0] if self.slot_bytes else 0,
        }

    def install_maps(self, maps: ExpertMaps, device: torch.device) -> None:
        """Replace the maps wholesale (new tensors on ``device``) and hand them to the model."""
        self.maps = maps
        self.log2phy = torch.from_numpy(maps.log2phy.copy()).to(device)
        self.replica_count = torch.from_numpy(maps.replica_count.copy()).to(device)
        self.model.set_eplb_state(self.window.load_pass, self.log2phy, self.replica_count)

    def install_placement(self, phy2log: np.ndarray, device: torch.device, window: LoadWindow | None = None) -> None:
        """Maps of ``phy2log`` (L, P) (empty slots allowed; elastic EP) and, with a new slot count,
        the re-indexed load ``window``; the model gets them at once."""
        if window is not None:
            self.window = window
            self.num_physical = int(phy2log.shape[1])
        maps = ExpertMaps.from_phy2log(phy2log, self.num_logical,
                                       max_replicas=max(phy2log.shape[1] - self.num_logical + 1, 1),
                                       allow_empty=True)
        self.install_maps(maps, device)

    def commit_row(self, layer: int, new_row: np.ndarray) -> None:
        """Flip one layer's maps to ``new_row`` (P,) in place and move its window counts along.

        The router's tensors are updated in place, so the model sees the new layer at once.
        """
        old_row = self.maps.phy2log[layer].copy()
        self.maps.replace_layer(layer, new_row, allow_empty=True)   # a scale's plan may empty slots (elastic EP)
        self.window.remap_layer(layer, old_row, new_row, self.num_logical)
        self.publish_row(layer)

    def publish_row(self, layer: int) -> None:
        """Copy one layer's ``log2phy`` (max_replicas,) and ``replica_count`` (N,) rows from the maps into
        the router's tensors in place, and hand them to the model (``set_eplb_state``)."""
        self.log2phy[layer].copy_(torch.from_numpy(self.maps.log2phy[layer]))
        self.replica_count[layer].copy_(torch.from_numpy(self.maps.replica_count[layer]))
        self.model.set_eplb_state(self.window.load_pass, self.log2phy, self.replica_count)


def check_weights_distinct(model: Any, name: str, others: Sequence[ModelEntry]) -> None:
    """Refuse ``model`` if any of its expert weight rows shares memory with another of its own
    or with a model already added (``others``), e.g. the same model added twice: moving
    one would silently overwrite the other's rows, and its maps would no longer describe
    its weights. Also refuses a layout the executor cannot move (see
    :func:`eplb_fsm.transfer.inputs.check_movable`). Raises ``ValueError`` naming both models
    and the layer and tensor.
    """
    named = []
    for layer, tensors in enumerate(model.expert_weights):
        for t, tensor in enumerate(tensors):
            check_movable(f"model {name!r}: expert_weights[{layer}][{t}]", tensor, layer)
            named.append((f"model {name!r} expert_weights[{layer}][{t}]", tensor))
    for entry in others:
        for layer, tensors in enumerate(entry.model.expert_weights):
            named.extend((f"model {entry.name!r} expert_weights[{layer}][{t}]", tensor)
                         for t, tensor in enumerate(tensors))
    shared = find_shared_memory(named)
    if shared is not None:
        raise ValueError(
            f"{shared[0]} shares memory with {shared[1]}: every balanced model needs its own expert weights "
            "(moving one model's rows would overwrite the other's, and its maps would no longer describe them)")


def build_model_entry(model: Any, name: str, index: int, layer_offset: int, world_size: int, num_redundant: int,
                      window_size: int, device: torch.device, phy2log: Any = None,
                      others: Sequence[ModelEntry] = (), communicator: Any = None, num_nodes: int = 1) -> ModelEntry:
    """Validate ``model`` for ``world_size`` ranks and build its entry (maps, window, router tensors, buffer).

    ``phy2log`` (L, P): its current placement (default: the initial contiguous one); it
    needs one column per slot of the group, P = S × G (S: this rank's weight rows). ``others``:
    the entries already added (their weights must not share memory with this model's).
    ``communicator``: the transfer group's; weights it cannot move (off the CPU on a gloo
    group) are refused here rather than at the first rearrangement. The model is not told
    about the entry yet (the controller does that once it is added). ``num_nodes``: the
    config's; where it divides the model's expert groups the built-in policies pack groups
    per node, which needs it to divide ``world_size`` too (refused here, not at every plan).
    """
    shape = validate_model(model, world_size, num_redundant)
    groups = shape["num_expert_groups"]
    if is_hierarchical(groups, num_nodes) and world_size % num_nodes:
        raise ValueError(f"config.num_nodes ({num_nodes}) must divide the EP world size ({world_size}) for model "
                         f"{name!r}: it divides num_expert_groups ({groups}), so the policy packs groups per node")
    L = shape["num_moe_layers"]
    N = shape["num_logical_experts"]
    P = shape["num_physical_experts"]
    S = shape["num_local_physical_experts"]
    if communicator is not None:
        for layer, tensors in enumerate(model.expert_weights):
            check_devices(communicator, f"model {name!r}: expert_weights[{layer}]", list(tensors), layer)
    check_weights_distinct(model, name, others)
    if phy2log is None:
        maps = ExpertMaps.initial(L, N, P)
    else:
        got = tuple(getattr(phy2log, "shape", np.shape(phy2log)))
        if got != (L, P):
            raise ValueError(
                f"phy2log: must have shape (num_moe_layers, S × G) = ({L}, {S} × {world_size} = {P}): one row per "
                f"MoE layer and one column per slot of the group, where S = {S} is the rows of this rank's "
                f"expert_weights tensors; got shape {got}")
        maps = ExpertMaps.from_phy2log(phy2log, N)
    return ModelEntry(
        name=name,
        model=model,
        index=index,
        layer_offset=layer_offset,
        num_layers=L,
        num_logical=N,
        num_physical=P,
        num_local=shape["num_local_physical_experts"],
        num_groups=shape["num_expert_groups"],
        maps=maps,
        window=LoadWindow(L, P, window_size, device=device),
        log2phy=torch.from_numpy(maps.log2phy.copy()).to(device),
        replica_count=torch.from_numpy(maps.replica_count.copy()).to(device),
        buffer=TransferBuffer(),
        slot_bytes=[bytes_per_slot(model, layer) for layer in range(L)],
    )
