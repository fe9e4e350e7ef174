"""Elastic EP: a scale-up whose rearrangement stopped part-way still switches when nothing is lost.

A scale-up rearranges in the NEW group. A recoverable fault there (a transfer that failed
once, a policy error) ends that rearrangement in ``collecting`` with the new group intact:
the layers committed so far hold the new layout, joiners' slots included, the others the
old ranks' placement re-indexed to the new slots (joiners' slots empty). Going back would
project the committed layers onto the old ranks, dropping any expert that only a joiner
holds there, while switching loses nothing: every expert has a slot in the placement as
it stands, and the weights match it. So every rank of the new group (joiners too) agrees
in one all-reduce, and when all are in ``collecting`` with the same layers committed and
every expert placed, they switch with that placement: ``resumed`` (collecting -> scaling)
then ``switched`` (``partial: true``); later rearrangements balance the rest.
Anything else (a broken group, a failed handshake, a rank that disagrees) goes back.
"""

from __future__ import annotations

from typing import Any

from eplb_fsm.elastic.bounds import ScaleDeadline
from eplb_fsm.elastic.handover import late_timeout, resize_models
from eplb_fsm.elastic.request import recovering
from eplb_fsm.elastic.scale_plan import ScalePlan, lost_experts
from eplb_fsm.fsm.collectives import flags
from eplb_fsm.fsm.decide import agreed_ranks, decide_salvage, salvage_vote
from eplb_fsm.fsm.machine import COLLECTING

__all__ = ["partial_switch_agreed", "switch_partial"]


def partial_switch_agreed(ctl: Any, sp: ScalePlan, deadline: ScaleDeadline, state: str, phase: str,
                          history_len: int) -> bool:
    """Whether every rank of the new group agreed to switch with the placement as it stands.

    ``state``/``phase``: where the scale's handshake or rearrangement left this rank;
    ``history_len``: ``len(ctl.history)`` before that rearrangement. Only a rearrangement
    that ended in ``collecting`` takes part: a failed handshake leaves joiners without the
    non-expert weights, and a broken group (``failed``) cannot agree on anything.
    """
    if phase != "transfer" or state != COLLECTING:
        return False
    committed = float(ctl.history[-1]["layers_committed"]) if len(ctl.history) > history_len else 0.0
    lost = any(lost_experts(entry.maps.phy2log, entry.num_logical) for entry in ctl.models)
    recovering(ctl, deadline)  # after a fault: a peer may still be waiting out a transfer
    try:
        mine = flags(*salvage_vote(committed, lost))
        agreed = ctl.collectives.all_reduce({"partial": mine}, late_timeout(ctl))["partial"]
    except Exception:  # the new group broke after all: the caller goes back to the old one
        return False
    return decide_salvage(agreed, sp.new_world) and agreed_ranks(agreed) == sp.new_world


def switch_partial(ctl: Any, sp: ScalePlan, role: str, rank: int, cause: str | None) -> str:
    """Finish the switch the rearrangement did not reach (collecting -> scaling -> collecting); returns why.

    The machine left ``scaling`` at the fault; ``resumed`` says what happened since (every
    rank of the new group agreed to switch as things stand), and they all take it together.
    """
    reason = ("scale-up switched with its rearrangement cut short: the layers it did not commit keep the old "
              "ranks' placement until a later rearrangement" + (f" ({cause})" if cause else ""))
    ctl.fire("resumed", extra={"reason": reason, "scale": sp.generation, "generation": sp.generation})
    resize_models(ctl, rank, sp.new_world)
    ctl.restart_interval()
    ctl.fire("switched", extra={"generation": sp.generation, "role": role, "partial": True})
    return reason
