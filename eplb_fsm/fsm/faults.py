"""What a fault does: abort the rearrangement (roll back what is not committed), repair or give up.

Committed layers keep their new placement; the others keep old maps and old weights (a
layer's maps only flip in the call that writes its weights). A failed transfer leaves
the EP group usable: the ranks drain their workers and build a fresh transfer group. A
failed collective on the EP group leaves nothing to agree over: the machine goes to
``failed`` and waits for the engine's ``recover()``.
"""

from __future__ import annotations

import structlog

from eplb_fsm.fsm.collectives import GroupBroken, flags
from eplb_fsm.fsm.machine import FAILED

__all__ = ["FaultsMixin"]

_log = structlog.get_logger("eplb_fsm")


class FaultsMixin:
    """The ``fault`` transitions' actions for :class:`~eplb_fsm.fsm.controller.EplbController`.

    Uses ``machine``, ``models``, ``worker``, ``group``, ``_current`` and ``_timeout``;
    fires through ``_fire`` and closes the record through ``_finish``.
    """

    def _abort(self, reason: str, recoverable: bool, layer: int | None = None, kind: str = "aborted") -> str:
        """Fire ``fault``: committed layers stay new, the rest keep old maps and weights; returns the destination."""
        current = self._current
        extra = {"reason": reason}
        if current is not None:
            extra["layers_committed"] = current.layers_committed
            if current.job is not None and not current.job.done():
                extra["job_running"] = current.job.kind
            current.job = None
        if layer is not None:
            extra["failed_layer"] = layer
        dest = FAILED
        if self.machine.state == FAILED:
            self.trace.emit("fault_ignored", reason=reason)
        else:
            dest = self._fire("fault", extra=extra, recoverable=recoverable).dest
        _log.warning("eplb rearrangement aborted", rank=self.rank, step=self.steps - 1, reason=reason,
                     recoverable=recoverable, state=dest)
        if current is not None:
            self._finish(kind, reason=reason)
        return dest

    def _group_fault(self, exc: BaseException) -> str:
        """A collective on the EP group failed: the group is broken, the machine goes to failed."""
        _log.error("eplb collective failed", rank=self.rank, step=self.steps - 1, error=str(exc))
        if self.machine.state == FAILED:
            return FAILED
        return self._abort(str(exc), recoverable=False)

    def _transfer_fault(self, layer: int, error: BaseException | None, failed_ranks: int, late: int = 0) -> str:
        """A layer's transfer failed somewhere: abort, then give the transfers a fresh group."""
        detail = f": {type(error).__name__}: {error}" if error is not None else ""
        if late:
            reason = f"transfer of layer {layer} ran past collective_timeout_s={self._timeout} on {late} rank(s)"
        else:
            reason = f"transfer of layer {layer} failed on {failed_ranks} rank(s){detail}"
        dest = self._abort(reason, recoverable=True, layer=layer)
        return self._reset_transfers() or dest

    def _reset_transfers(self) -> str | None:
        """Drain the worker and re-create the transfer group (a failed p2p leaves gloo pairs closed).

        Returns the destination when it had to fire another ``fault``, else None.
        The ranks first agree, in one all-reduce, that every worker has drained: then they
        all create the new group together (its connect phase is bounded by
        ``collective_timeout_s``, so nobody may arrive late), or all go to ``failed``.
        """
        drained = self.worker is None or self.worker.wait_idle(self._timeout + 5.0)
        if not drained:
            self.trace.emit("worker_stuck", pending=self.worker.pending)
        for entry in self.models:
            entry.buffer.generation += 1  # any stale pending layer can no longer be committed
        if self.group is None:
            if not drained:
                return self._fire("fault", extra={"reason": "background worker did not finish its job"},
                                  recoverable=False).dest
            return None
        try:
            # a peer may still be waiting out its transfer timeout before it gets here
            stuck = int(self._all_reduce({"reset": flags(0.0 if drained else 1.0)}, 2 * self._timeout + 10.0)
                        ["reset"][0])
        except GroupBroken as exc:
            return self._group_fault(exc)
        if stuck:
            return self._fire("fault", extra={"reason": f"background worker did not finish its job on {stuck} rank(s)"},
                              recoverable=False).dest
        try:
            self._new_transfer_group()
        except Exception as exc:
            return self._fire("fault", extra={"reason": f"could not re-create the transfer group: {exc}"},
                              recoverable=False).dest
        self.trace.emit("transfer_group_reset", group=self.transfer_group_name)
        return None
