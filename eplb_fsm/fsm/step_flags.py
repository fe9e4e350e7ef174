"""``EplbController.step()`` away from its hot path: the check of its flags, the profile step, and a step
that may all-reduce (:func:`decided_step`).

``step()`` tests each flag by identity against ``True`` and ``False`` (a few pointer compares on a
collecting step, which is benchmarked); any other object, a numpy ``bool_`` or a profile step comes
here. A flag is only ever a bool: a truthy stand-in (``"False"``, ``"no"``, ``1``) would be read by
its truth value, so ranks whose engines meant the same thing could take different paths on the same
step (a profile step on one rank only, a pass left out of one rank's window) and the EP group would
fall out of step without a word.

A step that may all-reduce runs, from the due step's ``step`` transition until the plan or the progress
it leads to, inside :func:`~eplb_fsm.fsm.faults.interruptible`: an interrupt or error between the
transition and the pieces of the rearrangement that guard themselves (while its record opens, while
the step's balancedness is logged) sends the machine to ``failed`` rather than leave it in
``planning`` with nothing in flight, where no later step would ask anything and every call that
could leave refuses.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from eplb_fsm.fsm import faults
from eplb_fsm.fsm.decide import decide_step
from eplb_fsm.fsm.machine import COLLECTING

__all__ = ["STEP_FLAGS", "check_step_flags", "profile_step", "decided_step"]

STEP_FLAGS = ("is_dummy", "is_profile", "log_stats")


def check_step_flags(is_dummy: Any, is_profile: Any, log_stats: Any) -> tuple[bool, bool, bool]:
    """The three flags as Python bools; ``ValueError`` naming the first that is neither a bool nor a
    numpy ``bool_`` (called before the step changes any counter)."""
    values = (is_dummy, is_profile, log_stats)
    for name, value in zip(STEP_FLAGS, values):
        if not isinstance(value, (bool, np.bool_)):
            raise ValueError(f"step(): {name} must be a bool (True or False; a numpy bool_ passes), "
                             f"got {type(value).__name__} {value!r:.80}")
    return bool(is_dummy), bool(is_profile), bool(log_stats)


def profile_step(ctl: Any) -> str:
    """``step(is_profile=True)`` on controller ``ctl``: reserve the transfer buffers and change no state or
    counter; refused (``ValueError``) outside ``collecting`` or with a rearrangement open, whose async
    worker may be using those buffers. Returns the state."""
    if ctl.machine.state != COLLECTING or ctl.rearranger.current is not None:
        raise ValueError(f"is_profile needs state collecting and no rearrangement; state is {ctl.machine.state!r}")
    ctl.trace.emit("profile", buffer_bytes=ctl.mover.reserve(spare=ctl.rearranger.layer_jobs.prefetch))
    return ctl.machine.state


def decided_step(ctl: Any, step: int, state: str, is_dummy: bool, log_now: bool) -> str:
    """A step of controller ``ctl`` that may all-reduce (``step``: its index, ``state``: the machine's at its
    start): :func:`~eplb_fsm.fsm.decide.decide_step`'s answer, then :meth:`Rearranger.poll`'s. Returns the state.

    The all-reduce carries ``balancedness`` (every model's ``load_pass`` flattened, sum_m L_m * P_m) on a
    logging step, ``loads`` and ``maps`` on a due step, ``ready`` (4,) when the async job in flight is asked.
    """
    counters = ctl.counters
    rearranger = ctl.rearranger
    decision = decide_step(state, counters.since, counters.threshold, bool(ctl.models), log_now)
    parts: dict[str, torch.Tensor] = {}
    if decision.log:
        parts["balancedness"] = torch.cat([e.window.load_pass.reshape(-1) for e in ctl.models]) \
            if ctl.models else torch.zeros(0)
    for entry in ctl.models:
        entry.window.record_pass(is_dummy)
    if decision.due:
        parts.update(rearranger.planning_parts())  # first: an error here leaves the machine collecting
        ctl.restart_interval()
    else:
        ctl.trace.count_step(is_dummy)
    # from the due step's transition to plan() / progress(): whatever escapes (a Ctrl-C while the record
    # opens or the balancedness is logged) sends a rearrangement in flight to failed, never leaves it there
    with faults.interruptible(rearranger, "the due step" if decision.due else "the step"):
        if decision.due:
            ctl.fire("step", extra={"dummy": True} if is_dummy else None, due=True)
            rearranger.begin(step, forced=False)
        # after this step's pass is in the window, so a commit re-expresses it in the new placement
        rearranger.poll(parts, ctl.config.async_overlap_poll)
        reduced = rearranger.all_reduce_or_fail(parts, ctl.timeout_s) if parts else None
        if reduced is not None and "balancedness" in reduced:
            ctl.reporter.log_pass_balancedness(step, reduced["balancedness"], ctl.models, ctl.world_size)
        if reduced is not None and "loads" in reduced:
            rearranger.plan(reduced)
        elif reduced is not None and "ready" in reduced:
            rearranger.progress(reduced["ready"])
    return ctl.machine.state
