"""How a rearrangement ends early: every way goes through the machine's ``fault`` (docs/design.md §8).

The functions take the :class:`~eplb_fsm.fsm.rearrange.Rearranger` (``r``) and are its methods
of the same names:

- :func:`abort`: fire ``fault``; committed layers stay new, the rest keep old maps and weights.
- :func:`group_fault`: a collective on the EP group failed: ``failed`` (nothing left to agree over).
- :func:`transfer_fault`: every rank learnt from an agreement that a transfer failed: a recoverable
  fault, then a fresh transfer group; anything that escapes that reset (a ``KeyboardInterrupt``) first
  sends the machine on to ``failed``, as :func:`interruptible` does.
- :func:`broken_commit`: this rank's write of a layer raised part-way. Its peers do not know yet,
  so the rank does not fault alone (a peer's next all-reduce would pair with the engine's): it notes
  the layer as untrusted, gives its maps the new row its peers committed, and says ``broken`` in
  the next agreement every rank runs (sync: the next layer's, or the one after the last commit;
  async: its next ready flags, in ``committing`` for the last layer).
- :func:`commit_fault`: that agreement counted broken commits: every rank fires a fault that is
  not recoverable, on the same step; ``recover()`` then needs ``reloaded`` (fsm/recovery.py).
- :func:`needs_reload` (a plain function, no method): whether such a fault still waits for
  ``recover(reloaded=...)``; an elastic salvage or rollback then votes no (elastic/scaling.py).
- :func:`interruptible`: around each piece of a rearrangement. Anything that escapes it (a
  ``KeyboardInterrupt``, ``SystemExit``, an error no path expected) first sends the machine to
  ``failed`` with a fault naming it, then goes on up. It cannot wait for an agreement, so the
  fault is this rank's alone.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import structlog

from eplb_fsm.fsm.machine import COMMITTING, FAILED, PLANNING, TRANSFERRING
from eplb_fsm.safe_log import log_safely

__all__ = ["abort", "group_fault", "transfer_fault", "broken_commit", "commit_fault", "needs_reload", "interruptible"]

_log = structlog.get_logger("eplb_fsm")
LIVE = (PLANNING, TRANSFERRING, COMMITTING)   # a rearrangement is in flight


def abort(r: Any, reason: str, recoverable: bool, layer: int | None = None, kind: str = "aborted",
          **fields: Any) -> str:
    """Fire ``fault``: committed layers stay new, the rest keep old maps and weights; returns the destination.

    ``fields``: more context for the ``fault`` record (the guards never read it).
    """
    current = r.current
    extra: dict = {"reason": reason, **fields}
    if current is not None:
        extra["layers_committed"] = current.layers_committed
        if current.scale is not None:
            extra["scale"] = current.scale
        if current.job is not None and not current.job.done():
            extra["job_running"] = current.job.kind
        current.job = None
    ahead = r.layer_jobs.drop()
    if ahead is not None and not ahead.done():
        extra["prefetch_running"] = ahead.layer
    if layer is not None:
        extra["failed_layer"] = layer
    dest = FAILED
    if r.machine.state == FAILED:
        r.trace.emit("fault_ignored", reason=reason)
    else:
        dest = r.fire("fault", extra=extra, recoverable=recoverable).dest
    log_safely(_log, "warning", "eplb rearrangement aborted", rank=r.collectives.rank,
               step=r.counters.steps - 1, reason=reason, recoverable=recoverable, state=dest)
    r.finish(kind, reason=reason)
    return dest


def group_fault(r: Any, exc: BaseException) -> str:
    """A collective on the EP group failed: the group is broken, the machine goes to failed."""
    log_safely(_log, "error", "eplb collective failed", rank=r.collectives.rank,
               step=r.counters.steps - 1, error=str(exc))
    if r.machine.state == FAILED:
        return FAILED
    return abort(r, str(exc), recoverable=False)


def transfer_fault(r: Any, layer: int, error: BaseException | None, failed_ranks: int, late: int = 0) -> str:
    """A layer's transfer failed somewhere: abort, then give the transfers a fresh group."""
    detail = f": {type(error).__name__}: {error}" if error is not None else ""
    if late:
        reason = f"transfer of layer {layer} ran past collective_timeout_s={r.timeout_s} on {late} rank(s)"
    else:
        reason = f"transfer of layer {layer} failed on {failed_ranks} rank(s){detail}"
    dest = abort(r, reason, recoverable=True, layer=layer)
    try:
        return r.reset_transfers() or dest
    except BaseException as exc:
        # the machine is collecting by now, where interruptible() does not act: a reset cut short (a Ctrl-C in
        # the drain or the agreement) left no fresh transfer group, so the machine must not serve on as if it had
        reason = f"the transfer group's reset interrupted: {type(exc).__name__}" + (f": {exc}" if str(exc) else "")
        abort(r, reason, recoverable=False, interrupted=type(exc).__name__)
        raise


def broken_commit(r: Any, layer: int, exc: BaseException) -> None:
    """This rank's write of ``layer`` raised part-way: note it (``commit_failed`` record), give its maps
    the new row, and leave the fault to the next agreement, which carries ``broken``."""
    entry, local = r.mover.locate(layer)
    flipped = r.mover.flip_broken(r.current.plan.new_phy2log, layer)
    error = f"{type(exc).__name__}: {exc}"
    r.untrusted[(entry.name, local)] = error
    r.current.broken.append(f"the commit of layer {layer} (model {entry.name!r} layer {local}) raised part-way: "
                            f"{error}")
    r.trace.emit("commit_failed", layer=layer, model=entry.name, model_layer=local, error=error,
                 maps="new" if flipped else "unchanged")
    log_safely(_log, "error", "eplb commit failed", rank=r.collectives.rank, step=r.counters.steps - 1,
               layer=layer, model=entry.name, model_layer=local, error=error)


def commit_fault(r: Any, broken_ranks: int) -> str:
    """An agreement counted ``broken_ranks`` ranks whose commit raised part-way: a fault that is not
    recoverable on every rank (their weights can't be trusted until the engine reloads them)."""
    own = r.current.broken if r.current is not None else []
    r.broken_ranks = max(r.broken_ranks, int(broken_ranks))
    reason = f"a commit raised part-way on {broken_ranks} rank(s)" + (f"; here {'; '.join(own)}" if own else "")
    return abort(r, reason, recoverable=False, commit_failed_ranks=int(broken_ranks))


def needs_reload(r: Any) -> bool:
    """Whether a commit raised part-way (on this rank: ``r.untrusted``; on any: ``r.broken_ranks``) and no
    ``recover(reloaded=...)`` has confirmed the reload yet. Only ``recover()`` may then leave ``failed``:
    an elastic salvage or rollback would serve those layers' half-written weights, so it votes no."""
    return bool(r.untrusted) or r.broken_ranks > 0


@contextmanager
def interruptible(r: Any, what: str) -> Iterator[None]:
    """Run one piece of a rearrangement (``what`` names it); see the module docstring."""
    try:
        yield
    except BaseException as exc:
        if r.machine.state in LIVE:
            own = r.current.broken if r.current is not None else []
            if own:   # a write that raised part-way: recover() needs it reloaded, as after an agreed commit fault
                r.broken_ranks = max(r.broken_ranks, 1)
            reason = f"{what} interrupted: {type(exc).__name__}" + (f": {exc}" if str(exc) else "")
            abort(r, reason + (f"; here {'; '.join(own)}" if own else ""), recoverable=False,
                  interrupted=type(exc).__name__)
        raise
