"""Elastic EP scaling plan (pure): who goes where, which slot columns move, what would be lost.

A scale moves whole ranks: every rank keeps S slots, so P' = S * G'. Slot index spaces
change with the group (old group, new group, the plan's), and :func:`slot_columns` /
:func:`remap_columns` / :func:`resize_window` carry maps and load windows between them.
Nothing here talks to other ranks or touches a controller. (:func:`remap_columns` and
:func:`lost_experts` live with the planning they serve, in :mod:`eplb_fsm.fsm.planning`.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from eplb_fsm.fsm.planning import lost_experts, remap_columns
from eplb_fsm.maps import as_count
from eplb_fsm.stats import LoadWindow
from eplb_fsm.transfer.rank_mapping import RankMappingInfo, validate_rank_mapping

__all__ = [
    "ScalePlan",
    "default_rank_mapping",
    "make_scale_plan",
    "slot_columns",
    "remap_columns",
    "resize_window",
    "lost_experts",
    "lost_when_remapped",
    "place_lost",
]


@dataclass(frozen=True)
class ScalePlan:
    """A validated scale request: the rank mapping and where each phase runs.

    ``rank_mapping[old] = new`` (or -1: leaves). ``kind``: ``scale_down`` (transfer in the
    old group of ``old_world``) or ``scale_up`` (transfer in the new group of
    ``new_world``). ``joiners``: new ranks with no old rank; ``leaving``: old ranks mapped
    to -1. ``old_of_new[j]``: the old rank now called j (-1 for a joiner).
    """

    kind: str
    generation: int
    old_world: int
    new_world: int
    rank_mapping: dict
    joiners: tuple[int, ...]
    leaving: tuple[int, ...]
    old_of_new: tuple[int, ...]
    info: RankMappingInfo = field(repr=False)

    @property
    def group_world(self) -> int:
        """Ranks in the group the transfer runs in."""
        return self.old_world if self.kind == "scale_down" else self.new_world

    def new_rank(self, old_rank: int) -> int:
        return int(self.rank_mapping[old_rank])

    def describe(self) -> dict:
        return {"kind": self.kind, "generation": self.generation, "from_ranks": self.old_world,
                "to_ranks": self.new_world, "rank_mapping": {str(k): v for k, v in self.rank_mapping.items()},
                "joiners": list(self.joiners), "leaving": list(self.leaving)}


def default_rank_mapping(old_world: int, new_world: int) -> dict[int, int]:
    """Scale-down: the highest ranks leave, the others keep their numbers; scale-up: identity."""
    return {i: (i if i < new_world else -1) for i in range(old_world)}


def make_scale_plan(old_world: int, new_world: int, rank_mapping: Mapping[int, int] | None = None,
                    generation: int = 1) -> ScalePlan:
    """Validate a request to go from ``old_world`` to ``new_world`` ranks; ValueError naming the rule.

    ``rank_mapping`` must name every old rank, and only those: its keys are exactly
    ``0..old_world-1`` (an extra key would pass a scale-up's checks as a rank that does
    not exist, and a missing one would surface only as a ``KeyError`` half-way through).
    """
    old_world = as_count(old_world, "old world size", 1)
    new_world = as_count(new_world, "new_world_size", 1)
    if new_world == old_world:
        raise ValueError(f"new_world_size must differ from the current world size {old_world}")
    generation = as_count(generation, "generation", 1)
    mapping = default_rank_mapping(old_world, new_world) if rank_mapping is None else _mapping(rank_mapping)
    if set(mapping) != set(range(old_world)):
        raise ValueError(f"rank_mapping must have exactly the old ranks 0..{old_world - 1} as keys, "
                         f"got {sorted(mapping)}")
    if new_world < old_world:
        info = validate_rank_mapping(mapping, old_world)
        if info.new_world != new_world:
            raise ValueError(f"rank_mapping keeps {info.new_world} ranks but new_world_size is {new_world}")
        kind = "scale_down"
        old_of_new = tuple(info.group_of_new)
    else:
        info = validate_rank_mapping(mapping, new_world)
        kind = "scale_up"
        inverse = {int(v): int(k) for k, v in mapping.items()}
        old_of_new = tuple(inverse.get(j, -1) for j in range(new_world))
    mapping = {int(k): int(v) for k, v in mapping.items()}
    joiners = tuple(j for j, o in enumerate(old_of_new) if o < 0)
    leaving = tuple(i for i in range(old_world) if mapping[i] < 0)
    return ScalePlan(kind, generation, old_world, new_world, mapping, joiners, leaving, old_of_new, info)


def _mapping(rank_mapping: Any) -> dict[int, int]:
    """``rank_mapping`` as ``{int: int}``; a ValueError naming it when it is no mapping of integers."""
    if not isinstance(rank_mapping, Mapping):
        raise ValueError(f"rank_mapping must be a dict {{old_rank: new_rank or -1}}, "
                         f"got {type(rank_mapping).__name__}")
    return {as_count(k, "rank_mapping key", 0): as_count(v, "rank_mapping value", None)
            for k, v in rank_mapping.items()}


def slot_columns(src_of_dst_rank: Sequence[int], slots_per_rank: int) -> np.ndarray:
    """Column map for moving whole ranks: entry c = source column of destination column c, or -1.

    ``src_of_dst_rank[d]`` is the source rank whose S slots become destination rank d's
    (-1: destination rank d starts empty).
    """
    s = as_count(slots_per_rank, "slots_per_rank", 1)
    out = np.full(len(src_of_dst_rank) * s, -1, dtype=np.int64)
    for d, src in enumerate(src_of_dst_rank):
        if src >= 0:
            out[d * s:(d + 1) * s] = np.arange(src * s, (src + 1) * s)
    return out


def resize_window(window: LoadWindow, columns: np.ndarray) -> LoadWindow:
    """A new window whose slot c holds the counts of ``window``'s slot ``columns[c]`` (0 if -1).

    Ring position and fill level are kept, so every rank's window stays in step.
    """
    cols = torch.as_tensor(np.asarray(columns, dtype=np.int64))
    new = LoadWindow(window.num_layers, int(cols.numel()), window.window_size, device=window.load_pass.device)
    keep = cols >= 0
    if bool(keep.any()):
        dst = torch.nonzero(keep).reshape(-1).to(new.window.device)
        src = cols[keep].to(new.window.device)
        new.window[:, :, dst] = window.window[:, :, src]
        new.load_pass[:, dst] = window.load_pass[:, src]
    new.next_index = window.next_index
    new.filled = window.filled
    return new


def lost_when_remapped(models: Sequence[Any], columns: np.ndarray) -> list[dict]:
    """The experts each model entry would lose if its maps moved to the slot space ``columns``.

    ``models``: the controller's model entries; returns ``{"model", "layer", "expert"}``
    dicts (the ``lost_experts`` of scaling records), in model order.
    """
    lost: list[dict] = []
    for entry in models:
        projected = remap_columns(entry.maps.phy2log, columns)
        lost += [{"model": entry.name, "layer": layer, "expert": expert}
                 for layer, expert in lost_experts(projected, entry.num_logical)]
    return lost


def place_lost(phy2log: np.ndarray, num_logical: int) -> list[tuple[int, int, int]]:
    """Give every expert that ``phy2log`` (L, P) lacks a slot, in place; returns ``(layer, expert, slot)`` each.

    The slot is an empty one, else the last whose expert has another replica in the layer
    (one exists while P >= N). The maps are then valid, but each returned slot's weights
    are not its expert's: they must be reloaded before the slot serves.
    """
    placed = []
    for layer, expert in lost_experts(phy2log, num_logical):
        row = phy2log[layer]
        counts = np.bincount(row[row >= 0], minlength=num_logical)
        spare = [c for c in range(row.size) if row[c] < 0] or [c for c in range(row.size) if counts[row[c]] > 1]
        if not spare:
            raise ValueError(f"layer {layer} has no slot to spare for expert {expert} ({row.size} slots, "
                             f"{num_logical} experts)")
        slot = spare[0] if row[spare[0]] < 0 else spare[-1]
        row[slot] = expert
        placed.append((layer, expert, int(slot)))
    return placed
