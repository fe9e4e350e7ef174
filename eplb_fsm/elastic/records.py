"""Elastic EP: the rearrangement a scale runs, and the records a scale leaves.

Every role (member, survivor, leaving rank, joiner) takes the same transitions from
``groups_ready`` on: plan over the ranks after the scale, in the slot space of the group
the transfer runs in, then the usual sync transfer loop. A scale can't be refused, so
bad statistics mean planning on zero load and a plan that "isn't worth it" still runs
(:meth:`eplb_fsm.fsm.rearrange.Rearranger.run_forced`).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from eplb_fsm.elastic.scale_plan import ScalePlan
from eplb_fsm.fsm.planning import plan_placements

__all__ = ["rearrange_for_scale", "scaling_record", "tag_history"]


def rearrange_for_scale(ctl: Any, sp: ScalePlan, plan_world: int, to_group: np.ndarray,
                        from_group: np.ndarray) -> str:
    """groups_ready -> planning -> transferring ... -> committing -> scaling (or a fault).

    Returns the state the last event led to: ``scaling`` when the switch may go ahead.
    ``plan_world``: ranks after the scale; ``from_group`` (S * plan_world,) maps plan
    columns to the transfer group's slots, ``to_group`` (S * group world,) maps back.
    """
    ctl.fire("groups_ready", extra={"generation": sp.generation, "kind": sp.kind, "group": ctl.group_name})
    step = ctl.steps

    def make_plan(loads: list) -> Any:
        return plan_placements(ctl.policy, ctl.models, loads, num_nodes=ctl.config.num_nodes,
                               world_size=ctl.world_size, step=step, forced=True,
                               plan_world_size=plan_world,
                               to_group=to_group, from_group=from_group)

    return ctl.rearranger.run_forced(make_plan, {"scale": sp.generation}, sp.generation)


def tag_history(ctl: Any, sp: ScalePlan, count_before: int) -> None:
    """Mark the history entry the scale's rearrangement wrote (if it wrote one) with its generation."""
    if len(ctl.history) > count_before:
        ctl.history[-1]["scale"] = sp.generation


def scaling_record(ctl: Any, sp: ScalePlan, role: str, outcome: str, started: float, step: int, old_rank: int,
                   reason: str | None = None, lost: list | tuple | None = (), degraded: bool = False,
                   phase: str | None = None, bounds: dict | None = None, partial: bool = False) -> dict:
    """This rank's entry for one scale request: appended to ``ctl.scalings`` and traced as ``scaling``.

    ``phase``: where a scale that did not simply switch ended (prepare, handover, transfer,
    salvage, rollback); ``bounds``: its deadlines (``deadline_s``, ``bound_s``, see elastic.bounds);
    ``partial``: a scale-up that switched although its rearrangement stopped part-way (elastic.partial).
    ``lost``: the experts no working rank holds any more; ``None`` when this rank cannot know
    (a leaving rank whose old group broke), traced as ``null``.
    """
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
        "lost_experts": None if lost is None else list(lost),
        "degraded": degraded,
        "partial": partial,
        "phase": phase,
        **(bounds or {}),
        "state": ctl.state,
    }
    ctl.scalings.append(entry)
    # the trace stamps the record's own rank (the one this rank writes as); the rank it has after the scale,
    # -1 when it left, is the record's new_rank
    ctl.trace.emit("scaling", new_rank=entry["rank"], **{k: v for k, v in entry.items() if k not in ("state", "rank")})
    return entry
