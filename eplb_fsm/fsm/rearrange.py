"""The rearrangement in flight: planning, layer transfers and commits, faults.

The controller owns one :class:`Rearranger` (``controller.rearranger``) and calls it with
what a step all-reduced. Each method executes a decision of :mod:`eplb_fsm.fsm.decide`,
fires the event that says what happened and acts on what ``fire()`` returns (the
destination), never on a re-read state.

Sync mode (:meth:`Rearranger.run_sync`) moves every layer inside one call: transfer into
the buffer, one all-reduce that every rank has it, ``layer_done``, then the write (the
last layer's in ``committing``), and ``committed``. Async mode hands the policy and each
layer to the background worker; :meth:`Rearranger.progress` acts on the summed ready
flags: those of the step's own all-reduce, or those posted on the step before and read
by :meth:`Rearranger.settle` (``async_overlap_poll``). Faults: committed layers keep
their new placement, the rest keep old maps and weights; a failed transfer leaves the
EP group usable (fresh transfer group), a failed collective on it sends the machine to
``failed``.
"""

from __future__ import annotations

from typing import Any, Callable

import structlog
import torch

from eplb_fsm.fsm import recovery
from eplb_fsm.fsm.collectives import Collectives, GroupBroken, PostedReduce, flags
from eplb_fsm.fsm.decide import (ABORT, JOIN, POST, TAKE_PLAN, WAIT, Counters, decide_layer, decide_plan, decide_poll,
                                 decide_progress)
from eplb_fsm.fsm.layer_jobs import LayerJobs
from eplb_fsm.fsm.machine import COMMITTING, FAILED, PLANNING, SCALING, TRANSFERRING, EplbMachine, Fired
from eplb_fsm.fsm.planning import Plan, bad_load_reason, local_loads, plan_placements, split_loads
from eplb_fsm.fsm.reporting import Rearrangement, Reporter
from eplb_fsm.fsm.transfers import LayerMover, ready_flags
from eplb_fsm.safe_log import log_safely

__all__ = ["Rearranger"]

_log = structlog.get_logger("eplb_fsm")


class Rearranger:
    """Executes the lifecycle of one rearrangement at a time for the controller.

    ``fire``: the controller's ``fire(trigger, extra=None, **data) -> Fired`` (it writes the
    trace record); the other arguments are the controller's collaborators, shared.
    ``current``: the :class:`Rearrangement` in flight, or None.
    """

    def __init__(self, *, machine: EplbMachine, fire: Callable[..., Fired], config: Any, policy: Any,
                 models: list, counters: Counters, collectives: Collectives, mover: LayerMover,
                 reporter: Reporter, worker: Any, trace: Any) -> None:
        self.machine, self.fire, self.config, self.policy = machine, fire, config, policy
        self.models, self.counters, self.collectives, self.mover = models, counters, collectives, mover
        self.reporter, self.worker, self.trace = reporter, worker, trace
        self.timeout_s = float(config.collective_timeout_s)
        self.current: Rearrangement | None = None
        # async mode: the ready flags posted on the last step, read on this one (settle)
        self.posted: PostedReduce | None = None
        self.layer_jobs = LayerJobs(worker, mover, prefetch=bool(config.async_prefetch) and worker is not None)

    # ------------------------------------------------------------ begin / end
    def local_loads(self) -> torch.Tensor:
        """This rank's planning load (sum_m L_m * N_m,) float64. Taken before the machine moves,
        so an error here (an estimator that fails on the window) leaves it in ``collecting``."""
        return local_loads(self.models, self.config)

    def open_passes(self) -> None:
        """A rearrangement starts outside a step (``rearrange()``): each model's ``load_pass`` may
        hold counts in the placement in use, so until the pass is recorded every commit carries
        them into the layer's new placement too (``LoadWindow.pass_open``)."""
        for entry in self.models:
            entry.window.pass_open = True

    def begin(self, step: int, forced: bool) -> None:
        """Open the record of a rearrangement starting at ``step``."""
        self.current = self.reporter.begin(step, forced)

    def finish(self, outcome: str, reason: str | None = None) -> None:
        """Close the rearrangement in flight (a ``history`` entry and a ``rearrangement`` record)."""
        if self.current is not None:
            self.reporter.finish(self.current, outcome, reason, steps=self.counters.steps,
                                 num_layers=self.machine.num_layers, state=self.machine.state)
            self.current = None

    def all_reduce_or_fail(self, parts: dict, timeout_s: float, **fields: Any) -> dict | None:
        """The collectives' all-reduce; None after a broken group sent the machine to failed."""
        try:
            return self.collectives.all_reduce(parts, timeout_s, **fields)
        except GroupBroken as exc:
            self.group_fault(exc)
            return None

    # ------------------------------------------------------------------ plan
    def plan(self, flat_loads: torch.Tensor) -> None:
        """Act on the all-reduced load: reject it, or plan (sync) / start the policy job (async)."""
        bad = bad_load_reason(flat_loads)
        if bad is not None:
            self.trace.emit("loads_rejected", reason=bad)
            log_safely(_log, "warning", "eplb loads rejected", rank=self.collectives.rank,
                       step=self.counters.steps - 1, reason=bad)
            self.abort(f"bad loads: {bad}", recoverable=True, kind="rejected")
            return
        loads = split_loads(self.models, flat_loads)
        current = self.current
        if self.worker is None:
            try:
                plan = self.make_plan(loads, current.step, current.forced)
            except Exception as exc:
                self.abort(f"policy failed: {type(exc).__name__}: {exc}", recoverable=True)
                return
            if self.accept(plan) == TRANSFERRING:
                self.run_sync()
        else:
            current.job = self.worker.submit(self.make_plan, loads, current.step, current.forced, kind="plan")
            current.job_step = self.counters.steps

    def make_plan(self, loads: list[torch.Tensor], step: int, forced: bool) -> Plan:
        """Run the policy for every model on the shared load (pure: same input, same plan)."""
        plan = plan_placements(self.policy, self.models, loads, num_nodes=self.config.num_nodes,
                               world_size=self.collectives.world_size, step=step, forced=forced,
                               align_slots=self.config.align_slots)
        plan.chunks = self.mover.chunk_counts(plan.new_phy2log, plan.changed)   # here: the worker's thread
        return plan

    def accept(self, plan: Plan) -> str:
        """Fire ``plan_ready`` with :func:`decide_plan`'s ``worth``; returns the destination."""
        self.current.plan = plan
        threshold = self.config.min_balancedness_gain
        worth = decide_plan(plan.moves, plan.gain, threshold)
        fired = self.fire("plan_ready", extra={
            "balancedness_before": round(plan.balancedness_before, 6),
            "balancedness_after": round(plan.balancedness_after, 6),
            "gain": round(plan.gain, 6), "moved_bytes": plan.moved_bytes,
            "changed_layers": int(sum(plan.changed)), "policy_s": round(plan.policy_s, 6), "forced": plan.forced,
        }, moves=plan.moves, worth=worth)
        if fired.dest != TRANSFERRING:
            reason = "no_moves" if plan.moves == 0 else "gain_below_threshold"
            self.trace.emit("plan_skipped", reason=reason, moves=plan.moves, gain=round(plan.gain, 6),
                            min_balancedness_gain=threshold)
            log_safely(_log, "info", "eplb rearrangement skipped", rank=self.collectives.rank, step=plan.step,
                       reason=reason, moves=plan.moves, gain=round(plan.gain, 6), min_gain=threshold)
            self.finish("skipped", reason=reason)
        return fired.dest

    def run_forced(self, make_plan: Callable[[list[torch.Tensor]], Plan], fields: dict, scale: int) -> str:
        """A rearrangement that can't be refused (elastic scale): returns where it left the machine.

        All-reduces the load (bad statistics: plan on zero load), plans with ``make_plan``
        (per-model (L, N) loads -> Plan), fires ``plan_ready`` with ``moves`` = every slot
        whose content changes; with none the machine goes straight on to ``scaling``.
        """
        loads = self.local_loads()
        self.begin(self.counters.steps, forced=True)
        reduced = self.all_reduce_or_fail({"loads": loads}, self.timeout_s)
        if reduced is None:
            return FAILED
        flat = reduced["loads"]
        bad = bad_load_reason(flat) if flat.numel() else None
        if bad:
            self.trace.emit("loads_rejected", reason=bad, scale=scale)
            flat = torch.zeros_like(flat)
        try:
            plan = make_plan(split_loads(self.models, flat))
        except Exception as exc:
            return self.abort(f"scale policy failed: {type(exc).__name__}: {exc}", recoverable=True)
        plan.chunks = self.mover.chunk_counts(plan.new_phy2log, plan.changed)
        changed_slots = sum(int((e.maps.phy2log != new).sum()) for e, new in zip(self.models, plan.new_phy2log))
        self.current.plan = plan
        fired = self.fire("plan_ready", extra=dict(fields, moved_slots=plan.moves, moved_bytes=plan.moved_bytes,
                                                   balancedness_before=round(plan.balancedness_before, 6),
                                                   balancedness_after=round(plan.balancedness_after, 6),
                                                   changed_layers=int(sum(plan.changed)),
                                                   policy_s=round(plan.policy_s, 6), forced=True),
                          moves=changed_slots, worth=decide_plan(changed_slots, 0.0, 0.0, forced_scale=True))
        if fired.dest == SCALING:  # nothing changes at all: the machine went straight on to the switch
            self.finish("skipped", reason="no_moves")
            return fired.dest
        return self.run_sync()

    # ------------------------------------------------------------- transfers
    def commit_layer(self, layer: int, pending: Any) -> Fired:
        """``layer_done`` (every rank has it), then write it (``pending`` None: unchanged layer)."""
        plan = self.current.plan
        entry, local = self.mover.locate(layer)
        extra = {"model": entry.name, "model_layer": local, "moved": plan.moved[layer], "changed": plan.changed[layer]}
        if pending is not None and self.worker is not None:   # an async layer job: when its flags could say ready
            extra.update(chunks=self.current.chunks, ready_step=self.current.ready_step)
        fired = self.fire("layer_done", extra=extra, layer=layer)
        self.mover.write(plan.new_phy2log, layer, pending)
        self.current.layers_committed += 1
        return fired

    def committed(self) -> str:
        """Every layer is written: ``committed`` and the record; returns the destination."""
        fields = Reporter.summary_fields(self.current, self.counters.steps)
        fired = self.fire("committed", extra=fields)
        self.finish("committed")
        return fired.dest

    def run_sync(self) -> str:
        """Sync mode: each changed layer transferred, agreed by all ranks, committed; returns the end state."""
        plan = self.current.plan
        fired = None
        for layer in range(self.machine.num_layers):
            pending = None
            if plan.changed[layer]:
                error: BaseException | None = None
                try:
                    pending = self.mover.transfer(plan.new_phy2log, layer)
                except Exception as exc:
                    error = exc
                # [ready, failed, late]; a peer may itself be waiting out a transfer timeout first
                agreed = self.all_reduce_or_fail({"ready": flags(0.0 if error else 1.0, 1.0 if error else 0.0, 0.0)},
                                                 2 * self.timeout_s, layer=layer)
                if agreed is None:
                    return FAILED
                verdict = decide_layer(agreed["ready"])
                if verdict.action == ABORT:
                    return self.transfer_fault(layer, error, verdict.failed)
            try:
                fired = self.commit_layer(layer, pending)
            except Exception as exc:
                return self.commit_failed(layer, exc)
        assert fired is not None and fired.dest == COMMITTING, fired
        return self.committed()

    def ready_flags(self) -> torch.Tensor:
        """This rank's (3,) [ready, failed, late] for the async job in flight."""
        return ready_flags(self.current.job, self.timeout_s)

    def poll(self, parts: dict, overlap: bool) -> None:
        """A step's ask of the async job in flight (:func:`decide_poll`), after reading last step's posted flags.

        Posts this rank's flags (read on the next step), or adds them to ``parts`` as
        ``ready`` for the step's own all-reduce, or does nothing (no job in flight).
        """
        self.settle()
        current = self.current
        steps = self.counters.steps
        if current is not None and current.job is not None and current.chunks > 1 and steps == current.ready_step:
            # a paced layer's last chunk can only have started now: its timeout counts from here
            current.job.waited_from = current.job.clock()
        poll = decide_poll(self.machine.state, self.worker is not None and current is not None, overlap,
                           bool(parts), fresh=current is not None and current.job_step == steps,
                           early=current is not None and steps < current.ready_step)
        if poll == POST:
            self.post_poll()
        elif poll == JOIN:
            parts["ready"] = self.ready_flags()

    def post_poll(self) -> None:
        """Post this rank's ready flags (read by :meth:`settle` on the next step)."""
        try:
            self.posted = self.collectives.post({"ready": self.ready_flags()}, self.timeout_s)
        except GroupBroken as exc:
            self.group_fault(exc)

    def settle(self, act: bool = True) -> None:
        """Read the ready flags posted on the step before and act on their sum (:meth:`progress`).

        ``act=False`` (at close): only finish the collective and its trace record; a broken
        group is then no news worth a fault.
        """
        posted, self.posted = self.posted, None
        if posted is None:
            return
        try:
            summed = posted.wait()["ready"]
        except GroupBroken as exc:
            if act:
                self.group_fault(exc)
            return
        if act:
            self.progress(summed)

    def progress(self, summed: torch.Tensor, early: bool | None = None) -> None:
        """Async mode: act on the all-reduced ready flags (:func:`decide_progress`).

        ``early`` (None: from the shared step count, as :meth:`poll` has it): the job's flags
        were taken before its ready step.
        """
        current, state = self.current, self.machine.state
        if early is None:
            early = current is not None and self.counters.steps < current.ready_step
        verdict = decide_progress(summed, self.collectives.world_size, state, early)
        if verdict.action == WAIT:
            return
        if verdict.action == ABORT:  # the job stays noted in current: abort records one still running
            job = current.job
            error = job.error() if job is not None else None
            what = "policy" if state == PLANNING else f"transfer of layer {self.machine.layer}"
            reason = (f"{what} failed on {verdict.failed} rank(s)" if verdict.failed else
                      f"{what} ran past collective_timeout_s={self.timeout_s} on {verdict.late} rank(s)")
            if state == PLANNING:
                self.abort(reason + (f": {type(error).__name__}: {error}" if error else ""), recoverable=True)
            else:
                self.transfer_fault(self.machine.layer, error, verdict.failed, late=verdict.late)
            return
        job, current.job = current.job, None
        if verdict.action == TAKE_PLAN:
            if self.accept(job.result(timeout=0)) == TRANSFERRING:
                self.advance(TRANSFERRING)
            return
        job.wait_stream()
        layer = self.machine.layer
        try:
            fired = self.commit_layer(layer, job.result(timeout=0))
        except Exception as exc:
            self.commit_failed(layer, exc)
            return
        self.advance(fired.dest)

    def advance(self, state: str) -> None:
        """From ``state``: commit unchanged layers at once, start the next changed layer, or finish."""
        plan = self.current.plan
        while state == TRANSFERRING:
            layer = self.machine.layer
            if plan.changed[layer]:
                current = self.current
                current.job, current.job_step = self.layer_jobs.start(plan, layer, self.counters.steps)
                # chunk i starts once step job_step + i - 1 has begun (StepPacer; in practice as
                # it returns), so flags taken before step job_step + chunks can't say ready
                current.chunks = plan.chunks[layer]
                current.ready_step = current.job_step + current.chunks
                return
            state = self.commit_layer(layer, None).dest
        if state == COMMITTING:
            self.committed()

    def drain(self) -> None:
        """Async mode: finish (or roll back) the rearrangement in flight, a step's agreement at a time."""
        self.settle()
        while self.current is not None and self.machine.state in (PLANNING, TRANSFERRING, COMMITTING):
            job = self.current.job
            if job is not None and not job.done():
                try:
                    job.future.exception(timeout=self.timeout_s + 1.0)
                except Exception:  # still running after the timeout: its flags say "late"
                    pass
            reduced = self.all_reduce_or_fail({"ready": self.ready_flags()}, 2 * self.timeout_s)
            if reduced is None:
                return
            self.trace.emit("scale_drain", state=self.machine.state, layer=self.machine.layer)
            self.progress(reduced["ready"], early=False)   # no engine step paces it now: late is late

    # ---------------------------------------------------------------- faults
    def abort(self, reason: str, recoverable: bool, layer: int | None = None, kind: str = "aborted") -> str:
        """Fire ``fault``: committed layers stay new, the rest keep old maps and weights; returns the destination."""
        current = self.current
        extra: dict = {"reason": reason}
        if current is not None:
            extra["layers_committed"] = current.layers_committed
            if current.job is not None and not current.job.done():
                extra["job_running"] = current.job.kind
            current.job = None
        ahead = self.layer_jobs.drop()
        if ahead is not None and not ahead.done():
            extra["prefetch_running"] = ahead.layer
        if layer is not None:
            extra["failed_layer"] = layer
        dest = FAILED
        if self.machine.state == FAILED:
            self.trace.emit("fault_ignored", reason=reason)
        else:
            dest = self.fire("fault", extra=extra, recoverable=recoverable).dest
        log_safely(_log, "warning", "eplb rearrangement aborted", rank=self.collectives.rank,
                   step=self.counters.steps - 1, reason=reason, recoverable=recoverable, state=dest)
        self.finish(kind, reason=reason)
        return dest

    def group_fault(self, exc: BaseException) -> str:
        """A collective on the EP group failed: the group is broken, the machine goes to failed."""
        log_safely(_log, "error", "eplb collective failed", rank=self.collectives.rank,
                   step=self.counters.steps - 1, error=str(exc))
        if self.machine.state == FAILED:
            return FAILED
        return self.abort(str(exc), recoverable=False)

    def commit_failed(self, layer: int, exc: BaseException) -> str:
        """A local copy failed half-way through a commit: the weights can't be trusted."""
        return self.abort(f"commit of layer {layer} failed: {type(exc).__name__}: {exc}", recoverable=False)

    def transfer_fault(self, layer: int, error: BaseException | None, failed_ranks: int, late: int = 0) -> str:
        """A layer's transfer failed somewhere: abort, then give the transfers a fresh group."""
        detail = f": {type(error).__name__}: {error}" if error is not None else ""
        if late:
            reason = f"transfer of layer {layer} ran past collective_timeout_s={self.timeout_s} on {late} rank(s)"
        else:
            reason = f"transfer of layer {layer} failed on {failed_ranks} rank(s){detail}"
        dest = self.abort(reason, recoverable=True, layer=layer)
        return self.reset_transfers() or dest

    reset_transfers = recovery.reset_transfers   # after a transfer fault (fsm/recovery.py)
    recover = recovery.recover                   # EplbController.recover()
