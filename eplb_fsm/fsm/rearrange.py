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
by :meth:`Rearranger.settle` (``async_overlap_poll``). Either mode closes with one more
agreement after the last layer is written (sync: an all-reduce; async: the flags read in
``committing``), so a write that raised part-way on one rank reaches every rank before
``committed``. Faults (:mod:`eplb_fsm.fsm.faults`): committed layers keep their new
placement, the rest keep old maps and weights; a failed transfer leaves the EP group usable
(fresh transfer group), a failed collective on it or a broken commit sends the machine to
``failed``; anything that escapes a piece of a rearrangement (``KeyboardInterrupt``) too.
"""

from __future__ import annotations

from typing import Any, Callable

import structlog
import torch

from eplb_fsm.fsm import async_flow, faults, recovery
from eplb_fsm.fsm.collectives import Collectives, GroupBroken, PostedReduce, flags
from eplb_fsm.fsm.decide import ABORT, Counters, decide_layer, decide_plan
from eplb_fsm.fsm.layer_jobs import LayerJobs
from eplb_fsm.fsm.machine import COMMITTING, FAILED, SCALING, TRANSFERRING, EplbMachine, Fired
from eplb_fsm.fsm.planning import Plan, bad_load_reason, local_loads, plan_placements, split_loads
from eplb_fsm.fsm.reporting import Rearrangement, Reporter
from eplb_fsm.fsm.transfers import LayerMover
from eplb_fsm.safe_log import log_safely

__all__ = ["Rearranger"]

_log = structlog.get_logger("eplb_fsm")


class Rearranger:
    """Executes the lifecycle of one rearrangement at a time for the controller.

    ``fire``: the controller's ``fire(trigger, extra=None, **data) -> Fired`` (it writes the
    trace record); the other arguments are the controller's collaborators, shared.
    ``current``: the :class:`Rearrangement` in flight, or None. ``untrusted``: (model, layer) ->
    error of the layers whose write raised part-way on this rank, until ``recover(reloaded=...)``;
    ``broken_ranks``: ranks whose commit raised, as the fault that sent the machine to failed counted.
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
        self.untrusted: dict[tuple[str, int], str] = {}
        self.broken_ranks = 0

    # ------------------------------------------------------------ begin / end
    def local_loads(self) -> torch.Tensor:
        """This rank's planning load (sum_m L_m * N_m,) float64. Taken before the machine moves,
        so an error here (an estimator that fails on the window) leaves it in ``collecting``."""
        return local_loads(self.models, self.config)

    def planning_parts(self) -> dict[str, torch.Tensor]:
        """This rank's parts of the planning all-reduce: ``loads`` (:meth:`local_loads`) and ``maps``
        (16 per model: the 8-bit pieces of a digest of its ``phy2log`` and their squares, which
        :meth:`plan` compares: ranks that declared different placements must not move anything)."""
        return {"loads": self.local_loads(), "maps": recovery.digest_flags(recovery.map_items(self.models))}

    def open_passes(self) -> None:
        """A rearrangement starts outside a step (``rearrange()``): each model's ``load_pass`` may
        hold counts in the placement in use, so until the pass is recorded every commit carries
        them into the layer's new placement too (``LoadWindow.pass_open``)."""
        for entry in self.models:
            entry.window.pass_open = True

    def begin(self, step: int, forced: bool, scale: int | None = None) -> None:
        """Open the record of a rearrangement starting at ``step`` (``scale``: the generation it serves)."""
        self.current = self.reporter.begin(step, forced, scale)

    def finish(self, outcome: str, reason: str | None = None) -> None:
        """Close the rearrangement in flight (a ``history`` entry and a ``rearrangement`` record)."""
        if self.current is not None:
            self.reporter.finish(self.current, outcome, reason, steps=self.counters.steps,
                                 num_layers=self.machine.num_layers, state=self.machine.state)
            self.current = None

    def all_reduce_or_fail(self, parts: dict, timeout_s: float, **fields: Any) -> dict | None:
        """The collectives' all-reduce; None after a broken group sent the machine to failed."""
        with faults.interruptible(self, "an all-reduce"):
            try:
                return self.collectives.all_reduce(parts, timeout_s, **fields)
            except GroupBroken as exc:
                self.group_fault(exc)
                return None

    # ------------------------------------------------------------------ plan
    def plan(self, reduced: dict[str, torch.Tensor]) -> None:
        """Act on the all-reduced :meth:`planning_parts`: refuse maps the ranks do not share, reject the
        load, or plan (sync) / start the policy job (async)."""
        with faults.interruptible(self, "planning"):
            self._plan(reduced)

    def _plan(self, reduced: dict[str, torch.Tensor]) -> None:
        differ = recovery.differing(recovery.map_items(self.models), reduced["maps"].tolist(),
                                    self.collectives.world_size) if "maps" in reduced else []
        if differ:
            self.abort(recovery.different_maps(differ), recoverable=False, kind="rejected")
            return
        flat_loads = reduced["loads"]
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
        whose content changes; with none the machine goes straight on to ``scaling``. Unlike
        :meth:`planning_parts` it carries no maps digest: the serving ranks compared their maps
        in the scale's ``scale_check`` agreement before anything was built, and joiners start
        from rank 0's (``eplb_fsm.elastic.scaling``). Its ``fault`` records carry ``scale``.
        """
        loads = self.local_loads()
        self.begin(self.counters.steps, forced=True, scale=scale)
        with faults.interruptible(self, "the scale's rearrangement"):
            return self._run_forced(make_plan, fields, scale, loads)

    def _run_forced(self, make_plan: Callable[[list[torch.Tensor]], Plan], fields: dict, scale: int,
                    loads: torch.Tensor) -> str:
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
        """``layer_done`` (every rank has it), then write it (``pending`` None: unchanged layer).

        A write that raises part-way is noted (:func:`~eplb_fsm.fsm.faults.broken_commit`) and told
        in the next agreement; one that raises a ``KeyboardInterrupt`` (any non-``Exception``) goes
        on up, and the guard around sends the machine to ``failed`` at once.
        """
        plan = self.current.plan
        entry, local = self.mover.locate(layer)
        extra = {"model": entry.name, "model_layer": local, "moved": plan.moved[layer], "changed": plan.changed[layer]}
        if pending is not None and self.worker is not None:   # an async layer job: when its flags could say ready
            extra.update(chunks=self.current.chunks, ready_step=self.current.ready_step)
        fired = self.fire("layer_done", extra=extra, layer=layer)
        try:
            self.mover.write(plan.new_phy2log, layer, pending)
        except BaseException as exc:
            self.broken_commit(layer, exc)
            if not isinstance(exc, Exception):
                raise
            return fired
        self.current.layers_committed += 1
        return fired

    def committed(self) -> str:
        """Every layer is written: ``committed`` and the record; returns the destination."""
        fields = Reporter.summary_fields(self.current, self.counters.steps)
        fired = self.fire("committed", extra=fields)
        self.finish("committed")
        return fired.dest

    def run_sync(self) -> str:
        """Sync mode: each changed layer transferred, agreed by all ranks, committed, then one agreement
        that every rank wrote its layers whole; returns the end state."""
        plan = self.current.plan
        with faults.interruptible(self, "the sync rearrangement"):
            for layer in range(self.machine.num_layers):
                pending = None
                if plan.changed[layer]:
                    error: BaseException | None = None
                    try:
                        pending = self.mover.transfer(plan.new_phy2log, layer)
                    except Exception as exc:
                        error = exc
                    dest = self.agree(layer, error)
                    if dest is not None:
                        return dest
                self.commit_layer(layer, pending)
            assert self.machine.state == COMMITTING, self.machine.state
            return self.agree(None, None) or self.committed()

    def agree(self, layer: int | None, error: BaseException | None) -> str | None:
        """Sync mode: all-reduce [ready, failed, late, broken] on ``layer``'s transfer (None: after the last
        commit); None: go on, else where the fault that every rank fires on it led."""
        broken = 1.0 if self.current.broken else 0.0
        # a peer may itself be waiting out a transfer timeout first
        agreed = self.all_reduce_or_fail({"ready": flags(0.0 if error else 1.0, 1.0 if error else 0.0, 0.0, broken)},
                                         2 * self.timeout_s, **({} if layer is None else {"layer": layer}))
        if agreed is None:
            return FAILED
        verdict = decide_layer(agreed["ready"])
        if verdict.action != ABORT:
            return None
        if verdict.broken:
            return self.commit_fault(verdict.broken)
        return self.transfer_fault(layer, error, verdict.failed)

    # ------------------------------------------------------ async mode (fsm/async_flow.py)
    ready_flags = async_flow.ready_flags
    poll = async_flow.poll
    post_poll = async_flow.post_poll
    settle = async_flow.settle
    progress = async_flow.progress
    advance = async_flow.advance
    drain = async_flow.drain

    # ---------------------------------------------------------------- faults (fsm/faults.py)
    abort = faults.abort
    group_fault = faults.group_fault
    transfer_fault = faults.transfer_fault
    broken_commit = faults.broken_commit
    commit_fault = faults.commit_fault
    reset_transfers = recovery.reset_transfers   # after a transfer fault (fsm/recovery.py)
    recover = recovery.recover                   # EplbController.recover()
