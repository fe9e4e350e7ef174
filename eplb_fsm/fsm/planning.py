"""Planning: aggregate the load, run the policy, accept or skip the plan.

:func:`plan_placements` is pure (same load, same plan on every rank): it runs the policy
for every model and prices the result (moved slots and bytes per layer, balancedness
before and after). It also serves elastic scaling, which plans for another number of
ranks and expresses the plan in the transfer group's slot space.

:func:`local_loads` is this rank's part of the planning load (what the step all-reduces),
:func:`split_loads` cuts the all-reduced one back into models. :func:`remap_columns` and
:func:`lost_experts` carry placements between slot index spaces (elastic EP).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from eplb_fsm.maps import ExpertMaps
from eplb_fsm.policy.bounds import rank_loads
from eplb_fsm.policy.movement.targets import align_rows
from eplb_fsm.stats import aggregate_logical, balancedness, load_fault
from eplb_fsm.transfer.plan import slot_moves

__all__ = ["Plan", "bad_load_reason", "plan_placements", "local_loads", "split_loads",
           "remap_columns", "lost_experts"]


@dataclass
class Plan:
    """A new placement for every model, and what moving to it would cost and gain.

    Computed identically on every rank from the all-reduced load, so each field is shared.
    """

    step: int
    forced: bool
    loads: list[torch.Tensor]          # per model, (L, N) float64 planning load
    new_phy2log: list[np.ndarray]      # per model, (L, P) int64
    changed: list[bool]                # per global layer: does the row change at all
    moved: list[int]                   # per global layer: slots whose expert crosses ranks
    moves: int
    moved_bytes: int
    balancedness_before: float
    balancedness_after: float
    policy_s: float
    chunks: list[int] | None = None    # per global layer: pieces of its paced transfer (set by the Rearranger)

    @property
    def gain(self) -> float:
        return self.balancedness_after - self.balancedness_before


def bad_load_reason(flat: torch.Tensor) -> str | None:
    """Why an all-reduced load can't be planned on (every rank sees the same tensor), or None."""
    if flat.numel() == 0:
        return "empty load"
    return load_fault(flat)


def plan_placements(policy: Any, models: Sequence[Any], loads: Sequence[torch.Tensor], *, num_nodes: int,
                    world_size: int, step: int, forced: bool, plan_world_size: int | None = None,
                    to_group: np.ndarray | None = None, from_group: np.ndarray | None = None,
                    align_slots: bool = False) -> Plan:
    """Run the policy for every model on the shared load and price the new placement.

    ``models``: the controller's model entries; ``loads``: per model (L, N) float64.
    ``world_size``: ranks of the group the transfer runs in (moves are counted there).

    Elastic scaling plans for ``plan_world_size`` ranks (P' = S * plan_world_size slots) in the plan's
    own slot space: ``from_group`` (P',) maps plan columns to the transfer group's (-1:
    empty) and ``to_group`` (P,) maps back; ``new_phy2log`` is in the transfer group's
    space. Without them the plan is made in place, for ``world_size`` ranks.

    ``align_slots`` (in place only): reorder each rank's slots of the policy's placement so
    an expert that stays on its rank keeps its old row (:func:`align_rows`). Every rank holds
    the same experts as the policy said, so the balance and the moved slots are unchanged,
    and the commit copies only rows whose expert changes (a policy that plans from scratch,
    as the default does, reorders most rows of a rank otherwise).
    """
    t0 = time.perf_counter()
    scaled = plan_world_size is not None
    plan_world_size = world_size if plan_world_size is None else plan_world_size
    new_rows: list[np.ndarray] = []
    changed: list[bool] = []
    moved: list[int] = []
    before, after = [], []
    moved_bytes = 0
    for entry, load in zip(models, loads):
        old = entry.maps.phy2log
        p_plan = entry.num_local * plan_world_size if scaled else entry.num_physical
        plan_old = remap_columns(old, from_group) if scaled else old
        # the old placement is only a hint the policy may keep close to; one with lost experts is none
        hint = None if scaled and lost_experts(plan_old, entry.num_logical) else torch.from_numpy(plan_old.copy())
        phy2log, _, _ = policy.rebalance_experts(load, p_plan, entry.num_groups, num_nodes, plan_world_size,
                                                 old_phy2log=hint)
        planned = np.ascontiguousarray(np.asarray(phy2log.detach().cpu().numpy(), dtype=np.int64))
        if planned.shape != (entry.num_layers, p_plan):
            raise ValueError(f"policy returned phy2log of shape {planned.shape} for model "
                             f"{entry.name!r}, expected {(entry.num_layers, p_plan)}")
        # validates; a plan in place must fit the router's log2phy width (rows are replaced in it)
        width = p_plan - entry.num_logical + 1 if scaled else entry.maps.max_replicas
        ExpertMaps.from_phy2log(planned, entry.num_logical, max_replicas=width)
        if align_slots and not scaled:
            planned = align_rows(old, planned, world_size)
        new = remap_columns(planned, to_group) if scaled else planned
        for layer in range(entry.num_layers):
            changed.append(not np.array_equal(old[layer], new[layer]))
            slots, rows = slot_moves(old[layer], new[layer], world_size)
            moved.append(slots)
            # bytes that cross ranks: a rank gaining two slots of one expert receives one row
            moved_bytes += rows * entry.slot_bytes[layer]
        before.append(rank_loads(old, load, world_size))
        after.append(rank_loads(planned, load, plan_world_size))
        new_rows.append(new)
    return Plan(
        step=step,
        forced=forced,
        loads=loads,
        new_phy2log=new_rows,
        changed=changed,
        moved=moved,
        moves=int(sum(moved)),
        moved_bytes=int(moved_bytes),
        balancedness_before=balancedness(np.concatenate(before)),
        balancedness_after=balancedness(np.concatenate(after)),
        policy_s=time.perf_counter() - t0,
    )


def local_loads(models: Sequence[Any], config: Any) -> torch.Tensor:
    """This rank's planning load of every model, (sum_m L_m * N_m,) float64, concatenated."""
    pieces = []
    for entry in models:
        window = entry.window
        if config.load_estimator == "window_sum":
            physical = window.physical_load().to(torch.float64)
        else:
            physical = window.estimate(config.load_estimator, config.load_decay)
        phy2log = torch.from_numpy(entry.maps.phy2log).to(physical.device)
        pieces.append(aggregate_logical(physical, phy2log, entry.num_logical).reshape(-1))
    return torch.cat(pieces)


def split_loads(models: Sequence[Any], flat: torch.Tensor) -> list[torch.Tensor]:
    """The all-reduced (sum_m L_m * N_m,) load back into per-model (L, N) CPU tensors."""
    out, start = [], 0
    for entry in models:
        n = entry.num_layers * entry.num_logical
        out.append(flat[start:start + n].reshape(entry.num_layers, entry.num_logical).cpu())
        start += n
    return out


def remap_columns(arr: Any, columns: np.ndarray, fill: int = -1) -> np.ndarray:
    """``arr[..., columns]`` with ``fill`` where a column is -1 (numpy, int64 kept)."""
    a = np.asarray(arr)
    cols = np.asarray(columns, dtype=np.int64)
    if cols.size and cols.max() >= a.shape[-1]:
        raise ValueError(f"columns name column {int(cols.max())} of an array with {a.shape[-1]}")
    out = np.take(a, np.maximum(cols, 0), axis=-1)
    out[..., cols < 0] = fill
    return out


def lost_experts(phy2log: Any, num_logical: int) -> list[tuple[int, int]]:
    """(layer, expert) pairs that have no slot in ``phy2log`` (L, P)."""
    arr = np.asarray(phy2log, dtype=np.int64)
    lost = []
    for layer, row in enumerate(arr):
        present = np.bincount(row[row >= 0], minlength=num_logical)[:num_logical] > 0
        lost.extend((layer, int(e)) for e in np.flatnonzero(~present))
    return lost
