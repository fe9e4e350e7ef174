"""A clean slate for the transfers: after a failed transfer, and when the engine recovers a failed machine.

A transfer that fails part-way can leave messages a peer already posted queued in the
transfer group, and gloo closes the pairs of a wait that timed out. Reusing that group
would hand those old rows to the next rearrangement as if they were its own, or fail it.
Both paths here therefore wait (bounded) for the background worker (its paced chunks then
go without waiting for engine steps), drop the buffers' rows, and build a fresh transfer
group, a collective every rank joins at the same point.

- :func:`reset_transfers`: right after a recoverable transfer fault, inside the step that
  found it; the ranks first agree in one all-reduce that every worker has drained.
- :func:`recover`: ``EplbController.recover()``, which the engine calls on every rank once
  it has repaired the EP group (a broken group may have interrupted a transfer too). The
  ranks first agree in one all-reduce that every worker has drained and that every rank
  holds the same committed maps: a rank that acted on a collective its peers gave up on
  must not serve on with another placement. After a commit that raised part-way it first
  needs the engine's word that the layers it named were reloaded (``reloaded``), and it
  can adopt a group the engine rebuilt (``group``: a torch gloo group whose all-reduce
  timed out cannot be used again).

:func:`map_items`, :func:`digest_flags` and :func:`differing` compare every model's maps
across ranks in one SUM all-reduce; the planning all-reduce carries them too, and so does an
elastic scale's ``scale_check`` agreement (:func:`different_maps` is the reason both give).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch

from eplb_fsm.fsm.collectives import GroupBroken, flags, resolve_group
from eplb_fsm.fsm.decide import counts_equal
from eplb_fsm.fsm.machine import FAILED
from eplb_fsm.fsm.pacing import unpaced

__all__ = ["recover", "reset_transfers", "map_items", "digest_flags", "differing", "different_maps"]


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


def recover(r: Any, reloaded: Any = False, group: Any = None) -> None:
    """Leave ``failed`` on rearranger ``r``: the worker drained, the buffers' rows dropped, a fresh
    transfer group, then ``recovered`` and a new interval.

    ``reloaded``: False, True, or the (model name, layer) pairs whose expert weights the engine
    reloaded on this rank. After a commit that raised part-way (the fault says so on every rank)
    it must be given on every rank, and on a rank whose write raised it must cover the layers
    that rank named (``commit_failed`` records); the weights are reloaded for the maps the
    controller holds (``maps(name)``, the new row). ``group``: a group the engine rebuilt, with
    this rank's number and the same size, adopted before the agreement (trace name ``ep.<n>``).

    Raises ``ValueError`` (bad ``reloaded`` or ``group``) or ``RuntimeError`` (layers not
    confirmed as reloaded) before any collective, and ``RuntimeError`` when a model's maps do
    not fit the group (slots per rank x ranks), a worker is still running a job (on any rank),
    the ranks hold different committed maps (:func:`_agree`) or the transfer group cannot be
    built (the EP group is not repaired yet); the machine stays ``failed`` (the old group back).
    """
    confirmed = _check_reloaded(r, reloaded)
    adopt = _check_group(r, group)
    _check_slots(r)
    saved = r.collectives.save()
    if adopt is not None:
        r.collectives.adopt(adopt)
    try:
        _agree(r, _drain(r))   # every rank refuses, or every rank builds: a lone build skews the groups' names
        try:
            r.collectives.new_transfer_group()
        except Exception as exc:
            raise RuntimeError(f"recover(): could not re-create the transfer group ({type(exc).__name__}: {exc}); "
                               "the machine stays failed") from exc
    except BaseException:
        r.collectives.restore(saved)
        raise
    if adopt is not None:
        r.trace.emit("group_adopted", group=r.collectives.name, old_group=saved[6])
    r.trace.emit("transfer_group_reset", group=r.collectives.transfer_group_name)
    r.fire("recovered", extra={"reloaded": confirmed} if confirmed is not None else None)
    r.untrusted.clear()
    r.broken_ranks = 0
    r.counters.restart(r.config.step_interval)


def _check_reloaded(r: Any, reloaded: Any) -> list | None:
    """``reloaded`` checked against the layers this rank's commits left untrusted; the pairs confirmed
    (None: nothing needed confirming). Raises before any collective."""
    if isinstance(reloaded, (bool, np.bool_)):   # a numpy bool too, as the other flags take it
        reloaded = bool(reloaded)
        pairs: set | None = None
    elif isinstance(reloaded, (str, bytes)) or not hasattr(reloaded, "__iter__"):
        raise ValueError(f"recover(): reloaded must be True, False or (model name, layer) pairs, got {reloaded!r}")
    else:
        pairs = set()
        for item in reloaded:
            try:
                name, layer = item
                entry = next(e for e in r.models if e.name == name)
            except (TypeError, ValueError, StopIteration):
                raise ValueError(f"recover(): reloaded must hold (model name, layer) pairs of added models, "
                                 f"got {item!r}") from None
            if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or \
                    not 0 <= layer < entry.num_layers:
                raise ValueError(f"recover(): reloaded names layer {layer!r} of model {name!r}, which has layers "
                                 f"0..{entry.num_layers - 1}")
            pairs.add((name, int(layer)))
    untrusted = sorted(r.untrusted)
    if not untrusted and not r.broken_ranks:
        return None
    missing = [p for p in untrusted if reloaded is not True and (pairs is None or p not in pairs)]
    if missing:
        named = ", ".join(f"model {m!r} layer {k} ({r.untrusted[(m, k)]})" for m, k in missing)
        raise RuntimeError(f"recover(): the commit of {named} raised part-way on this rank, so its weights cannot "
                           "be trusted (docs/design.md §8): reload them for the maps the controller holds "
                           "(maps(name)), then call recover(reloaded=True) on every rank; the machine stays failed")
    if reloaded is False:
        raise RuntimeError(f"recover(): a commit raised part-way on {r.broken_ranks} rank(s) (docs/design.md §8): "
                           "once those ranks reloaded the layers they name, call recover(reloaded=True) on every "
                           "rank; the machine stays failed")
    return [list(p) for p in untrusted]


def _check_group(r: Any, group: Any) -> Any:
    """``group`` (None: keep the current one) checked: this rank's number and the same size."""
    if group is None:
        return None
    try:
        group, rank, world = resolve_group(group)
    except ValueError as exc:
        raise ValueError(f"recover(): {exc}") from None
    if (rank, world) != (r.collectives.rank, r.collectives.world_size):
        raise ValueError(f"recover(): group must give this rank number {r.collectives.rank} of "
                         f"{r.collectives.world_size} (a repair renumbers nothing; elastic EP resizes), got rank "
                         f"{rank} of {world}")
    return group


def _check_slots(r: Any) -> None:
    """Maps with another slot count than the group's (say, an elastic scale that failed half-way) would
    crash the next forward, or route to slots no rank has: refuse before anything changes."""
    world = r.collectives.world_size
    wrong = [f"{e.name!r} has {e.num_physical} slots, the group {e.num_local} x {world} = {e.num_local * world}"
             for e in r.models if e.num_physical != e.num_local * world]
    if wrong:
        raise RuntimeError(f"recover(): maps do not fit the EP group of {world} rank(s) ({'; '.join(wrong)}); "
                           "the machine stays failed")


# past its collective timeout a worker's job ends within this (a few chunk copies): a worker still busy
# after it is stuck
DRAIN_GRACE_S = 5.0


def _drain(r: Any) -> bool:
    """Wait (bounded: the collective timeout + ``DRAIN_GRACE_S``) for the worker's jobs, then drop the
    buffers' rows; a busy worker is traced (``worker_stuck``). True when it finished. The jobs' paced
    chunks go unpaced meanwhile: no engine step comes while the engine thread waits here."""
    drained = True
    if r.worker is not None:
        with unpaced(r.mover.closing, r.mover.step_advanced):
            drained = r.worker.wait_idle(r.timeout_s + DRAIN_GRACE_S)
    if not drained:
        r.trace.emit("worker_stuck", pending=r.worker.pending)
    r.mover.invalidate_buffers()
    return drained


# a digest goes in 8-bit pieces: G * sum(d^2) and (sum d)^2 stay exact in float64 up to G ~ 370,000
_PIECES = 8


def _agree(r: Any, drained: bool) -> None:
    """One SUM all-reduce of whether this rank's worker drained and of digests of what it committed
    (each model's maps, the rearrangements begun); ``RuntimeError`` on every rank naming what is wrong.
    """
    items = map_items(r.models) + [("the number of rearrangements begun",
                                    np.array([r.reporter.count], dtype=np.int64))]
    local = torch.cat([flags(0.0 if drained else 1.0), digest_flags(items)])
    if r.collectives.group is None:
        summed = local.tolist()
    else:
        try:
            # a peer may still be waiting out its worker's drain before it gets here
            summed = r.collectives.all_reduce({"recover": local}, 2 * r.timeout_s + 10.0)["recover"].tolist()
        except GroupBroken as exc:
            raise RuntimeError(f"recover(): the ranks could not agree ({exc}); the machine stays failed") from exc
    differ = differing(items, summed[1:], r.collectives.world_size if r.collectives.group is not None else 1)
    problems = []
    stuck = int(round(summed[0]))
    if stuck:
        problems.append(f"the background worker has not finished its job on {stuck} rank(s)")
    if differ:
        problems.append(f"the ranks disagree on {', '.join(differ)} (a rank committed what its peers did not; "
                        "restart the ranks from one placement)")
    if problems:
        raise RuntimeError(f"recover(): {'; '.join(problems)}; the machine stays failed")


def map_items(models: Any) -> list[tuple[str, np.ndarray]]:
    """(name, array) to compare across ranks: each model's committed (L, P) ``phy2log``."""
    return [(f"the committed maps of model {e.name!r}", np.ascontiguousarray(e.maps.phy2log, dtype=np.int64))
            for e in models]


def digest_flags(items: list[tuple[str, np.ndarray]]) -> torch.Tensor:
    """(2 * 8 * len(items),) float64: the ``_PIECES`` 8-bit pieces d of a 64-bit digest of each array, then
    their squares, to be summed over the ranks and read by :func:`differing`."""
    pieces = []
    for _, array in items:
        digest = hashlib.blake2b(repr(array.shape).encode() + array.tobytes(), digest_size=_PIECES).digest()
        pieces.extend(float(b) for b in digest)
    return flags(*pieces, *(d * d for d in pieces))


def differing(items: list[tuple[str, np.ndarray]], summed: Any, world: int) -> list[str]:
    """The names of ``items`` whose :func:`digest_flags` differ between the ``world`` ranks that summed them
    into ``summed``: equal on every rank iff G * sum(d^2) == (sum d)^2 for every piece d (Cauchy-Schwarz)."""
    n = _PIECES * len(items)
    sums, squares = list(summed[:n]), list(summed[n:2 * n])
    return [name for i, (name, _) in enumerate(items)
            if not all(counts_equal(sums[k], squares[k], world) for k in range(i * _PIECES, (i + 1) * _PIECES))]


def different_maps(differ: list[str]) -> str:
    """Why ranks whose maps :func:`differing` names in ``differ`` must not move anything (a rearrangement's
    planning refuses them, and so does an elastic scale before it builds its new group)."""
    return (f"the ranks hold different maps: {', '.join(differ)} (add_model must be given the same phy2log on "
            "every rank; restart the ranks from one placement)")
