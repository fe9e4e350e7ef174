"""Async mode's layer transfers on the worker: the job the ranks wait for, and one submitted ahead.

The :class:`~eplb_fsm.fsm.rearrange.Rearranger` asks :meth:`LayerJobs.start` for the
transfer job of each changed layer as the machine reaches it. Without prefetch that is a
fresh job, into the model's buffer. With ``async_prefetch`` the next changed layer's
transfer is submitted at the same time, into the other of two buffers, so the worker
moves layer k+1 while layer k waits for the ranks' agreement and its commit; when the
machine reaches k+1 its job is handed over, often already done.

Why this is safe:

- Buffers alternate job by job, and a job is submitted ahead only while one uncommitted
  layer is in flight, so two layers that are not yet committed never share a buffer.
- The worker runs jobs in submission order on every rank, so the transfer group sees the
  same message sequence everywhere.
- A job submitted ahead of one that failed on this rank does not run
  (:class:`TransferSkipped`); peers that did start theirs end by the transfer's timeout,
  which :func:`eplb_fsm.fsm.recovery.reset_transfers` waits out before the new transfer group.
- After an abort :meth:`drop` forgets the job ahead, so it is never handed over to a later
  rearrangement, and the buffers' generations make its pending layer uncommittable.

Every value the ranks decide on (which layer, which step a job counts from: the step it is
handed over on, submitted ahead or not) is a function of the shared plan and step counter,
never of the worker's timing.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LayerJobs", "TransferSkipped"]


class TransferSkipped(RuntimeError):
    """A job submitted ahead did not run: the transfer before it failed on this rank."""


class LayerJobs:
    """Submits the changed layers' transfers to ``worker`` through ``mover``.

    ``prefetch``: also submit the next changed layer ahead (``async_prefetch``).
    ``ahead``: the job submitted ahead (None: none), ``ahead_layer`` its layer and
    ``ahead_step`` the shared step it was submitted on.
    """

    def __init__(self, worker: Any, mover: Any, prefetch: bool) -> None:
        self.worker, self.mover, self.prefetch = worker, mover, bool(prefetch)
        self.ahead: Any = None
        self.ahead_layer: int | None = None
        self.ahead_step = -1
        self.submitted = 0
        self.handed_over = 0   # jobs that had been submitted ahead when the machine reached them

    def start(self, plan: Any, layer: int, step: int) -> tuple[Any, bool]:
        """The job of changed ``layer``, and whether it was submitted ahead (then handed over now).

        ``plan``: the plan in flight (``changed``: (L,) flags, ``new_phy2log``); ``step``: the
        shared step count now, the job's ``job_step`` either way (a job submitted ahead queued
        behind the one before it, so its chunks could not start before that one ended).
        With prefetch it also submits the next changed layer ahead.
        """
        ahead = self.ahead is not None and self.ahead_layer == layer
        if ahead:
            job = self.drop()
            job.waited_from = job.clock()   # its timeout counts from now, not from behind layer k
            self.handed_over += 1
        else:
            self.drop()
            job = self.submit(plan, layer, None)
        if self.prefetch:
            following = next((k for k in range(layer + 1, len(plan.changed)) if plan.changed[k]), None)
            if following is not None:
                self.ahead, self.ahead_layer, self.ahead_step = self.submit(plan, following, job), following, step
        return job, ahead

    def submit(self, plan: Any, layer: int, after: Any) -> Any:
        """Queue ``layer``'s transfer; ``after``: the job it was submitted behind (None: none)."""
        spare = self.prefetch and self.submitted % 2 == 1
        self.submitted += 1
        return self.worker.submit(self.run, plan.new_phy2log, layer, spare, after, kind="transfer", layer=layer)

    def run(self, new_phy2log: Any, layer: int, spare: bool, after: Any) -> Any:
        """The job's body, on the worker: skipped when ``after`` (run just before it) failed."""
        if after is not None and after.error() is not None:
            raise TransferSkipped(f"layer {layer} was not transferred: layer {after.layer}'s transfer failed here")
        return self.mover.transfer(new_phy2log, layer, spare=spare)

    def drop(self) -> Any:
        """Forget the job submitted ahead (an abort, or :meth:`start` taking it over); returns it (None: none)."""
        job, self.ahead, self.ahead_layer, self.ahead_step = self.ahead, None, None, -1
        return job
