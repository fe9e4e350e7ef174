"""Elastic EP: the prepare phase of a scale on the serving ranks (the old group), before any switch.

Every old rank, in order (:func:`prepare`):

1. scale-up: rank 0 publishes the handover; every rank waits for each joiner's answer
   (``handover.await_joiners``: all accepted, a refusal, or none within ``timeout_s``);
2. ``scale_check``: one all-reduce of whether it has the go-ahead (every joiner accepted),
   a digest of the request (new world size, rank mapping, generation) and one of every
   model's maps. Unless every rank has it and the requests and maps agree, every rank ends
   the scale ``aborted`` here: nothing built, nothing moved;
3. each rank that stays builds its part of the new group and its transfer communicator;
4. ``scale_ready``: one all-reduce of whether each built; any failure aborts on every rank.

The waits of 1-3 end :attr:`~eplb_fsm.elastic.bounds.ScaleDeadline.ready_room_s` before the
forward deadline, so ``scale_ready`` always has the time to reach every old rank, and the
old group is never broken by a peer still building. Uses the controller's public port only
(:mod:`eplb_fsm.elastic.port`).
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import torch

from eplb_fsm.elastic.handover import await_joiners, handover_state, read_refusals
from eplb_fsm.elastic.request import ScaleRequest
from eplb_fsm.elastic.scale_plan import ScalePlan
from eplb_fsm.fsm.collectives import flags
from eplb_fsm.fsm.recovery import different_maps, differing, digest_flags, map_items

__all__ = ["prepare"]


def prepare(ctl: Any, req: ScaleRequest, role: str) -> tuple[Any, Any, dict | None]:
    """In the old group: agree to go on (:func:`_check`), build this rank's part of the new group,
    then all old ranks agree on it (``scale_ready``).

    On a scale-up rank 0 first publishes the handover the joiners start from, and every
    old rank waits for the joiners' answers; a leaving rank builds nothing. The waits
    before ``scale_ready`` end :attr:`~eplb_fsm.elastic.bounds.ScaleDeadline.ready_room_s`
    before the forward deadline, so that agreement always has its time: it ends the scale
    ``aborted`` on the old group, never with the old group broken by a peer still building.
    Returns ``(new_group, its transfer communicator, None)`` to go on, or
    ``(None, None, this rank's scaling entry)`` when the scale ends here.
    """
    sp = req.sp
    new_group = new_comm = error = None
    try:
        if sp.kind == "scale_up":
            if req.old_rank == 0:
                ctl.group.store.set(ctl.group.key("handover", sp.generation), pickle.dumps(handover_state(ctl, sp)))
            # a refusal ends the scale here: the gloo build below cannot be interrupted
            error = await_joiners(ctl, sp, req.deadline.before_ready(req.timeout))
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    ended = _check(ctl, req, role, error)
    if ended is not None:
        return None, None, ended
    try:
        if req.new_rank >= 0:
            new_group = ctl.group.successor(sp.generation, req.new_rank, sp.new_world,
                                            req.deadline.before_ready(req.timeout))
            new_comm = new_group.transfer_communicator(ctl.timeout_s, req.deadline.before_ready(req.timeout))
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        new_group = None
    try:
        agreed = ctl.collectives.all_reduce({"scale_ready": flags(1.0 if error else 0.0)}, 2 * req.timeout + 5.0)
    except Exception as exc:
        ctl.rearranger.group_fault(exc)
        return None, None, req.record(ctl, role, "failed", reason=str(exc), phase="prepare")
    failed = int(round(float(agreed["scale_ready"][0])))
    if not failed:
        return new_group, new_comm, None
    if new_group is not None:
        new_group.close()
    reason = (f"new group of generation {sp.generation} ({sp.new_world} ranks) was not complete on "
              f"{failed} rank(s)" + (f": {error}" if error else ""))
    return None, None, _abort_prepare(ctl, req, reason)


def _check(ctl: Any, req: ScaleRequest, role: str, error: str | None) -> dict | None:
    """``scale_check``, one SUM all-reduce on the old group before anything is built: each rank's
    ``[1 if it has no go-ahead (``error``: a joiner refused or did not answer in time), digest of the
    request (16 per :func:`_request_items` entry), digest of every model's maps (16 per model)]``, the
    digests as ``fsm.recovery.digest_flags``. Every rank builds the new group, or none does (ranks that
    disagree on the answers would otherwise build alone and wait out the forward deadline); ranks that
    asked for different scales move nothing (they would build different groups, or switch disagreeing
    on who left); ranks whose maps differ move nothing either: a plan over maps a rank does not share
    writes the wrong expert's weights. Returns None to go on, else this rank's scaling entry
    (``aborted`` on the old group; ``failed`` if the agreement itself failed)."""
    sp = req.sp
    asked = _request_items(sp)
    items = map_items(ctl.models)
    asked_flags = digest_flags(asked)
    mine = torch.cat([flags(1.0 if error else 0.0), asked_flags, digest_flags(items)])
    try:
        summed = ctl.collectives.all_reduce({"scale_check": mine},
                                            req.deadline.before_ready(2 * ctl.timeout_s + 5.0))["scale_check"]
    except Exception as exc:
        ctl.rearranger.group_fault(exc)
        return req.record(ctl, role, "failed", reason=str(exc), phase="prepare")
    missing = int(round(float(summed[0])))
    cut = 1 + asked_flags.numel()
    request_differs = differing(asked, summed[1:cut].tolist(), ctl.world_size)
    differ = differing(items, summed[cut:].tolist(), ctl.world_size)
    if not missing and not differ and not request_differs:
        return None
    reasons = [_different_requests(sp, request_differs)] if request_differs else []
    reasons += [different_maps(differ)] if differ else []
    if missing:
        # the wording of a group that did not form: to the engine, that is what a missing answer means
        reasons.append(f"new group of generation {sp.generation} ({sp.new_world} ranks) was not complete on "
                       f"{missing} rank(s)" + (f": {error}" if error else ""))
    return _abort_prepare(ctl, req, "; ".join(reasons))


def _request_items(sp: ScalePlan) -> list[tuple[str, np.ndarray]]:
    """(name, array) of what every old rank must have asked alike; the kind follows from the sizes, and the
    old world size is the group's own. ``rank_mapping``: (old_world,) new rank (or -1) of each old rank."""
    return [("new_world_size", np.array([sp.new_world], dtype=np.int64)),
            ("rank_mapping", np.array([sp.new_rank(r) for r in range(sp.old_world)], dtype=np.int64)),
            ("generation", np.array([sp.generation], dtype=np.int64))]


def _different_requests(sp: ScalePlan, differ: list[str]) -> str:
    """Why ranks that asked for different scales (``differ``: the fields that differ) must not go on."""
    return (f"ranks disagree on the scale request (new_world_size / rank_mapping / generation): "
            f"{' and '.join(differ)} differ{'s' if len(differ) == 1 else ''}; this rank asked "
            f"new_world_size={sp.new_world}, rank_mapping={sp.rank_mapping}, generation={sp.generation} "
            "(every old rank must call "
            "request_scale with the same arguments)")


def _abort_prepare(ctl: Any, req: ScaleRequest, reason: str) -> dict:
    """Every old rank agreed to stop in prepare: nothing moved, the old group serves on."""
    sp = req.sp
    if sp.kind == "scale_up":  # a refusal this rank did not see itself (it timed out first) still says why
        reason = "; ".join([reason, *[r for r in read_refusals(ctl, sp) if r not in reason]])
    ctl.trace.emit("scale_aborted", generation=sp.generation, phase="prepare", reason=reason, lost_experts=[])
    ctl.fire("fault", extra={"reason": reason, "scale": sp.generation}, recoverable=True)
    return req.record(ctl, "member", "aborted", reason=reason, phase="prepare")
