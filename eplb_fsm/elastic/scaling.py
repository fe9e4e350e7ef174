"""Elastic EP: the ``scaling`` state's actions (ranks leave or join while the engine serves).

The machine (``fsm.machine``) has the rows; this module performs them for the controller:

Scale-down, G -> G' < G (default: the highest ranks leave)::

    collecting --scale_requested--> scaling      all G check their requests and maps agree
                                                  (scale_check);
                                                  survivors build the new group (G' ranks);
                                                  all G agree on it in the old group
    scaling --groups_ready--> planning            plan over the survivors: P' = S * G'
    planning --plan_ready--> transferring ...     in the OLD group: leaving ranks' new slots
    ... --committed--> scaling                    are empty, so they only send
    scaling --switched--> collecting              survivors swap to the new group; leaving
                                                  ranks write their last record and stop

Scale-up, G -> G' > G (default: old ranks keep their numbers, joiners take the rest)::

    collecting --scale_requested--> scaling      rank 0 publishes the handover (maps,
                                                  counters) in the store; the old G wait for
                                                  the joiners' answers and agree on them, on
                                                  the request and on their maps (scale_check);
                                                  all G' build the new group; the old G agree
                                                  on it;
                                                  joiners get the non-expert weights (split
                                                  over the old ranks, point to point)
    scaling --groups_ready--> planning            in the NEW group: joiners' old slots empty
    ... transferring ... committing --committed--> scaling --switched--> collecting

A joiner is a new process: :func:`join` builds its controller in ``scaling`` and it takes
the same transitions from ``groups_ready`` on. Both directions run inside one call
(``EplbController.request_scale`` on the ranks already serving, ``EplbController.join``
on the joiners), in sync and async mode alike; async mode first drains a rearrangement
that is in flight (its pending layer is committed or rolled back) so that nothing runs in
the background across the switch. The load-balancing interval restarts after a switch.

Faults (a joiner never arrives, a transfer fails, a rank dies mid-scale) end the scale
``aborted`` (the old group serves on, old maps) or ``switched`` on the survivors with
every expert kept (a scale-up whose new group is intact switches with its rearrangement
cut short: ``partial``, :mod:`~eplb_fsm.elastic.partial`), else ``failed`` naming the lost
experts; every wait gets the time left before the scale's one deadline
(:mod:`~eplb_fsm.elastic.bounds`). docs/elastic.md ("Faults") has the cases.

The trace gets ``group_switch`` (a rank's collectives move to another group),
``scale_aborted`` and one ``scaling`` summary per request (docs/events.md).

This module is the serving ranks' flow (:func:`request_scale`). The pieces, below it:
:mod:`~eplb_fsm.elastic.request` (the request, its checks, a broken scale's end),
:mod:`~eplb_fsm.elastic.prepare` (the old group agrees to go on, builds the new one),
:mod:`~eplb_fsm.elastic.scale_plan` (pure: rank mapping, slot columns, resized maps and
windows), :mod:`~eplb_fsm.elastic.handover` (group swap, handover to joiners),
:mod:`~eplb_fsm.elastic.records` (the scale's rearrangement and records) and
:mod:`~eplb_fsm.elastic.joiner` (the joiner's flow, :func:`join`). Everything here uses
the controller's public port only (:mod:`eplb_fsm.elastic.port`).
"""


from __future__ import annotations

import time
from typing import Any, Mapping

import numpy as np

from eplb_fsm.fsm.collectives import flags
from eplb_fsm.fsm.faults import needs_reload
from eplb_fsm.fsm.decide import agreed_ranks, decide_salvage, salvage_vote
from eplb_fsm.elastic.bounds import ScaleDeadline
from eplb_fsm.maps import check_seconds
from eplb_fsm.elastic.joiner import ScaleAborted, join
from eplb_fsm.fsm.machine import COLLECTING, FAILED, SCALING
from eplb_fsm.elastic.handover import (
    join_handshake,
    late_timeout,
    leave,
    project_back,
    reduce_on,
    resize_models,
    set_space,
    use_group,
)
from eplb_fsm.elastic.partial import partial_switch_agreed, switch_partial
from eplb_fsm.elastic.request import ScaleRequest, check_request, describe_lost, give_up, recovering
from eplb_fsm.elastic.scale_plan import (
    ScalePlan,
    default_rank_mapping,
    lost_experts,
    lost_when_remapped,
    make_scale_plan,
    remap_columns,
    resize_window,
    slot_columns,
)
from eplb_fsm.elastic.prepare import prepare
from eplb_fsm.elastic.records import rearrange_for_scale, tag_history

__all__ = [
    "ScalePlan",
    "ScaleAborted",
    "default_rank_mapping",
    "make_scale_plan",
    "slot_columns",
    "remap_columns",
    "resize_window",
    "lost_experts",
    "request_scale",
    "join",
]


def request_scale(ctl: Any, new_world_size: int, rank_mapping: Mapping[int, int] | None = None, *,
                  timeout_s: float | None = None, generation: int | None = None) -> dict:
    """Scale the EP group of a serving controller: every rank of the old group calls it at the same point.

    The contract (``EplbController.request_scale`` runs this): ``new_world_size`` and
    ``generation`` (default: the last used + 1) are ints >= 1 (numpy ints too), the
    generation above every one used; ``rank_mapping`` (see :func:`make_scale_plan`) has
    exactly the old ranks as keys; ``timeout_s`` (default ``collective_timeout_s``) is a
    finite number > 0 of seconds that bounds forming the new group. The group must be a
    ``StoreGroup``, every model must have the same slots per rank, a scale-up needs
    contiguous ``non_expert_weights``. Any broken rule raises ``ValueError`` before
    anything changes (maps, state, trace, generation counter).

    Otherwise it returns this rank's ``scalings`` entry, whose ``outcome`` is ``switched``
    (serving in the new group; ``partial``: its rearrangement stopped part-way), ``left``
    (this rank left; its controller is closed), ``aborted`` (the old group serves on, old
    maps; ``phase`` and ``reason`` say where and why) or ``failed`` (the machine is
    ``failed``; ``lost_experts`` may name what is lost).
    It returns within the scale's ``bound_s`` (:mod:`~eplb_fsm.elastic.bounds`).
    """
    last = max(ctl.generation, ctl.last_generation)
    sp = make_scale_plan(ctl.world_size, new_world_size, rank_mapping, last + 1 if generation is None else generation)
    if sp.generation <= last:
        raise ValueError(f"generation must be > {last} (the last one used), got {generation}")
    timeout = check_seconds(ctl.timeout_s if timeout_s is None else timeout_s, "timeout_s")
    check_request(ctl, sp)
    started = time.perf_counter()
    step = ctl.steps
    ctl.trace.set_context(step=step)
    if ctl.state != COLLECTING:
        ctl.rearranger.drain()  # async: nothing runs in the background across the switch
    ctl.last_generation = sp.generation  # used up even if the request aborts: no store prefix is reused
    deadline = ScaleDeadline(timeout, ctl.timeout_s)
    req = ScaleRequest(sp, timeout, started, step, ctl.rank, sp.new_rank(ctl.rank), deadline)
    if ctl.state == FAILED:
        return req.record(ctl, "member", "failed", reason="failed before the scale began", phase="request")
    ctl.fire("scale_requested", extra={**sp.describe(), "timeout_s": timeout, **deadline.describe()})
    ctl.collectives.cap = deadline.left  # every all-reduce of the scale, the rearrangement's included
    try:
        if sp.kind == "scale_down":
            return _scale_down(ctl, req)
        return _scale_up(ctl, req)
    finally:
        ctl.collectives.cap = None


# ---------------------------------------------------------------------------------------
# scale-down: transfer in the old group, then the survivors switch


# a salvage or rollback from failed would serve the half-written layers of a commit that raised part-way
_RELOAD_FIRST = ("a commit raised part-way (docs/design.md §8): reload the layers it names, then "
                 "recover(reloaded=...)")


def _scale_down(ctl: Any, req: ScaleRequest) -> dict:
    sp = req.sp
    leaving = req.new_rank < 0
    role = "leaving" if leaving else "survivor"
    new_group, new_comm, ended = prepare(ctl, req, role)
    if ended is not None:
        return ended
    S = ctl.models[0].num_local
    # old group space <- plan space (old rank i takes new rank mapping[i]'s slots; leaving: empty)
    to_group = slot_columns([sp.new_rank(i) for i in range(sp.old_world)], S)
    from_group = slot_columns(list(sp.old_of_new), S)  # plan space <- old group space
    history_len = len(ctl.history)
    state = rearrange_for_scale(ctl, sp, sp.new_world, to_group, from_group)
    tag_history(ctl, sp, history_len)
    if state == SCALING:
        if leaving:
            ctl.fire("switched", extra={"generation": sp.generation, "role": "leaving"})
            leave(ctl, sp, "switch")
            out = req.record(ctl, "leaving", "left")
            ctl.close()
            return out
        _switch_down(ctl, req, new_group, new_comm, from_group)
        ctl.fire("switched", extra={"generation": sp.generation, "role": role})
        return req.record(ctl, role, "switched")
    if state == COLLECTING:  # a transfer fault the old group survived: it keeps serving
        reason = f"scale-down aborted: {ctl.history[-1]['reason'] if ctl.history else 'transfer failed'}"
        ctl.trace.emit("scale_aborted", generation=sp.generation, phase="transfer", reason=reason, lost_experts=[])
        if new_group is not None:
            new_group.close()
        return req.record(ctl, role, "aborted", reason=reason, phase="transfer")
    # the old group broke (a rank died): survivors try to finish on the group they built
    if leaving or new_group is None:
        # null, not []: what is lost depends on the layers the survivors committed, which they
        # agree on over the new group without this rank; their records name the lost experts
        ctl.trace.emit("scale_aborted", generation=sp.generation, phase="transfer",
                       reason="the old group broke during the scale-down", lost_experts=None)
        return req.record(ctl, role, "failed", reason="the old group broke during the scale-down",
                          phase="transfer", lost=None)
    return _salvage_down(ctl, req, new_group, new_comm, from_group)


def _switch_down(ctl: Any, req: ScaleRequest, new_group: Any, new_comm: Any, from_group: np.ndarray) -> None:
    """A survivor moves its maps to the new slot space and its collectives to the new group."""
    set_space(ctl, from_group)
    use_group(ctl, new_group, new_comm, req.new_rank, req.sp.new_world, role="survivor", phase="switch", sp=req.sp)
    resize_models(ctl, req.new_rank, req.sp.new_world)
    ctl.restart_interval()


def _salvage_down(ctl: Any, req: ScaleRequest, new_group: Any, new_comm: Any, from_group: np.ndarray) -> dict:
    """The old group broke mid scale-down: finish on the survivors' group if nothing was lost."""
    sp = req.sp
    committed = float(ctl.history[-1]["layers_committed"]) if ctl.history else 0.0
    lost = lost_when_remapped(ctl.models, from_group)
    recovering(ctl, req.deadline)
    try:
        mine = flags(*salvage_vote(committed, bool(lost) or needs_reload(ctl.rearranger)))
        agreed = reduce_on(ctl, new_group, {"salvage": mine}, late_timeout(ctl))["salvage"]
    except Exception as exc:
        reason = f"survivors could not agree on the new group: {exc}"
        ctl.trace.emit("scale_aborted", generation=sp.generation, phase="salvage", reason=reason, lost_experts=lost)
        return req.record(ctl, "survivor", "failed", reason=reason, lost=lost, phase="salvage")
    ranks = agreed_ranks(agreed)
    if not decide_salvage(agreed, ranks):
        reason = ("experts lost with the leaving rank(s): " + describe_lost(lost)) if lost else \
            _RELOAD_FIRST if needs_reload(ctl.rearranger) else "survivors disagree on the committed layers"
        return give_up(ctl, req, "survivor", "salvage", reason, lost)
    reason = "a leaving rank died before the scale-down finished; every expert still has a replica on a survivor"
    ctl.fire("salvaged", extra={"reason": reason, "scale": sp.generation, "generation": sp.generation})
    _switch_down(ctl, req, new_group, new_comm, from_group)
    ctl.fire("switched", extra={"generation": sp.generation, "role": "survivor", "salvage": True})
    return req.record(ctl, "survivor", "switched", reason=reason, degraded=True, phase="salvage")


# ---------------------------------------------------------------------------------------
# scale-up: switch to the new group first, transfer there (joiners included)


def _scale_up(ctl: Any, req: ScaleRequest) -> dict:
    sp = req.sp
    old = ctl.collectives.save()
    new_group, new_comm, ended = prepare(ctl, req, "member")
    if ended is not None:
        return ended
    S = ctl.models[0].num_local
    to_new = slot_columns(list(sp.old_of_new), S)          # new space <- old space
    back = slot_columns([sp.new_rank(i) for i in range(sp.old_world)], S)  # old space <- new space
    use_group(ctl, new_group, new_comm, req.new_rank, sp.new_world, role="member", phase="prepare", sp=sp)
    history_len = len(ctl.history)
    try:
        set_space(ctl, to_new)
    except Exception as exc:  # maps still in the old space: back to the old group with them unchanged
        return _roll_back_up(ctl, req, old, new_group, None, history_len, SCALING, "prepare",
                             f"{type(exc).__name__}: {exc}")
    faulted = join_handshake(ctl, sp)  # None: handed over; else (where its fault led, why)
    phase = "handover" if faulted else "transfer"
    state, cause = faulted or (None, None)
    if state is None:
        full = np.arange(S * sp.new_world, dtype=np.int64)
        state = rearrange_for_scale(ctl, sp, sp.new_world, full, full)
        tag_history(ctl, sp, history_len)
        cause = ctl.history[-1].get("reason") if len(ctl.history) > history_len else None
    if state == SCALING:
        resize_models(ctl, req.new_rank, sp.new_world)
        ctl.restart_interval()
        ctl.fire("switched", extra={"generation": sp.generation, "role": "member"})
        return req.record(ctl, "member", "switched")
    if partial_switch_agreed(ctl, sp, req.deadline, state, phase, history_len):
        reason = switch_partial(ctl, sp, "member", req.new_rank, cause)
        return req.record(ctl, "member", "switched", reason=reason, phase=phase, partial=True)
    return _roll_back_up(ctl, req, old, new_group, back, history_len, state, phase, cause)


def _roll_back_up(ctl: Any, req: ScaleRequest, old: tuple, new_group: Any, back: np.ndarray | None, history_len: int,
                  state: str, phase: str, cause: str | None) -> dict:
    """The scale-up failed in the new group: back onto the old group, maps projected onto the old ranks.

    ``old``: what ``_scale_up`` saved of the collectives before the switch; ``back``: None
    when the maps never left the old space; ``state``: where the handshake's fault or the
    scale's rearrangement left the machine; ``cause``: why, for the record. The maps go back
    to the old slot space before the agreement, whatever it says: maps of the new space
    on the old group would crash the next forward (and a recover()). An expert only a
    joiner held then has a slot whose weights must be reloaded (``handover.project_back``).
    """
    sp = req.sp
    new_group.close()
    ctl.restore_group(old)
    old_world = ctl.world_size
    ctl.trace.emit("group_switch", generation=sp.generation, phase="rollback", role="member", kind=sp.kind,
                   old_group=new_group.trace_name, new_group=ctl.group_name, transfer_group=ctl.transfer_group_name,
                   old_rank=req.new_rank, new_rank=req.old_rank, old_world=sp.new_world, new_world=old_world)
    committed = float(ctl.history[-1]["layers_committed"]) if len(ctl.history) > history_len else 0.0
    lost = project_back(ctl, back) if back is not None else []
    recovering(ctl, req.deadline)
    try:
        mine = flags(*salvage_vote(committed, bool(lost) or needs_reload(ctl.rearranger), count=False))
        agreed = ctl.collectives.all_reduce({"rollback": mine}, late_timeout(ctl))["rollback"]
    except Exception as exc:
        ctl.rearranger.group_fault(exc)
        return req.record(ctl, "member", "failed", reason=f"rollback agreement failed after the {phase} phase: {exc}",
                          lost=lost, phase="rollback")
    if not decide_salvage(agreed, old_world):
        reason = ("experts lost moving back to the old group: " + describe_lost(lost) + "; the maps give each "
                  "a slot whose weights must be reloaded before recover()") if lost else \
            _RELOAD_FIRST if needs_reload(ctl.rearranger) else "old ranks disagree on the committed layers"
        return give_up(ctl, req, "member", "rollback", reason, lost)
    reason = "scale-up aborted in the new group; the old group keeps serving" + (f" ({cause})" if cause else "")
    if state == FAILED:
        ctl.fire("recovered", extra={"reason": reason, "scale": sp.generation})
    elif state != COLLECTING:
        ctl.fire("fault", extra={"reason": reason, "scale": sp.generation}, recoverable=True)
    ctl.trace.emit("scale_aborted", generation=sp.generation, phase=phase, reason=reason, lost_experts=[])
    return req.record(ctl, "member", "aborted", reason=reason, phase=phase)
