"""Elastic EP: one scale request on a serving rank, and how a broken scale ends.

:class:`ScaleRequest` is what the serving ranks' flows (:mod:`~eplb_fsm.elastic.scaling`)
carry through a request; :func:`check_request` is everything checked before anything
changes; :func:`recovering` hands the waits after a fault the recovery deadline;
:func:`give_up` ends a scale ``failed`` when neither finishing nor going back is safe.
Everything here uses the controller's public port only (:mod:`eplb_fsm.elastic.port`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eplb_fsm.elastic.bounds import ScaleDeadline
from eplb_fsm.elastic.handover import non_expert_tensors
from eplb_fsm.elastic.records import scaling_record
from eplb_fsm.elastic.scale_plan import ScalePlan
from eplb_fsm.fsm.machine import FAILED

__all__ = ["ScaleRequest", "check_request", "describe_lost", "give_up", "recovering"]


@dataclass(frozen=True)
class ScaleRequest:
    """One scale request on this rank: its plan and what its ``scaling`` record needs."""

    sp: ScalePlan
    timeout: float      # bounds forming the new group (joiners arriving)
    started: float      # perf_counter() when the request came
    step: int           # the engine step it came at
    old_rank: int
    new_rank: int       # -1: this rank leaves
    deadline: ScaleDeadline  # every wait of the scale gets the time left before it

    def record(self, ctl: Any, role: str, outcome: str, **fields: Any) -> dict:
        return scaling_record(ctl, self.sp, role, outcome, self.started, self.step, self.old_rank,
                              bounds=self.deadline.describe(), **fields)


def check_request(ctl: Any, sp: ScalePlan) -> None:
    """Everything that can be checked before anything changes (ValueError naming the rule)."""
    if ctl.group is None or not callable(getattr(ctl.group, "successor", None)):
        raise ValueError("request_scale needs an EP group built with eplb_fsm.transfer.groups.StoreGroup "
                         "(a group that can build its successor from a shared store)")
    if not ctl.models:
        raise ValueError("request_scale needs at least one model (add_model)")
    if ctl.state == FAILED:
        raise ValueError("request_scale: the machine is failed; recover() first")
    nodes = ctl.config.num_nodes
    if sp.new_world % nodes:
        raise ValueError(f"new_world_size ({sp.new_world}) must be divisible by config.num_nodes ({nodes})")
    slots = {entry.name: entry.num_local for entry in ctl.models}
    if len(set(slots.values())) > 1:
        raise ValueError(f"request_scale needs the same slots per rank in every model (a scale moves whole ranks "
                         f"with one slot layout), got {slots}")
    if sp.kind == "scale_up":  # found here rather than half-way through the handover
        for entry in ctl.models:
            non_expert_tensors(entry.model, entry.name)
    for entry in ctl.models:
        p_new = entry.num_local * sp.new_world
        if p_new < entry.num_logical:
            raise ValueError(
                f"new_world_size {sp.new_world} gives model {entry.name!r} {p_new} slots "
                f"({entry.num_local} per rank) for {entry.num_logical} experts: every expert needs a slot")


def recovering(ctl: Any, deadline: ScaleDeadline) -> None:
    """From here on the scale's waits are its salvage / rollback / partial switch: the recovery deadline."""
    ctl.collectives.cap = lambda own: deadline.left(own, recovery=True)


def describe_lost(lost: list[dict]) -> str:
    return ", ".join(f"{d['model']} layer {d['layer']} expert {d['expert']}" for d in lost)


def give_up(ctl: Any, req: ScaleRequest, role: str, phase: str, reason: str, lost: list[dict]) -> dict:
    """Neither finishing nor going back is safe: ``scale_aborted``, then ``failed``."""
    ctl.trace.emit("scale_aborted", generation=req.sp.generation, phase=phase, reason=reason, lost_experts=lost)
    if ctl.state != FAILED:
        ctl.fire("fault", extra={"reason": reason, "scale": req.sp.generation, "lost_experts": lost},
                  recoverable=False)
    return req.record(ctl, role, "failed", reason=reason, lost=lost, phase=phase)
