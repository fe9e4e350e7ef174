"""Async mode's steps of a rearrangement: the ready flags each step asks with, and what their sum does.

The functions take the :class:`~eplb_fsm.fsm.rearrange.Rearranger` (``r``) and are its methods
of the same names. A step's :func:`poll` first reads the flags posted on the step before
(:func:`settle`), then posts its own or joins them to the step's all-reduce
(:func:`~eplb_fsm.fsm.decide.decide_poll`). :func:`progress` acts on a sum
(:func:`~eplb_fsm.fsm.decide.decide_progress`): take the plan, commit the layer and hand the
next changed one to the worker (:func:`advance`), abort, or, in ``committing``, close the
rearrangement: the flags read there are the agreement that every rank wrote every layer whole
(a write that raised part-way says ``broken``, and every rank faults on the same step).
:func:`drain` runs those agreements back to back (elastic EP, before a switch).
"""

from __future__ import annotations

from typing import Any

import torch

from eplb_fsm.fsm import faults
from eplb_fsm.fsm.collectives import GroupBroken, flags
from eplb_fsm.fsm.decide import ABORT, JOIN, POST, TAKE_PLAN, WAIT, decide_poll, decide_progress
from eplb_fsm.fsm.machine import COMMITTING, PLANNING, TRANSFERRING
from eplb_fsm.fsm.reporting import Rearrangement
from eplb_fsm.fsm.transfers import ready_flags as job_flags
from eplb_fsm.fsm.pacing import unpaced

__all__ = ["ready_flags", "poll", "in_flight", "post_poll", "settle", "progress", "advance", "drain"]


def ready_flags(r: Any) -> torch.Tensor:
    """This rank's (4,) [ready, failed, late, broken] for the async job in flight (``committing``: ready)."""
    current = r.current
    broken = current is not None and bool(current.broken)
    if r.machine.state == COMMITTING:   # every layer is written here: the last agreement
        return flags(1.0, 0.0, 0.0, 1.0 if broken else 0.0)
    return job_flags(current.job if current is not None else None, r.timeout_s, broken)


def poll(r: Any, parts: dict, overlap: bool) -> None:
    """A step's ask of the async job in flight (:func:`decide_poll`), after reading last step's posted flags.

    Posts this rank's flags (read on the next step), or adds them to ``parts`` as
    ``ready`` for the step's own all-reduce, or does nothing (no job in flight).
    """
    with faults.interruptible(r, "the async rearrangement's poll"):
        r.settle()
        current = r.current
        steps = r.counters.steps
        if current is not None and current.job is not None and current.chunks > 1 and steps == current.ready_step:
            # a paced layer's last chunk can only have started now: its timeout counts from here
            current.job.waited_from = current.job.clock()
        poll = decide_poll(r.machine.state, r.worker is not None and in_flight(r), overlap, bool(parts),
                           # one handed over on this step can't be ready yet, unless its ready step says it
                           # may be (a one-chunk job submitted ahead, async_prefetch)
                           fresh=current is not None and current.job_step == steps != current.ready_step,
                           early=current is not None and steps < current.ready_step)
        if poll == POST:
            r.post_poll()
        elif poll == JOIN:
            parts["ready"] = r.ready_flags()


def in_flight(r: Any) -> bool:
    """Whether rearranger ``r`` has something to ask the ranks about: a plan or layer job handed over
    (``job_step`` set, on the same step on every rank), or, in ``committing``, the last agreement.
    Not on the due step: its planning all-reduce comes before the plan job exists."""
    current = r.current
    return current is not None and (current.job_step >= 0 or r.machine.state == COMMITTING)


def post_poll(r: Any) -> None:
    """Post this rank's ready flags (read by :func:`settle` on the next step)."""
    try:
        r.posted = r.collectives.post({"ready": r.ready_flags()}, r.timeout_s)
    except GroupBroken as exc:
        r.group_fault(exc)


def settle(r: Any, act: bool = True) -> None:
    """Read the ready flags posted on the step before and act on their sum (:func:`progress`).

    ``act=False`` (at close): only finish the collective and its trace record; a broken
    group is then no news worth a fault.
    """
    posted, r.posted = r.posted, None
    if posted is None:
        return
    try:
        summed = posted.wait()["ready"]
    except GroupBroken as exc:
        if act:
            r.group_fault(exc)
        return
    if act:
        r.progress(summed)


def progress(r: Any, summed: torch.Tensor, early: bool | None = None) -> None:
    """Async mode: act on the all-reduced ready flags (:func:`decide_progress`).

    ``early`` (None: from the shared step count, as :func:`poll` has it): the job's flags
    were taken before its ready step.
    """
    current, state = r.current, r.machine.state
    if current is None or state not in faults.LIVE:   # read after an interrupt ended it here: nothing to do
        return
    with faults.interruptible(r, f"the async rearrangement ({state})"):
        _progress(r, current, state, summed, early)


def _progress(r: Any, current: Rearrangement, state: str, summed: torch.Tensor, early: bool | None) -> None:
    if early is None:
        early = r.counters.steps < current.ready_step
    verdict = decide_progress(summed, r.collectives.world_size, state, early)
    if verdict.action == WAIT:
        return
    if verdict.action == ABORT and verdict.broken:
        r.commit_fault(verdict.broken)
        return
    if verdict.action == ABORT:  # the job stays noted in current: abort records one still running
        job = current.job
        error = job.error() if job is not None else None
        what = "policy" if state == PLANNING else f"transfer of layer {r.machine.layer}"
        reason = (f"{what} failed on {verdict.failed} rank(s)" if verdict.failed else
                  f"{what} ran past collective_timeout_s={r.timeout_s} on {verdict.late} rank(s)")
        if state == PLANNING:
            r.abort(reason + (f": {type(error).__name__}: {error}" if error else ""), recoverable=True)
        else:
            r.transfer_fault(r.machine.layer, error, verdict.failed, late=verdict.late)
        return
    if state == COMMITTING:   # every rank wrote every layer whole
        r.committed()
        return
    job, current.job = current.job, None
    if job is None:   # unreachable: without a job this rank's flags said failed
        r.abort(f"no {state} job to take although every rank said ready", recoverable=False)
        return
    if verdict.action == TAKE_PLAN:
        if r.accept(job.result(timeout=0)) == TRANSFERRING:
            r.advance(TRANSFERRING)
        return
    job.wait_stream()
    r.advance(r.commit_layer(r.machine.layer, job.result(timeout=0)).dest)


def advance(r: Any, state: str) -> None:
    """From ``state``: commit unchanged layers at once, start the next changed layer, or finish."""
    plan = r.current.plan
    while state == TRANSFERRING:
        layer = r.machine.layer
        if plan.changed[layer]:
            current = r.current
            current.job, ahead = r.layer_jobs.start(plan, layer, r.counters.steps)
            current.job_step, current.chunks = r.counters.steps, plan.chunks[layer]
            # chunk i starts once step job_step + i - 1 has begun (StepPacer; in practice as
            # it returns), so flags taken before step job_step + chunks can't say ready. A job
            # submitted ahead started once the job before it ended, which the ranks agreed on by
            # now: its chunks run no later than a fresh job's, and its lateness counts from the
            # same step. Unchunked, it may be done already: its flags may go out at once.
            current.ready_step = current.job_step + (0 if ahead and current.chunks == 1 else current.chunks)
            return
        state = r.commit_layer(layer, None).dest
    if state == COMMITTING:   # the rearrangement closes on the next flags, once every rank says it wrote all
        current = r.current
        current.job, current.job_step, current.chunks, current.ready_step = None, -1, 1, -1


def drain(r: Any) -> None:
    """Async mode: finish (or roll back) the rearrangement in flight, a step's agreement at a time."""
    with faults.interruptible(r, "the drain of the async rearrangement"):
        _drain(r)


def _drain(r: Any) -> None:
    # no engine step comes while the engine thread waits here: paced chunks go at once
    with unpaced(r.mover.closing, r.mover.step_advanced):
        _drain_unpaced(r)


def _drain_unpaced(r: Any) -> None:
    r.settle()
    while r.current is not None and r.machine.state in (PLANNING, TRANSFERRING, COMMITTING):
        job = r.current.job
        if job is not None and not job.done():
            try:
                job.future.exception(timeout=r.timeout_s + 1.0)
            except Exception:  # still running after the timeout: its flags say "late"
                pass
        reduced = r.all_reduce_or_fail({"ready": r.ready_flags()}, 2 * r.timeout_s)
        if reduced is None:
            return
        r.trace.emit("scale_drain", state=r.machine.state, layer=r.machine.layer)
        r.progress(reduced["ready"], early=False)   # no engine step paces it now: late is late
