"""Elastic EP: the rearrangement a scale runs, and the records a scale leaves.

Every role (member, survivor, leaving rank, joiner) takes the same transitions from
``groups_ready`` on: plan over the ranks after the scale, in the slot space of the group
the transfer runs in, then the usual sync transfer loop. A scale can't be refused, so
bad statistics mean planning on zero load and a plan that "isn't worth it" still runs.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from eplb_fsm.fsm.machine import SCALING
from eplb_fsm.fsm.planning import bad_load_reason, plan_placements
from eplb_fsm.fsm.scale_plan import ScalePlan

__all__ = ["rearrange_for_scale", "scaling_record", "tag_history"]


def rearrange_for_scale(ctl: Any, sp: ScalePlan, plan_world: int, to_group: np.ndarray,
                        from_group: np.ndarray) -> str:
    """groups_ready -> planning -> transferring ... -> committing -> scaling (or a fault).

    Returns the state the last event led to: ``scaling`` when the switch may go ahead.

    ``plan_world``: ranks after the scale; ``from_group`` (S * plan_world,) maps plan
    columns to the transfer group's slots, ``to_group`` (S * group world,) maps back.
    """
    ctl._fire("groups_ready", extra={"generation": sp.generation, "kind": sp.kind, "group": ctl.group_name})
    ctl._current = ctl._begin(ctl.steps, forced=True)
    try:
        reduced = ctl._all_reduce({"loads": ctl._local_loads()}, ctl._timeout)
    except Exception as exc:  # GroupBroken
        return ctl._group_fault(exc)
    flat = reduced["loads"]
    bad = bad_load_reason(flat) if flat.numel() else None
    if bad:  # a scale can't be refused for bad statistics: plan on zero load instead
        ctl.trace.emit("loads_rejected", reason=bad, scale=sp.generation)
        flat = torch.zeros_like(flat)
    loads = ctl._split_loads(flat)
    try:
        plan = plan_placements(ctl.policy, ctl.models, loads, num_nodes=ctl.config.num_nodes, world=ctl.world,
                               step=ctl._current.step, forced=True, plan_world=plan_world, to_group=to_group,
                               from_group=from_group)
    except Exception as exc:
        return ctl._abort(f"scale policy failed: {type(exc).__name__}: {exc}", recoverable=True)
    # the machine's "moves" here counts every slot whose content changes (within a rank too),
    # so only a scale that changes nothing at all skips the transfer
    changed_slots = sum(int((entry.maps.phy2log != new).sum()) for entry, new in zip(ctl.models, plan.new_phy2log))
    ctl._current.plan = plan
    fired = ctl._fire("plan_ready", extra={
        "scale": sp.generation, "moved_slots": plan.moves, "moved_bytes": plan.moved_bytes,
        "balancedness_before": round(plan.balancedness_before, 6),
        "balancedness_after": round(plan.balancedness_after, 6),
        "changed_layers": int(sum(plan.changed)), "policy_s": round(plan.policy_s, 6), "forced": True,
    }, moves=changed_slots, worth=True)
    if fired.dest == SCALING:  # nothing changes at all: the machine went straight on to the switch
        ctl._finish("skipped", reason="no_moves")
        return fired.dest
    return ctl._sync_transfer()


def tag_history(ctl: Any, sp: ScalePlan, count_before: int) -> None:
    """Mark the history entry the scale's rearrangement wrote (if it wrote one) with its generation."""
    if len(ctl.history) > count_before:
        ctl.history[-1]["scale"] = sp.generation


def scaling_record(ctl: Any, sp: ScalePlan, role: str, outcome: str, started: float, step: int, old_rank: int,
                   reason: str | None = None, lost: list | None = None, degraded: bool = False) -> dict:
    """This rank's entry for one scale request: appended to ``ctl.scalings`` and traced as ``scaling``."""
    plan_entry = None
    if ctl.history and ctl.history[-1].get("scale") == sp.generation:
        plan_entry = ctl.history[-1]
    entry = {
        "generation": sp.generation,
        "step": step,
        "kind": sp.kind,
        "from_ranks": sp.old_world,
        # the size of the group this rank served in afterwards (left: the group it left behind)
        "to_ranks": {"switched": sp.new_world, "left": sp.new_world, "aborted": sp.old_world}.get(outcome),
        "requested_ranks": sp.new_world,
        "role": role,
        "outcome": outcome,
        "old_rank": old_rank,
        "rank": ctl.rank if outcome != "left" else -1,
        "moved_slots": plan_entry["moves"] if plan_entry else 0,
        "moved_bytes": plan_entry["moved_bytes"] if plan_entry else 0,
        "layers_committed": plan_entry["layers_committed"] if plan_entry else 0,
        "seconds": round(time.perf_counter() - started, 6),
        "reason": reason,
        "lost_experts": lost or [],
        "degraded": degraded,
        "state": ctl.state,
    }
    ctl.scalings.append(entry)
    ctl.trace.emit("scaling", **{k: v for k, v in entry.items() if k != "state"})
    return entry
