"""A clean slate for the transfers: after a failed transfer, and when the engine recovers a failed machine.

A transfer that fails part-way can leave messages a peer already posted queued in the
transfer group, and gloo closes the pairs of a wait that timed out. Reusing that group
would hand those old rows to the next rearrangement as if they were its own, or fail it.
Both paths here therefore wait (bounded) for the background worker, drop the buffers'
rows, and build a fresh transfer group, a collective every rank joins at the same point.

- :func:`reset_transfers`: right after a recoverable transfer fault, inside the step that
  found it; the ranks first agree in one all-reduce that every worker has drained.
- :func:`recover`: ``EplbController.recover()``, which the engine calls on every rank once
  it has repaired the EP group (a broken group may have interrupted a transfer too).
"""

from __future__ import annotations

from typing import Any

from eplb_fsm.fsm.collectives import flags
from eplb_fsm.fsm.machine import FAILED

__all__ = ["recover", "reset_transfers"]


def reset_transfers(r: Any) -> str | None:
    """Drain the worker and re-create the transfer group of rearranger ``r`` after a transfer fault.

    The ranks first agree, in one all-reduce, that every worker has drained: then they
    all create the new group together, or all go to ``failed``. Returns the destination
    when that took another ``fault``, else None.
    """
    drained = _drain(r)
    if r.collectives.group is None:
        if drained:
            return None
        return r.fire("fault", extra={"reason": "background worker did not finish its job"}, recoverable=False).dest
    # a peer may still be waiting out its transfer timeout before it gets here
    reduced = r.all_reduce_or_fail({"reset": flags(0.0 if drained else 1.0)}, 2 * r.timeout_s + 10.0)
    if reduced is None:
        return FAILED
    stuck = int(reduced["reset"][0])
    if stuck:
        return r.fire("fault", extra={"reason": f"background worker did not finish its job on {stuck} rank(s)"},
                      recoverable=False).dest
    try:
        r.collectives.new_transfer_group()
    except Exception as exc:
        return r.fire("fault", extra={"reason": f"could not re-create the transfer group: {exc}"},
                      recoverable=False).dest
    r.trace.emit("transfer_group_reset", group=r.collectives.transfer_group_name)
    return None


def recover(r: Any) -> None:
    """Leave ``failed`` on rearranger ``r``: the worker drained, the buffers' rows dropped, a fresh
    transfer group, then ``recovered`` and a new interval.

    Raises ``RuntimeError`` and leaves the machine in ``failed`` when the worker is still
    running a job or the transfer group cannot be built (the EP group is not repaired yet).
    """
    if not _drain(r):
        raise RuntimeError("recover(): the background worker has not finished its job; the machine stays failed")
    try:
        r.collectives.new_transfer_group()
    except Exception as exc:
        raise RuntimeError(f"recover(): could not re-create the transfer group ({type(exc).__name__}: {exc}); "
                           "the machine stays failed") from exc
    r.trace.emit("transfer_group_reset", group=r.collectives.transfer_group_name)
    r.fire("recovered")
    r.counters.restart(r.config.step_interval)


def _drain(r: Any) -> bool:
    """Wait (bounded) for the worker's jobs, then drop the buffers' rows; a busy worker is traced
    (``worker_stuck``). True when it finished."""
    drained = r.worker is None or r.worker.wait_idle(r.timeout_s + 5.0)
    if not drained:
        r.trace.emit("worker_stuck", pending=r.worker.pending)
    r.mover.invalidate_buffers()
    return drained
