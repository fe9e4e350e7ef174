"""Vectorised planning of every layer at once; results identical to :mod:`.plan`.

:func:`.plan.layer_transfers` works on dense (G, E) tables per layer, which at
DeepSeek-V3 shape (L=58, P=288, G=32) costs tens of milliseconds per rank once repeated
over all layers. Here the same rules (docs/design.md §6.1-§6.2) run once over sparse (layer, expert, rank) keys:

- holders: the distinct (l, e, r) of ``old`` with the first row of r holding e;
- needers: the same from ``new`` (the first row is the receiver's primary row); both
  restricted to the slots that can matter, which makes small rearrangements cheap;
- receivers: needers that are not holders; senders of a receiver: the holders of its
  (l, e) group, a contiguous run of the sorted holders in ascending rank;
- pairing k = R // S: sender i serves receivers i·k … i·k+k−1 plus receiver S·k+i.

Arrays: ``old``, ``new`` are (L, P) int64, -1 for an empty slot, valid by the rules of
:func:`.plan.check_layer_maps` (:func:`all_layer_transfers` checks them unless told they
are; :func:`plans_for_rank` takes them as checked); S = P / G slots per rank.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from eplb_fsm.maps import host_array
from eplb_fsm.transfer import native_schedule
from eplb_fsm.transfer.plan import LayerPlan, LayerTransfers, as_int64, check_layer_maps, read_only

__all__ = ["all_layer_transfers", "check_held", "maps_valid", "plans_for_rank"]


def _first_per_key(
    m: np.ndarray, keep: np.ndarray, g: int, num_experts: int
) -> tuple[np.ndarray, np.ndarray]:
    """Sorted distinct keys (l·E + e)·G + r of the slots of ``m`` (L, P) where ``keep``
    (L, P) is set, and for each key the first such row of rank r holding e in layer l.
    Both (K,) int64."""
    s = m.shape[1] // g
    layer, slot = np.nonzero(keep)  # row-major: ascending (l, r, row)
    key = (layer * num_experts + m[layer, slot]) * g + slot // s
    # np.unique's return_index is the first occurrence (stable sort): the lowest row
    uniq, first = np.unique(key, return_index=True)
    return uniq, slot[first] % s


def maps_valid(old: np.ndarray, new: np.ndarray) -> bool:
    """All layers at once: ids in [-1, P) and every needed expert held in its layer.

    ``old``/``new``: (L, P) C-contiguous int64 of the same shape, P % G == 0 already checked.
    """
    num_layers, p = old.shape
    if old.size == 0:
        return True
    if native_schedule.available():  # one C pass: a few µs where numpy takes ~0.1 ms at L=58, P=288
        return native_schedule.maps_valid(old, new)
    if min(old.min(), new.min()) < -1 or max(old.max(), new.max()) >= p:
        return False
    held = np.zeros((num_layers, p + 1), dtype=bool)  # column p: the empty slot (-1)
    layer = np.arange(num_layers)[:, None]
    held[layer, old] = True
    return bool(held[layer, new][new >= 0].all())


def check_held(old: np.ndarray, new: np.ndarray, world_size: int, name_layers: bool) -> None:
    """:func:`maps_valid` on ``old``/``new`` (L, P); where it fails, the per-layer check raises a ``ValueError``
    naming the first layer (``[k]`` after the argument, when ``name_layers``) and the rule that fails."""
    if not maps_valid(old, new):
        for k in range(old.shape[0]):
            check_layer_maps(old[k], new[k], world_size, what=f"[{k}]" if name_layers else "")


def _check_maps(old: Any, new: Any, world_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``old``, ``new`` (L, P) as C-contiguous int64, checked by :func:`.plan.check_layer_maps`' rules at once.

    Rules: integer arrays of one shape (L, P), P % world_size == 0, ids in [-1, P), every
    expert a layer's new row needs held in its old row. A ``ValueError`` names the
    argument, the first failing layer and the rule.
    """
    maps = []
    for name, m in (("old_phy2log", old), ("new_phy2log", new)):
        arr = host_array(m, name)
        if arr.dtype.kind not in "iu" or arr.ndim != 2:
            raise ValueError(f"{name}: must be an integer array of shape (L, P), got {arr.dtype} {arr.shape}")
        maps.append(as_int64(name, arr))
    old, new = maps
    if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)) or world_size < 1:
        raise ValueError(f"world_size: must be a positive int, got {world_size!r}")
    if old.shape != new.shape:
        raise ValueError(f"new_phy2log: shape {new.shape} must equal old_phy2log's {old.shape}")
    num_layers, p = old.shape
    if p % world_size:
        raise ValueError(f"phy2log: P={p} slots must divide by world_size={world_size} (P % G == 0)")
    old, new = np.ascontiguousarray(old), np.ascontiguousarray(new)
    check_held(old, new, world_size, name_layers=True)
    return old, new


def all_layer_transfers(old: Any, new: Any, world_size: int, *, validate: bool = True) -> list[LayerTransfers]:
    """Every layer's transfers, equal to ``layer_transfers(old[l], new[l], G)`` for each layer l.

    ``old``, ``new``: (L, P) integer maps, checked by the rules of
    :func:`.plan.check_layer_maps` (a ``ValueError`` naming the argument, the first failing
    layer and the rule) unless ``validate`` is False (maps already checked, e.g. by the
    executor's ``prepare_maps``). Returns L :class:`LayerTransfers`, each sorted by (src,
    dst, expert) with read-only int64 arrays.
    """
    if validate:
        old, new = _check_maps(old, new, world_size)
    old = np.asarray(old, dtype=np.int64)
    new = np.asarray(new, dtype=np.int64)
    num_layers, p = old.shape
    g = int(world_size)
    s = p // g
    # any E above the largest id keeps keys distinct; the result does not depend on it
    num_experts = max(1, int(max(old.max(initial=-1), new.max(initial=-1))) + 1)
    # Needers: only slots whose expert changes. A rank receiving e holds it nowhere, so all
    # its rows needing e changed: the receivers and their primary rows are unaffected.
    nkey, nrow = _first_per_key(new, (new >= 0) & (new != old), g, num_experts)  # (N,)
    # Holders: only of the (l, e) groups someone may need; other groups are never read.
    wanted = np.zeros(num_layers * num_experts, dtype=bool)
    wanted[nkey // g] = True
    lay = np.arange(num_layers)[:, None] * num_experts
    hold = (old >= 0) & wanted[lay + np.maximum(old, 0)]
    hkey, hrow = _first_per_key(old, hold, g, num_experts)  # (H,)
    # receivers: needers whose (l, e, r) is not among the holders
    pos = np.searchsorted(hkey, nkey)
    held = pos < hkey.size
    held[held] = hkey[pos[held]] == nkey[held]
    rkey, dst_row = nkey[~held], nrow[~held]  # (T,) sorted, so grouped by (l, e)
    # (l, e) group of each holder / receiver; both lists are sorted, so each group is a
    # contiguous run in ascending rank order. Group offsets come from dense (L·E,) counts,
    # cheaper than searchsorted on the keys.
    hgrp = hkey // g
    rgrp = rkey // g
    num_groups = num_layers * num_experts
    s_cnt = np.bincount(hgrp, minlength=num_groups)
    r_cnt = np.bincount(rgrp, minlength=num_groups)
    s_e = s_cnt[rgrp]  # senders of the receiver's group (>= 1 for valid maps)
    r_e = r_cnt[rgrp]  # receivers of the group
    s_start = (np.cumsum(s_cnt) - s_cnt)[rgrp]
    j = np.arange(rkey.size) - (np.cumsum(r_cnt) - r_cnt)[rgrp]  # position within the group
    k = r_e // s_e
    # receivers below S·k go in blocks of k; the remainder one per sender
    i = np.where(j < s_e * k, j // np.maximum(k, 1), j - s_e * k)
    sender = s_start + i
    src, src_row = hkey[sender] % g, hrow[sender]
    dst = rkey % g
    expert = rgrp % num_experts
    layer = rgrp // num_experts
    # order by (layer, src, dst, expert): one argsort of a combined key beats np.lexsort
    order = np.argsort(((layer * g + src) * g + dst) * num_experts + expert, kind="stable")
    # read-only once here: the per-layer slices below inherit it
    cols = [read_only(a[order]) for a in (src, dst, expert, src_row, dst_row)]
    bounds = np.concatenate([[0], np.cumsum(np.bincount(layer, minlength=num_layers))])
    return [
        LayerTransfers(g, s, *(c[bounds[x] : bounds[x + 1]] for c in cols))
        for x in range(num_layers)
    ]


def plans_for_rank(
    old: np.ndarray, new: np.ndarray, transfers: list[LayerTransfers], rank: int
) -> list[LayerPlan]:
    """``rank``'s plan for every layer, equal to ``plan_from_transfers(old[l], new[l], transfers[l], rank)``.

    ``old``, ``new``: (L, P) int64, validated; ``transfers``: L :class:`LayerTransfers`
    (e.g. from :func:`all_layer_transfers`). Returns L :class:`LayerPlan`.
    """
    old = np.asarray(old, dtype=np.int64)
    new = np.asarray(new, dtype=np.int64)
    num_layers = old.shape[0]
    if num_layers == 0:
        return []
    g, s = transfers[0].world_size, transfers[0].slots_per_rank
    if not 0 <= rank < g:
        raise ValueError(f"rank: must be in [0, {g}), got {rank}")
    o = old[:, rank * s : (rank + 1) * s]  # (L, S)
    n = new[:, rank * s : (rank + 1) * s]
    rows = np.arange(s, dtype=np.int64)
    empty = n < 0
    changed = ~empty & (n != o)
    unchanged = ~empty & ~changed
    if s:
        # first old row holding each new row's expert (argmax = first True), -1 if none
        match = n[:, :, None] == o[:, None, :]  # (L, S new rows, S old rows)
        has = match.any(axis=2)
        first_old = np.where(has, match.argmax(axis=2), -1)
        # first new row with the same expert: a remote row is primary iff that is itself.
        # Every row needing a remote expert is remote, so the first one is the primary.
        first_same = (n[:, :, None] == n[:, None, :]).argmax(axis=2)  # (L, S)
    else:
        has = np.zeros((num_layers, 0), dtype=bool)
        first_old = first_same = np.zeros((num_layers, 0), dtype=np.int64)
    local = changed & has
    remote = changed & ~has
    primary = remote & (first_same == rows)
    duplicate = remote & ~primary
    # each row field for every layer at once: one nonzero per mask, then per-layer
    # slices of one read-only array (views, so the layer loop below is cheap)
    per_layer = {
        name: _by_layer(mask, values, num_layers)
        for name, mask, values in (
            ("empty_rows", empty, None),
            ("unchanged_rows", unchanged, None),
            ("local_rows", local, None),
            ("local_src_rows", local, first_old),
            ("primary_rows", primary, None),
            ("primary_experts", primary, n),
            ("duplicate_rows", duplicate, None),
            ("duplicate_src_rows", duplicate, first_same),
        )
    }
    plans = []
    for x, t in enumerate(transfers):
        # transfers are sorted by src: this rank's sends are one contiguous run
        a, b = np.searchsorted(t.src, [rank, rank + 1])
        recvs = t.dst == rank
        plans.append(
            LayerPlan(
                rank=int(rank),
                world_size=g,
                slots_per_rank=s,
                **{name: rows_of[x] for name, rows_of in per_layer.items()},
                send_peers=read_only(t.dst[a:b]),
                send_experts=read_only(t.expert[a:b]),
                send_rows=read_only(t.src_row[a:b]),
                recv_peers=read_only(t.src[recvs]),
                recv_experts=read_only(t.expert[recvs]),
                recv_rows=read_only(t.dst_row[recvs]),
            )
        )
    return plans


def _by_layer(mask: np.ndarray, values: np.ndarray | None, num_layers: int) -> list[np.ndarray]:
    """For a (L, S) mask, layer l's masked row numbers (``values`` None) or ``values[l]``
    at those rows: L read-only int64 views of one array, in row order."""
    layer, row = np.nonzero(mask)
    picked = read_only(row if values is None else values[layer, row])
    bounds = np.searchsorted(layer, np.arange(num_layers + 1)).tolist()
    return [picked[bounds[x] : bounds[x + 1]] for x in range(num_layers)]
