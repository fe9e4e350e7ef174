"""Planning: aggregate the load, run the policy, accept or skip the plan.

:func:`plan_placements` is pure (same load, same plan on every rank): it runs the policy
for every model and prices the result (moved slots and bytes per layer, balancedness
before and after). It also serves elastic scaling, which plans for another number of
ranks and expresses the plan in the transfer group's slot space.

:class:`PlanningMixin` is the controller's side: this rank's planning load, acting on the
all-reduced one, and the ``plan_ready`` transition.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import structlog
import torch

from eplb_fsm.fsm.machine import TRANSFERRING
from eplb_fsm.fsm.scale_plan import lost_experts, remap_columns
from eplb_fsm.maps import ExpertMaps
from eplb_fsm.policy.bounds import rank_loads
from eplb_fsm.stats import aggregate_logical
from eplb_fsm.transfer import moved_slots

__all__ = ["Plan", "PlanningMixin", "bad_load_reason", "balancedness", "plan_placements"]

_log = structlog.get_logger("eplb_fsm")


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

    @property
    def gain(self) -> float:
        return self.balancedness_after - self.balancedness_before


def bad_load_reason(flat: torch.Tensor) -> str | None:
    """Why an all-reduced load can't be planned on (every rank sees the same tensor), or None."""
    if flat.numel() == 0:
        return "empty load"
    if bool(torch.isnan(flat).any()):
        return "NaN in the load"
    if not bool(torch.isfinite(flat).all()):
        return "infinite load"
    if bool((flat < 0).any()):
        return f"negative load (min {float(flat.min())})"
    return None


def balancedness(rank_loads: Sequence[np.ndarray]) -> float:
    """sum(mean) / sum(max) over every layer of every model (design §2); each item (L, G)."""
    means = sum(float(loads.mean(axis=1).sum()) for loads in rank_loads)
    maxes = sum(float(loads.max(axis=1).sum()) for loads in rank_loads)
    return means / maxes if maxes > 0 else 1.0


def plan_placements(policy: Any, models: Sequence[Any], loads: Sequence[torch.Tensor], *, num_nodes: int,
                    world: int, step: int, forced: bool, plan_world: int | None = None,
                    to_group: np.ndarray | None = None, from_group: np.ndarray | None = None) -> Plan:
    """Run the policy for every model on the shared load and price the new placement.

    ``models``: the controller's model entries; ``loads``: per model (L, N) float64.
    ``world``: ranks of the group the transfer runs in (moves are counted there).

    Elastic scaling plans for ``plan_world`` ranks (P' = S * plan_world slots) in the plan's
    own slot space: ``from_group`` (P',) maps plan columns to the transfer group's (-1:
    empty) and ``to_group`` (P,) maps back; ``new_phy2log`` is in the transfer group's
    space. Without them the plan is made in place, for ``world`` ranks.
    """
    t0 = time.perf_counter()
    scaled = plan_world is not None
    plan_world = world if plan_world is None else plan_world
    new_rows: list[np.ndarray] = []
    changed: list[bool] = []
    moved: list[int] = []
    before, after = [], []
    moved_bytes = 0
    for entry, load in zip(models, loads):
        old = entry.maps.phy2log
        p_plan = entry.num_local * plan_world if scaled else entry.num_physical
        plan_old = remap_columns(old, from_group) if scaled else old
        # the old placement is only a hint the policy may keep close to; one with lost experts is none
        hint = None if scaled and lost_experts(plan_old, entry.num_logical) else torch.from_numpy(plan_old.copy())
        phy2log, _, _ = policy.rebalance_experts(load, p_plan, entry.num_groups, num_nodes, plan_world,
                                                 old_phy2log=hint)
        planned = np.ascontiguousarray(np.asarray(phy2log.detach().cpu().numpy(), dtype=np.int64))
        if planned.shape != (entry.num_layers, p_plan):
            raise ValueError(f"policy returned phy2log of shape {planned.shape} for model "
                             f"{entry.name!r}, expected {(entry.num_layers, p_plan)}")
        # validates; a plan in place must fit the router's log2phy width (rows are replaced in it)
        width = p_plan - entry.num_logical + 1 if scaled else entry.maps.max_replicas
        ExpertMaps.from_phy2log(planned, entry.num_logical, max_replicas=width)
        new = remap_columns(planned, to_group) if scaled else planned
        for layer in range(entry.num_layers):
            changed.append(not np.array_equal(old[layer], new[layer]))
            count = moved_slots(old[layer], new[layer], world)
            moved.append(count)
            moved_bytes += count * entry.slot_bytes[layer]
        before.append(rank_loads(old, load, world))
        after.append(rank_loads(planned, load, plan_world))
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
        balancedness_before=balancedness(before),
        balancedness_after=balancedness(after),
        policy_s=time.perf_counter() - t0,
    )


class PlanningMixin:
    """The ``planning`` state's actions for :class:`~eplb_fsm.fsm.controller.EplbController`.

    Uses ``models``, ``config``, ``policy``, ``world``, ``worker`` and ``_current``; ends a
    rearrangement through ``_abort`` / ``_finish`` and starts the sync transfer.
    """

    def _local_loads(self) -> torch.Tensor:
        """This rank's planning load of every model, (sum_m L_m * N_m,) float64, concatenated."""
        pieces = []
        for entry in self.models:
            window = entry.window
            if self.config.load_estimator == "window_sum":
                physical = window.physical_load().to(torch.float64)
            else:
                physical = window.estimate(self.config.load_estimator, self.config.load_decay)
            phy2log = torch.from_numpy(entry.maps.phy2log).to(physical.device)
            pieces.append(aggregate_logical(physical, phy2log, entry.num_logical).reshape(-1))
        return torch.cat(pieces)

    def _split_loads(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The all-reduced (sum_m L_m * N_m,) load back into per-model (L, N) CPU tensors."""
        out, start = [], 0
        for entry in self.models:
            n = entry.num_layers * entry.num_logical
            out.append(flat[start:start + n].reshape(entry.num_layers, entry.num_logical).cpu())
            start += n
        return out

    def _planning(self, flat_loads: torch.Tensor) -> None:
        """Act on the all-reduced load: reject it, or plan (sync) / start the policy job (async)."""
        bad = bad_load_reason(flat_loads)
        if bad is not None:
            self.trace.emit("loads_rejected", reason=bad)
            _log.warning("eplb loads rejected", rank=self.rank, step=self.steps - 1, reason=bad)
            self._abort(f"bad loads: {bad}", recoverable=True, kind="rejected")
            return
        loads = self._split_loads(flat_loads)
        current = self._current
        if self.worker is None:
            try:
                plan = self._make_plan(loads, current.step, current.forced)
            except Exception as exc:
                self._abort(f"policy failed: {type(exc).__name__}: {exc}", recoverable=True)
                return
            if self._accept_plan(plan):
                self._sync_transfer()
        else:
            current.job = self.worker.submit(self._make_plan, loads, current.step, current.forced, kind="plan")

    def _make_plan(self, loads: list[torch.Tensor], step: int, forced: bool) -> Plan:
        """Run the policy for every model on the shared load (pure: same input, same plan)."""
        return plan_placements(self.policy, self.models, loads, num_nodes=self.config.num_nodes, world=self.world,
                               step=step, forced=forced)

    def _accept_plan(self, plan: Plan) -> bool:
        """Fire ``plan_ready``; True when it leads to transferring."""
        current = self._current
        current.plan = plan
        threshold = self.config.min_balancedness_gain
        worth = plan.moves > 0 and plan.gain > threshold
        extra = {
            "balancedness_before": round(plan.balancedness_before, 6),
            "balancedness_after": round(plan.balancedness_after, 6),
            "gain": round(plan.gain, 6),
            "moved_bytes": plan.moved_bytes,
            "changed_layers": int(sum(plan.changed)),
            "policy_s": round(plan.policy_s, 6),
            "forced": plan.forced,
        }
        fired = self._fire("plan_ready", extra=extra, moves=plan.moves, worth=worth)
        if fired.dest != TRANSFERRING:
            reason = "no_moves" if plan.moves == 0 else "gain_below_threshold"
            self.trace.emit("plan_skipped", reason=reason, moves=plan.moves, gain=round(plan.gain, 6),
                            min_balancedness_gain=threshold)
            _log.info("eplb rearrangement skipped", rank=self.rank, step=plan.step, reason=reason,
                      moves=plan.moves, gain=round(plan.gain, 6), min_gain=threshold)
            self._finish("skipped", reason=reason)
            return False
        return True
