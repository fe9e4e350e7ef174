"""Driving the ``transferring`` state: move a layer's weights, agree, commit, advance.

Sync mode (:meth:`TransfersMixin._sync_transfer`) moves every layer inside one call:
each changed layer is transferred into its model's one-layer buffer, all ranks agree in
one all-reduce that every rank has it, then the layer is committed (weights written,
maps flipped). Async mode hands each layer to the background worker; every step
all-reduces the ready flags of the job in flight (:meth:`TransfersMixin._ready_flags`)
and :meth:`TransfersMixin._async_progress` acts on their sum, so a layer is committed on
the same step on every rank.
"""

from __future__ import annotations

from typing import Any

import torch

from eplb_fsm.fsm.collectives import GroupBroken, flags
from eplb_fsm.fsm.machine import COMMITTING, PLANNING, TRANSFERRING, Fired
from eplb_fsm.fsm.model_entry import ModelEntry
from eplb_fsm.transfer import commit_layer_from_buffer, rearrange_expert_weights_inplace, transfer_layer_to_buffer

__all__ = ["TransfersMixin"]


class TransfersMixin:
    """Layer transfers and commits for :class:`~eplb_fsm.fsm.controller.EplbController`.

    Uses ``models``, ``machine``, ``worker``, ``transfer_hooks``, ``_current`` (its
    ``plan`` and ``job``), ``_communicator`` and ``_timeout``; ends through ``_fire``,
    ``_finish``, ``_abort``, ``_transfer_fault`` and ``_group_fault``.
    """

    def _profile_step(self) -> None:
        """Reserve each model's transfer buffer (transfer profile mode); nothing else changes."""
        reserved = 0
        for entry in self.models:
            current = entry.maps.phy2log
            rearrange_expert_weights_inplace(
                current, current, self._wrap(entry.model.expert_weights), communicator=self._communicator,
                is_profile=True, buffer=entry.buffer,
            )
            reserved += entry.buffer.nbytes
            entry.window.load_pass.zero_()  # the profile pass's counts are not real load
        self.trace.emit("profile", buffer_bytes=reserved)

    def _locate(self, layer: int) -> tuple[ModelEntry, int]:
        """The model a global layer index belongs to, and the layer's index within it."""
        for entry in self.models:
            if layer < entry.layer_offset + entry.num_layers:
                return entry, layer - entry.layer_offset
        raise IndexError(f"layer {layer} is outside the {self.num_layers} layers")

    def _transfer_layer(self, layer: int) -> Any:
        """Move one layer's weights into its model's buffer (weights untouched); returns the pending layer."""
        entry, local = self._locate(layer)
        for hook in list(self.transfer_hooks):
            hook(layer, entry.name, local)
        new_row = self._current.plan.new_phy2log[entry.index][local]
        return transfer_layer_to_buffer(
            entry.maps.phy2log[local].copy(), new_row, self._wrap(entry.model.expert_weights[local]),
            entry.buffer, layer=layer, communicator=self._communicator, trace=self.trace,
            migration_batching=self.config.enable_migration_batching,
        )

    def _commit_layer(self, layer: int, pending: Any) -> Fired:
        """``layer_done`` (every rank has the layer), then write its weights and flip its maps in one go.

        ``pending`` None: an unchanged layer. The last layer is written in ``committing``;
        returns what ``layer_done`` fired.
        """
        entry, local = self._locate(layer)
        plan = self._current.plan
        fired = self._fire("layer_done", extra={"model": entry.name, "model_layer": local,
                                                "moved": plan.moved[layer], "changed": plan.changed[layer]},
                           layer=layer)
        if pending is not None:
            commit_layer_from_buffer(pending, self._wrap(entry.model.expert_weights[local]))
            entry.commit_row(local, plan.new_phy2log[entry.index][local])
        self._current.layers_committed += 1
        return fired

    def _commit_failed(self, layer: int, exc: BaseException) -> str:
        """A local copy failed half-way through a commit: the weights can't be trusted."""
        return self._abort(f"commit of layer {layer} failed: {type(exc).__name__}: {exc}", recoverable=False)

    def _committed(self) -> str:
        """Every layer is in: ``committed`` and the rearrangement's record; returns the destination."""
        fired = self._fire("committed", extra=self._summary_fields())
        self._finish("committed")
        return fired.dest

    # ---------------------------------------------------------------------- sync
    def _sync_transfer(self) -> str:
        """Sync mode: every layer, each transferred, agreed on by all ranks, then committed.

        Returns the state it ends in (what the last event fired led to).
        """
        plan = self._current.plan
        for layer in range(self.machine.num_layers):
            if not plan.changed[layer]:
                fired = self._commit_layer(layer, None)
                continue
            error: BaseException | None = None
            pending = None
            try:
                pending = self._transfer_layer(layer)
            except Exception as exc:
                error = exc
            # [ready, failed, late], summed over ranks
            ready = flags(0.0 if error else 1.0, 1.0 if error else 0.0, 0.0)
            # a peer may itself be waiting out a transfer timeout before it reaches this all-reduce
            try:
                agreed = self._all_reduce({"ready": ready}, 2 * self._timeout, layer=layer)["ready"]
            except GroupBroken as exc:
                return self._group_fault(exc)
            if agreed[1] > 0:
                return self._transfer_fault(layer, error, int(agreed[1]))
            try:
                fired = self._commit_layer(layer, pending)
            except Exception as exc:
                return self._commit_failed(layer, exc)
        assert fired.dest == COMMITTING, fired
        return self._committed()

    # --------------------------------------------------------------------- async
    def _ready_flags(self) -> torch.Tensor:
        """This rank's (3,) [ready, failed, late] for the job in flight (summed over ranks)."""
        job = self._current.job
        if job is None:
            return flags(1.0, 0.0, 0.0)
        if job.done():
            failed = job.error() is not None
            return flags(0.0 if failed else 1.0, 1.0 if failed else 0.0, 0.0)
        late = job.age() > self._timeout
        return flags(0.0, 0.0, 1.0 if late else 0.0)

    def _async_progress(self, summed: torch.Tensor) -> None:
        """Act on the all-reduced (3,) ready flags: fault, wait another step, or take the job's result."""
        ready, failed, late = (int(round(float(v))) for v in summed)
        current = self._current
        state = self.machine.state
        if failed or late:
            error = current.job.error() if current.job is not None else None
            what = "policy" if state == PLANNING else f"transfer of layer {self.machine.layer}"
            reason = (f"{what} failed on {failed} rank(s)" if failed else
                      f"{what} ran past collective_timeout_s={self._timeout} on {late} rank(s)")
            if state == PLANNING:
                self._abort(reason + (f": {type(error).__name__}: {error}" if error else ""), recoverable=True)
            else:
                self._transfer_fault(self.machine.layer, error, failed, late=late)
            return
        if ready < self.world:
            return  # not everywhere yet: the next step asks again
        job = current.job
        current.job = None
        if state == PLANNING:
            if self._accept_plan(job.result(timeout=0)):
                self._async_advance()
            return
        job.wait_stream()
        layer = self.machine.layer
        try:
            fired = self._commit_layer(layer, job.result(timeout=0))
        except Exception as exc:
            self._commit_failed(layer, exc)
            return
        self._async_advance(fired.dest)

    def _async_advance(self, state: str = TRANSFERRING) -> None:
        """From ``state`` (where the last event led): commit unchanged layers at once, start the
        next changed layer, or finish."""
        plan = self._current.plan
        while state == TRANSFERRING:
            layer = self.machine.layer
            if plan.changed[layer]:
                self._current.job = self.worker.submit(self._transfer_layer, layer, kind="transfer", layer=layer)
                return
            state = self._commit_layer(layer, None).dest
        if state == COMMITTING:
            self._committed()
