"""Rank mappings for elastic EP: ``{old_rank: new_rank or -1}``.

A rearrangement that changes the number of EP ranks runs in one process group and
needs both maps in that group's index space (S slots per rank stay the same):

- **scale-down** (or a permutation of ranks): runs in the OLD group (size = number of
  old ranks). The new map, given over the new ranks, is expanded so that old rank i
  gets the slots of new rank ``mapping[i]``; ranks that leave (-1) get empty slots
  (-1): they only send.
- **scale-up**: runs in the NEW group (larger than the old one). The old map, given
  over the old ranks, is expanded so that new rank ``mapping[i]`` gets the slots old
  rank i had; joining ranks get empty slots (-1): they only receive.

Which case applies follows from the group size: equal to the number of old ranks →
old group; larger → new group; smaller is an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from eplb_fsm.maps import host_array

__all__ = ["RankMappingInfo", "validate_rank_mapping", "expand_phy2log", "expand_maps"]


@dataclass(frozen=True)
class RankMappingInfo:
    """A validated mapping and where its transfer runs.

    ``kind``: "scale_down", "scale_up" or "permute". ``runs_in``: "old" or "new" group.
    ``group_of_old[i]``: group rank of old rank i (-1 when it is not in the group);
    ``group_of_new[j]``: group rank of new rank j.
    """

    kind: str
    runs_in: str
    old_world: int
    new_world: int
    group_size: int
    group_of_old: tuple[int, ...]
    group_of_new: tuple[int, ...]


def _as_int(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise ValueError(f"rank_mapping: {name} must be an int, got {v!r}")
    return int(v)


def _group_size(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"group_size: must be a positive int, got {value!r}")
    return int(value)


def validate_rank_mapping(rank_mapping: Mapping[int, int], group_size: int) -> RankMappingInfo:
    """Check ``rank_mapping`` fits a transfer group of ``group_size`` ranks; describe it.

    Rules: keys are exactly the old ranks 0..G_old-1; values are -1 or distinct ranks.
    group_size == G_old (old group): the kept ranks' values are exactly 0..G_new-1, at
    least one kept. group_size > G_old (new group, scale-up): no -1 (a rank outside the
    new group could not send its experts) and values in [0, group_size).
    Raises ``ValueError`` naming ``rank_mapping`` and the broken rule.
    """
    if not isinstance(rank_mapping, Mapping):
        raise ValueError(
            f"rank_mapping: must be a dict {{old_rank: new_rank or -1}}, got {type(rank_mapping).__name__}"
        )
    group_size = _group_size(group_size)
    items = {_as_int("a key", k): _as_int("a value", v) for k, v in rank_mapping.items()}
    g_old = len(items)
    if g_old == 0:
        raise ValueError("rank_mapping: must not be empty")
    if sorted(items) != list(range(g_old)):
        raise ValueError(f"rank_mapping: keys must be the old ranks 0..{g_old - 1}, got {sorted(items)}")
    values = [items[i] for i in range(g_old)]
    kept = [v for v in values if v != -1]
    if any(v < -1 for v in values):
        raise ValueError(f"rank_mapping: values must be a new rank >= 0 or -1 (leaving), got {values}")
    if len(set(kept)) != len(kept):
        raise ValueError(f"rank_mapping: two old ranks map to the same new rank: {values}")
    if group_size < g_old:
        raise ValueError(
            f"rank_mapping: has {g_old} old ranks but the group has {group_size}: a scale-down "
            "must run in the old group (group size = number of old ranks)"
        )
    if group_size == g_old:
        g_new = len(kept)
        if g_new == 0:
            raise ValueError("rank_mapping: every rank leaves; at least one must stay")
        if sorted(kept) != list(range(g_new)):
            raise ValueError(
                f"rank_mapping: in the old group the kept ranks must map onto new ranks 0..{g_new - 1}, got {values}"
            )
        group_of_new = [0] * g_new
        for i, v in enumerate(values):
            if v != -1:
                group_of_new[v] = i
        kind = "scale_down" if g_new < g_old else "permute"
        return RankMappingInfo(kind, "old", g_old, g_new, group_size, tuple(range(g_old)), tuple(group_of_new))
    # group_size > g_old: scale-up in the new group
    if len(kept) != g_old:
        raise ValueError(
            f"rank_mapping: a scale-up runs in the new group of {group_size}; old ranks mapped to -1 "
            f"({[i for i, v in enumerate(values) if v == -1]}) would not be in it"
        )
    if max(kept) >= group_size:
        raise ValueError(f"rank_mapping: new ranks must be in [0, {group_size}) (the group size), got {values}")
    return RankMappingInfo("scale_up", "new", g_old, group_size, group_size, tuple(values), tuple(range(group_size)))


def _as_maps(name: str, m: Any) -> np.ndarray:
    arr = host_array(m, name)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{name}: must be an integer array (int64 phy2log), got dtype {arr.dtype}")
    if arr.ndim not in (1, 2):
        raise ValueError(f"{name}: must be (P,) or (L, P), got shape {arr.shape}")
    arr = arr.astype(np.int64, copy=False)
    p = arr.shape[-1]
    if arr.size and (arr.min() < -1 or arr.max() >= p):
        raise ValueError(
            f"{name}: expert ids must be -1 (empty) or in [0, P={p}), found {int(arr[(arr < -1) | (arr >= p)][0])}"
        )
    return arr


def expand_phy2log(phy2log: Any, group_of_rank: tuple[int, ...] | list[int], group_size: int) -> np.ndarray:
    """Place each rank's S slots at its group rank's position; other group ranks get -1.

    ``phy2log``: (P,) or (L, P) over ``len(group_of_rank)`` ranks; ``group_of_rank[r]`` is
    the group rank of rank r (-1: not in the group, its slots are dropped). Returns
    (group_size * S,) or (L, group_size * S), S = P / len(group_of_rank).
    Raises ``ValueError`` naming the argument: ``group_size`` not a positive int,
    ``group_of_rank`` empty, an entry not an int in [-1, group_size), or two ranks
    placed at one group rank (one would silently overwrite the other's slots).
    """
    group_size = _group_size(group_size)
    if isinstance(group_of_rank, np.ndarray) and group_of_rank.ndim == 1:
        group_of_rank = group_of_rank.tolist()
    if isinstance(group_of_rank, (str, bytes)) or not isinstance(group_of_rank, Sequence) or not group_of_rank:
        raise ValueError(f"group_of_rank: must be a non-empty list of group ranks, one per rank, got {group_of_rank!r}")
    for r, gr in enumerate(group_of_rank):
        if isinstance(gr, bool) or not isinstance(gr, (int, np.integer)) or not -1 <= gr < group_size:
            raise ValueError(f"group_of_rank: entry {r} must be an int in [-1, group_size={group_size}), got {gr!r}")
    kept = [int(gr) for gr in group_of_rank if gr != -1]
    if len(set(kept)) != len(kept):
        raise ValueError(f"group_of_rank: the group ranks other than -1 must be distinct, got {list(group_of_rank)}")
    arr = _as_maps("phy2log", phy2log)
    g = len(group_of_rank)
    p = arr.shape[-1]
    if p % g:
        raise ValueError(f"phy2log: P={p} slots must divide by its {g} ranks (P % G == 0)")
    s = p // g
    lead = arr.shape[:-1]
    out = np.full(lead + (group_size * s,), -1, dtype=np.int64)
    for r, gr in enumerate(group_of_rank):
        if gr < 0:
            continue
        out[..., gr * s : (gr + 1) * s] = arr[..., r * s : (r + 1) * s]
    return out


def expand_maps(
    old_phy2log: Any, new_phy2log: Any, rank_mapping: Mapping[int, int], group_size: int
) -> tuple[np.ndarray, np.ndarray, RankMappingInfo]:
    """Both maps in the index space of the group the transfer runs in, plus the mapping info.

    ``old_phy2log`` is over the old ranks, ``new_phy2log`` over the new ranks, each (P,) or
    (L, P) with the same S slots per rank. The result has group_size * S columns.
    """
    info = validate_rank_mapping(rank_mapping, group_size)
    old = _as_maps("old_phy2log", old_phy2log)
    new = _as_maps("new_phy2log", new_phy2log)
    if old.shape[:-1] != new.shape[:-1]:
        raise ValueError(f"new_phy2log: shape {new.shape} must have the same layers as old_phy2log {old.shape}")
    if old.shape[-1] % info.old_world:
        raise ValueError(
            f"old_phy2log: P={old.shape[-1]} slots must divide by the {info.old_world} old ranks (P % G == 0)"
        )
    s = old.shape[-1] // info.old_world
    if new.shape[-1] != info.new_world * s:
        raise ValueError(
            f"new_phy2log: with rank_mapping it must span the {info.new_world} new ranks x {s} slots per rank "
            f"= {info.new_world * s} columns, got {new.shape[-1]}"
        )
    if info.runs_in == "old":
        return old, expand_phy2log(new, info.group_of_new, group_size), info
    return expand_phy2log(old, info.group_of_old, group_size), new, info

