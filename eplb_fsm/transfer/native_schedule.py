"""Every layer of a schedule in one C call, where the optional extension is built.

A rearrangement with new maps plans on its critical path: the Python planner
(:mod:`.plan_all`, :mod:`.local_copies`, :mod:`.schedule`) makes a few hundred small
numpy and Python calls per schedule, which cost about 0.35 ms per rank with warm caches
and 1-2 ms inside a transfer that has just streamed the weights through them
(docs/transfer.md, "Planning in C"). ``eplb_fsm/transfer/cschedule.c`` follows the same
rules in one pass and returns each layer's messages, copy runs, commit and commit split
as Python tuples; this module turns them into the same :class:`~.schedule.PreparedLayer`
and :class:`~.schedule.Commit` objects. The Python planner defines the result: the tests
compare both on random maps. Per-rank :class:`~.plan.LayerPlan` objects are not built
here; the schedule plans them in Python when something asks for them.

:func:`available` says whether the C path is used: the extension imported, and the
environment variable ``EPLB_FSM_NATIVE`` is not ``0`` (read at each call, as for the
policy's kernel). Only the plain schedule takes it; migration batching plans its waves
in Python.
"""

from __future__ import annotations

import os
from typing import Callable, Mapping

import numpy as np

from eplb_fsm.transfer.batching import Wave
from eplb_fsm.transfer.plan import LayerPlan
from eplb_fsm.transfer.schedule_types import Commit, PreparedLayer, WaveOps

try:
    from eplb_fsm.transfer.cschedule import maps_valid as _maps_valid, rank_layers as _rank_layers
except ImportError:  # not built (no compiler at install): the Python planner is used
    _maps_valid = _rank_layers = None

__all__ = ["available", "built", "maps_valid", "prepared_layers"]

_EMPTY = np.zeros(0, dtype=np.int64)
_EMPTY.flags.writeable = False


def built() -> bool:
    """Whether the C extension was built and imports."""
    return _rank_layers is not None


def available() -> bool:
    """Whether schedules take the C path now (built, and ``EPLB_FSM_NATIVE`` is not ``0``)."""
    return _rank_layers is not None and os.environ.get("EPLB_FSM_NATIVE", "1") != "0"


def maps_valid(old: np.ndarray, new: np.ndarray) -> bool:
    """``schedule``'s check of (L, P) int64 C-contiguous maps in one pass: ids in [-1, P),
    every needed expert held in its layer. Only where :func:`available`."""
    num_layers, p = old.shape
    return bool(_maps_valid(old, new, num_layers, p))


def _rows(values: tuple[int, ...]) -> np.ndarray:
    return np.array(values, dtype=np.int64) if values else _EMPTY


def prepared_layers(
    old: np.ndarray,
    new: np.ndarray,
    world_size: int,
    local_ranks: tuple[int, ...],
    plans_of: Callable[[int], Mapping[int, LayerPlan]],
) -> tuple[list[PreparedLayer], list[tuple[dict[int, Commit], dict[int, Commit]]]]:
    """Every layer prepared for ``local_ranks`` and the (early, late) commit split of each layer but the last.

    ``old``/``new``: (L, P) int64 C-contiguous maps, validated; ``plans_of(k)``: the
    ``plans`` mapping to give layer k. Equal, field by field, to what
    :class:`~.schedule.Schedule` builds in Python without migration batching.
    """
    num_layers, p = old.shape
    raw = _rank_layers(old, new, num_layers, p, int(world_size), tuple(local_ranks))
    layers: list[PreparedLayer] = []
    splits: list[tuple[dict[int, Commit], dict[int, Commit]]] = []
    for k, (pairs, bounds, per_rank) in enumerate(raw):
        if pairs:
            index = np.arange(bounds[-1])
            waves = [Wave(pairs, tuple(index[a:b] for a, b in zip(bounds, bounds[1:])))]
            ops: tuple[WaveOps, ...] = (
                WaveOps({r: v[0] for r, v in per_rank.items()}, {r: v[1] for r, v in per_rank.items()}),
            )
        else:
            waves, ops = [], ()
        local_runs, commits, staged = {}, {}, {}
        early: dict[int, Commit] = {}
        late: dict[int, Commit] = {}
        for r, (_, _, staged_runs, direct, reads, dst, src, runs, staged_rows, split) in per_rank.items():
            direct_reads = _rows(reads)
            commits[r] = Commit(direct, direct_reads, _rows(dst), _rows(src), runs)
            local_runs[r] = staged_runs
            staged[r] = _rows(staged_rows)
            if split is None:
                continue
            direct_early, e_dst, e_src, e_runs, l_dst, l_src, l_runs = split
            # the direct copies go with the early part only if an early write hits a row they read
            early[r] = Commit(direct if direct_early else (), direct_reads if direct_early else _EMPTY,
                              _rows(e_dst), _rows(e_src), e_runs)
            rest = Commit(() if direct_early else direct, _EMPTY if direct_early else direct_reads,
                          _rows(l_dst), _rows(l_src), l_runs)
            if not rest.empty:
                late[r] = rest
        layers.append(PreparedLayer(k, plans_of(k), waves, ops, local_runs, commits, staged))
        if k + 1 < num_layers:
            splits.append((early, late))
    return layers, splits
