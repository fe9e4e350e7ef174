"""Moving one layer's weights: into the buffer, then into the weights (local I/O, no decisions).

The controller owns one :class:`LayerMover` (``controller.mover``). A layer's transfer
fills its model's one-layer buffer over the transfer group and leaves the weights
untouched (:meth:`LayerMover.transfer`); once every rank has it, :meth:`LayerMover.write`
writes the weights and flips the layer's maps in one go, so what the router sees always
matches the weights. In async mode the worker runs ``transfer`` on its own thread;
:func:`ready_flags` is what this rank says about that job in the step's all-reduce.

What a commit needs that depends only on the layer's old and new placement (the new
maps row, validated, and the index plan that re-expresses the load window in it) is
worked out by ``transfer`` too (:class:`PreparedRow`, on the worker in async mode), so
the commit on the engine thread is the weights' copy, row assignments and a few
gathers over the window: no validation, no map derivation.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import torch

from eplb_fsm.fsm.collectives import Collectives, flags
from eplb_fsm.fsm.model_entry import ModelEntry
from eplb_fsm.fsm.pacing import StepPacer
from eplb_fsm.maps import ExpertMaps
from eplb_fsm.stats import RemapPlan
from eplb_fsm.transfer import (TransferBuffer, commit_layer_from_buffer, rearrange_expert_weights_inplace,
                               transfer_layer_to_buffer)
from eplb_fsm.transfer.chunks import chunk_count, message_count, row_bytes

__all__ = ["LayerMover", "PreparedRow", "TransferredLayer", "ready_flags"]


class PreparedRow:
    """One layer's commit of maps and window, worked out from its old and new rows alone.

    ``old_row``, ``new_row``: (P,) int64 placements (-1: empty slot). Validates ``new_row``
    as :meth:`ExpertMaps.replace_layer` does (raises ``ValueError`` naming the rule) and
    derives its (N, K) log2phy and (N,) replica counts. :meth:`apply` then flips the
    entry's maps and re-expresses the window's held passes in the new placement with the
    same :class:`~eplb_fsm.stats.RemapPlan` that :meth:`ModelEntry.commit_row` uses (each
    expert's count split evenly over its new slots, the remainder to its first slot).
    """

    def __init__(self, maps: ExpertMaps, old_row: np.ndarray, new_row: np.ndarray, device: Any = None) -> None:
        n = maps.num_logical
        row = ExpertMaps.from_phy2log(np.asarray(new_row).reshape(1, -1), n, max_replicas=maps.max_replicas,
                                      allow_empty=True)
        if row.num_physical != maps.num_physical:
            raise ValueError(f"new_row must have {maps.num_physical} slots, got {row.num_physical}")
        self.old_row = np.asarray(old_row, dtype=np.int64).copy()
        self.new_row = row.phy2log[0]
        self.log2phy, self.counts = row.log2phy[0], row.replica_count[0]     # (N, K), (N,)
        self.remap = RemapPlan.of(self.old_row, self.new_row, n, device)

    def apply(self, entry: Any, layer: int) -> None:
        """Flip ``entry``'s maps row ``layer`` and remap its window (nothing changes on error)."""
        self.install(entry, layer, self.remapped_window(entry, layer))

    def remapped_window(self, entry: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The (W, P) window passes of ``layer`` in the new placement, and its (P,) pass counted so
        far while the window's ``pass_open`` (else None); checks, changes nothing.

        Raises ``ValueError`` if the layer's maps are no longer the old row, or if the new
        row leaves out an expert that has load in the window or the pass.
        """
        if not np.array_equal(entry.maps.phy2log[layer], self.old_row):
            raise ValueError(f"layer {layer}'s maps changed since its commit was prepared")
        window = entry.window
        return (self.remap.apply(window.window[:, layer, :], entry.num_logical),
                window.remapped_pass(layer, self.remap, entry.num_logical))

    def install(self, entry: Any, layer: int, rows: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        """Write the new maps row and the window and pass ``rows`` (:meth:`remapped_window`),
        hand the router its maps."""
        window_rows, pass_row = rows
        maps = entry.maps
        maps.phy2log[layer] = self.new_row
        maps.log2phy[layer] = self.log2phy
        maps.replica_count[layer] = self.counts
        maps.allow_empty = maps.allow_empty or bool((self.new_row < 0).any())   # mid-scale maps from here on
        entry.window.window[:, layer, :].copy_(window_rows)
        if pass_row is not None:
            entry.window.load_pass[layer].copy_(pass_row)
        entry.publish_row(layer)


class TransferredLayer(NamedTuple):
    """What :meth:`LayerMover.transfer` hands to :meth:`LayerMover.write`: the buffer's pending
    layer, and the layer's maps and window commit worked out ahead (:class:`PreparedRow`)."""

    pending: Any
    prepared: PreparedRow


class LayerMover:
    """Transfers and writes layers of the controller's models (global layer index: models concatenated).

    ``models``: the controller's list of :class:`ModelEntry` (shared, grows with
    ``add_model``); ``hooks``: called as ``hook(global_layer, model_name, model_layer)`` right
    before a layer's transfer, in the thread that runs it (raising = a transfer error).
    ``max_bytes_per_step`` > 0 (async mode's ``async_max_bytes_per_step``): a layer's messages
    go in chunks of at most that many bytes, waiting for the next engine step (``trace.step``
    advancing) between two (:class:`~eplb_fsm.fsm.pacing.StepPacer`).
    """

    def __init__(self, models: list[ModelEntry], collectives: Collectives, trace: Any, batching: bool,
                 hooks: list[Callable[[int, str, int], None]], max_bytes_per_step: int = 0) -> None:
        self.models = models
        self.collectives = collectives
        self.trace = trace
        self.batching = bool(batching)
        self.hooks = hooks
        self.max_bytes_per_step = int(max_bytes_per_step)
        self.chunk_boundaries = 0  # chunk boundaries crossed (all layers): each needs an engine step
        self.chunk_waits = 0     # of those, the ones that waited for the next engine step
        self.chunk_timeouts = 0  # of those, the waits that ended by the pacer's limit instead
        self.step_advanced = threading.Event()   # set by the engine thread each step: wakes the pacer
        self.closing = threading.Event()         # set by stop_pacing(): chunks go without waiting

    def stop_pacing(self) -> None:
        """From now on a paced transfer waits for no engine step (the worker is closing)."""
        self.closing.set()
        self.step_advanced.set()   # a chunk waiting for the next step now

    def locate(self, layer: int) -> tuple[ModelEntry, int]:
        """The model a global layer index belongs to, and the layer's index within it."""
        for entry in self.models:
            if layer < entry.layer_offset + entry.num_layers:
                return entry, layer - entry.layer_offset
        raise IndexError(f"layer {layer} is outside the {sum(e.num_layers for e in self.models)} layers")

    def transfer(self, new_phy2log: Sequence[Any], layer: int, spare: bool = False) -> Any:
        """Move one layer's weights into its model's buffer (weights untouched); returns a
        :class:`TransferredLayer` (the pending layer and its prepared maps commit).

        ``new_phy2log``: the plan's per-model (L, P) placements. ``spare``: into the model's
        second buffer (``async_prefetch``: the next layer's, while this one awaits its commit).
        """
        entry, local = self.locate(layer)
        buffer = self.buffer(entry, spare)
        for hook in list(self.hooks):
            hook(layer, entry.name, local)
        old_row = entry.maps.phy2log[local].copy()
        prepared = PreparedRow(entry.maps, old_row, new_phy2log[entry.index][local], entry.window.window.device)
        comm = self.collectives
        pacer = None
        if self.max_bytes_per_step > 0:
            pacer = StepPacer(lambda: self.trace.step, advanced=self.step_advanced, stop=self.closing)
            pacer.begin()
        try:
            pending = transfer_layer_to_buffer(
                old_row, new_phy2log[entry.index][local],
                comm.wrap(entry.model.expert_weights[local]), buffer, layer=layer,
                communicator=comm.communicator, trace=self.trace, migration_batching=self.batching,
                max_chunk_bytes=self.max_bytes_per_step, between_chunks=pacer.wait if pacer else None,
            )
            return TransferredLayer(pending, prepared)
        finally:
            if pacer is not None:
                self.chunk_boundaries += pacer.calls
                self.chunk_waits += pacer.waits
                self.chunk_timeouts += pacer.timeouts

    def chunks(self, new_phy2log: Sequence[Any], layer: int) -> int:
        """How many chunks :meth:`transfer` will cut ``layer`` into (1 unpaced): from the shared
        maps, the plan and the row size alone, so every rank counts alike."""
        if self.max_bytes_per_step <= 0:
            return 1
        entry, local = self.locate(layer)
        world = self.collectives.communicator.world_size    # the group the transfer runs on
        messages = message_count(entry.maps.phy2log[local], new_phy2log[entry.index][local], world)
        return chunk_count(messages, row_bytes(entry.model.expert_weights[local]), self.max_bytes_per_step)

    def chunk_counts(self, new_phy2log: Sequence[Any], changed: Sequence[bool]) -> list[int]:
        """:meth:`chunks` of every global layer (1 for an unchanged one), from the maps in use now."""
        return [self.chunks(new_phy2log, layer) if moves else 1 for layer, moves in enumerate(changed)]

    def write(self, new_phy2log: Sequence[Any], layer: int, pending: Any) -> None:
        """Write a transferred layer's weights and flip its maps (``pending`` None: unchanged layer, no-op).

        ``pending``: what :meth:`transfer` returned (a bare pending layer from elsewhere is
        committed the unprepared way, :meth:`ModelEntry.commit_row`).
        """
        if pending is None:
            return
        entry, local = self.locate(layer)
        prepared = rows = None
        if isinstance(pending, TransferredLayer):
            pending, prepared = pending
            # its checks before the weights change: a refused commit leaves the layer whole
            rows = prepared.remapped_window(entry, local)
        commit_layer_from_buffer(pending, self.collectives.wrap(entry.model.expert_weights[local]))
        if prepared is not None:
            prepared.install(entry, local, rows)
        else:
            entry.commit_row(local, new_phy2log[entry.index][local])

    def flip_broken(self, new_phy2log: Sequence[Any], layer: int) -> bool:
        """After ``layer``'s write raised part-way: give its maps the new row, as every peer whose write
        went through has them, so the engine reloads the layer's weights for the maps the ranks share
        (``recover(reloaded=...)``). Best effort; True when the maps hold the new row."""
        entry, local = self.locate(layer)
        new_row = np.asarray(new_phy2log[entry.index][local], dtype=np.int64)
        try:
            old_row = entry.maps.phy2log[local].copy()
            if not np.array_equal(old_row, new_row):   # else the maps (and window) had flipped before the error
                entry.window.remap_layer(local, old_row, new_row, entry.num_logical)
            entry.maps.replace_layer(local, new_row, allow_empty=True)
            entry.publish_row(local)
        except Exception:
            pass
        return bool(np.array_equal(entry.maps.phy2log[local], new_row))

    @staticmethod
    def buffer(entry: ModelEntry, spare: bool) -> TransferBuffer:
        """``entry``'s main buffer, or its second one (``async_prefetch``; made on first use)."""
        if not spare:
            return entry.buffer
        if entry.spare_buffer is None:
            entry.spare_buffer = TransferBuffer()
        return entry.spare_buffer

    def reserve(self, spare: bool = False) -> int:
        """Reserve each model's transfer buffer, and with ``spare`` its second one (transfer
        profile mode); returns the bytes reserved."""
        reserved = 0
        comm = self.collectives
        for entry in self.models:
            current = entry.maps.phy2log
            for buffer in (entry.buffer, self.buffer(entry, True)) if spare else (entry.buffer,):
                rearrange_expert_weights_inplace(
                    current, current, comm.wrap(entry.model.expert_weights), communicator=comm.communicator,
                    is_profile=True, buffer=buffer,
                )
                reserved += buffer.nbytes
            entry.window.load_pass.zero_()  # the profile pass's counts are not real load
        return reserved

    def invalidate_buffers(self) -> None:
        """After an abort: any stale pending layer can no longer be committed."""
        for entry in self.models:
            for buffer in (entry.buffer, entry.spare_buffer):
                if buffer is not None:
                    buffer.generation += 1


def ready_flags(job: Any, timeout_s: float, broken: bool = False) -> torch.Tensor:
    """This rank's (4,) [ready, failed, late, broken] for the async job in flight (summed over ranks).

    No job where one should be in flight (``job`` None) says failed, never ready. ``broken``:
    a commit of this rearrangement raised part-way on this rank (every rank then faults).
    """
    broke = 1.0 if broken else 0.0
    if job is None:
        return flags(0.0, 1.0, 0.0, broke)
    if job.done():
        failed = job.error() is not None
        return flags(0.0 if failed else 1.0, 1.0 if failed else 0.0, 0.0, broke)
    late = job.age() > timeout_s
    return flags(0.0, 0.0, 1.0 if late else 0.0, broke)
