"""A clean slate for the transfers: after a failed transfer, and when the engine recovers a failed machine.

A transfer that fails part-way can leave messages a peer already posted queued in the
transfer group, and gloo closes the pairs of a wait that timed out. Reusing that group
would hand those old rows to the next rearrangement as if they were its own, or fail it.
Both paths here therefore wait (bounded) for the background worker, drop the buffers'
rows, and build a fresh transfer group, a collective every rank joins at the same point.

- :func:`reset_transfers`: right after a recoverable transfer fault, inside the step that
  found it; the ranks first agree in one all-reduce that every worker has drained.
- :func:`recover`: ``EplbController.recover()``, which the engine calls on every rank once
  it has repaired the EP group (a broken group may have interrupted a transfer too). The
  ranks first agree in one all-reduce that every worker has drained and that every rank
  holds the same committed maps: a rank that acted on a collective its peers gave up on
  must not serve on with another placement.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from eplb_fsm.fsm.collectives import GroupBroken, flags
from eplb_fsm.fsm.decide import counts_equal
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

    Raises ``RuntimeError`` and leaves the machine in ``failed`` when a model's maps do not
    fit the group (slots per rank x ranks), a worker is still running a job (on any rank),
    the ranks hold different committed maps (:func:`_agree`) or the transfer group cannot be
    built (the EP group is not repaired yet).
    """
    _check_slots(r)
    _agree(r, _drain(r))   # every rank refuses, or every rank builds: a lone build skews the groups' names
    try:
        r.collectives.new_transfer_group()
    except Exception as exc:
        raise RuntimeError(f"recover(): could not re-create the transfer group ({type(exc).__name__}: {exc}); "
                           "the machine stays failed") from exc
    r.trace.emit("transfer_group_reset", group=r.collectives.transfer_group_name)
    r.fire("recovered")
    r.counters.restart(r.config.step_interval)


def _check_slots(r: Any) -> None:
    """Maps with another slot count than the group's (say, an elastic scale that failed half-way) would
    crash the next forward, or route to slots no rank has: refuse before anything changes."""
    world = r.collectives.world_size
    wrong = [f"{e.name!r} has {e.num_physical} slots, the group {e.num_local} x {world} = {e.num_local * world}"
             for e in r.models if e.num_physical != e.num_local * world]
    if wrong:
        raise RuntimeError(f"recover(): maps do not fit the EP group of {world} rank(s) ({'; '.join(wrong)}); "
                           "the machine stays failed")


def _drain(r: Any) -> bool:
    """Wait (bounded) for the worker's jobs, then drop the buffers' rows; a busy worker is traced
    (``worker_stuck``). True when it finished."""
    drained = r.worker is None or r.worker.wait_idle(r.timeout_s + 5.0)
    if not drained:
        r.trace.emit("worker_stuck", pending=r.worker.pending)
    r.mover.invalidate_buffers()
    return drained


# a digest goes in 8-bit pieces: G * sum(d^2) and (sum d)^2 stay exact in float64 up to G ~ 370,000
_PIECES = 8


def _agree(r: Any, drained: bool) -> None:
    """One SUM all-reduce of whether this rank's worker drained and of digests of what it committed
    (each model's maps, the rearrangements begun); ``RuntimeError`` on every rank naming what is wrong.

    Ranks hold equal digests iff G * sum(d^2) == (sum d)^2 for every piece d (Cauchy-Schwarz).
    """
    names, pieces = _digests(r)
    if r.collectives.group is None:
        summed, world = [0.0 if drained else 1.0, *pieces, *(d * d for d in pieces)], 1
    else:
        local = flags(0.0 if drained else 1.0, *pieces, *(d * d for d in pieces))
        try:
            # a peer may still be waiting out its worker's drain before it gets here
            summed = r.collectives.all_reduce({"recover": local}, 2 * r.timeout_s + 10.0)["recover"].tolist()
        except GroupBroken as exc:
            raise RuntimeError(f"recover(): the ranks could not agree ({exc}); the machine stays failed") from exc
        world = r.collectives.world_size
    n = len(pieces)
    sums, squares = summed[1:1 + n], summed[1 + n:]
    differ = [name for i, name in enumerate(names)
              if not all(counts_equal(sums[k], squares[k], world) for k in range(i * _PIECES, (i + 1) * _PIECES))]
    problems = []
    stuck = int(round(summed[0]))
    if stuck:
        problems.append(f"the background worker has not finished its job on {stuck} rank(s)")
    if differ:
        problems.append(f"the ranks disagree on {', '.join(differ)} (a rank committed what its peers did not; "
                        "restart the ranks from one placement)")
    if problems:
        raise RuntimeError(f"recover(): {'; '.join(problems)}; the machine stays failed")


def _digests(r: Any) -> tuple[list[str], list[float]]:
    """What :func:`_agree` compares: names, and ``_PIECES`` 8-bit pieces of a 64-bit digest per name."""
    items = [(f"the committed maps of model {e.name!r}", np.ascontiguousarray(e.maps.phy2log, dtype=np.int64))
             for e in r.models]
    items.append(("the number of rearrangements begun", np.array([r.reporter.count], dtype=np.int64)))
    names, pieces = [], []
    for name, array in items:
        digest = hashlib.blake2b(repr(array.shape).encode() + array.tobytes(), digest_size=_PIECES).digest()
        names.append(name)
        pieces.extend(float(b) for b in digest)
    return names, pieces
