"""Moving one layer's weights: into the buffer, then into the weights (local I/O, no decisions).

The controller owns one :class:`LayerMover` (``controller.mover``). A layer's transfer
fills its model's one-layer buffer over the transfer group and leaves the weights
untouched (:meth:`LayerMover.transfer`); once every rank has it, :meth:`LayerMover.write`
writes the weights and flips the layer's maps in one go, so what the router sees always
matches the weights. In async mode the worker runs ``transfer`` on its own thread;
:func:`ready_flags` is what this rank says about that job in the step's all-reduce.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from eplb_fsm.fsm.collectives import Collectives, flags
from eplb_fsm.fsm.model_entry import ModelEntry
from eplb_fsm.fsm.worker import StepPacer
from eplb_fsm.transfer import commit_layer_from_buffer, rearrange_expert_weights_inplace, transfer_layer_to_buffer

__all__ = ["LayerMover", "ready_flags"]


class LayerMover:
    """Transfers and writes layers of the controller's models (global layer index: models concatenated).

    ``models``: the controller's list of :class:`ModelEntry` (shared, grows with
    ``add_model``); ``hooks``: called as ``hook(global_layer, model_name, model_layer)`` right
    before a layer's transfer, in the thread that runs it (raising = a transfer error).
    ``max_bytes_per_step`` > 0 (async mode's ``async_max_bytes_per_step``): a layer's messages
    go in chunks of at most that many bytes, waiting for the next engine step (``trace.step``
    advancing) between two (:class:`~eplb_fsm.fsm.worker.StepPacer`).
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

    def locate(self, layer: int) -> tuple[ModelEntry, int]:
        """The model a global layer index belongs to, and the layer's index within it."""
        for entry in self.models:
            if layer < entry.layer_offset + entry.num_layers:
                return entry, layer - entry.layer_offset
        raise IndexError(f"layer {layer} is outside the {sum(e.num_layers for e in self.models)} layers")

    def transfer(self, new_phy2log: Sequence[Any], layer: int) -> Any:
        """Move one layer's weights into its model's buffer (weights untouched); returns the pending layer.

        ``new_phy2log``: the plan's per-model (L, P) placements.
        """
        entry, local = self.locate(layer)
        for hook in list(self.hooks):
            hook(layer, entry.name, local)
        comm = self.collectives
        pacer = None
        if self.max_bytes_per_step > 0:
            pacer = StepPacer(lambda: self.trace.step)
            pacer.begin()
        try:
            return transfer_layer_to_buffer(
                entry.maps.phy2log[local].copy(), new_phy2log[entry.index][local],
                comm.wrap(entry.model.expert_weights[local]), entry.buffer, layer=layer,
                communicator=comm.communicator, trace=self.trace, migration_batching=self.batching,
                max_chunk_bytes=self.max_bytes_per_step, between_chunks=pacer.wait if pacer else None,
            )
        finally:
            if pacer is not None:
                self.chunk_boundaries += pacer.calls
                self.chunk_waits += pacer.waits
                self.chunk_timeouts += pacer.timeouts

    def write(self, new_phy2log: Sequence[Any], layer: int, pending: Any) -> None:
        """Write a transferred layer's weights and flip its maps (``pending`` None: unchanged layer, no-op)."""
        if pending is None:
            return
        entry, local = self.locate(layer)
        commit_layer_from_buffer(pending, self.collectives.wrap(entry.model.expert_weights[local]))
        entry.commit_row(local, new_phy2log[entry.index][local])

    def reserve(self) -> int:
        """Reserve each model's transfer buffer (transfer profile mode); returns the bytes reserved."""
        reserved = 0
        comm = self.collectives
        for entry in self.models:
            current = entry.maps.phy2log
            rearrange_expert_weights_inplace(
                current, current, comm.wrap(entry.model.expert_weights), communicator=comm.communicator,
                is_profile=True, buffer=entry.buffer,
            )
            reserved += entry.buffer.nbytes
            entry.window.load_pass.zero_()  # the profile pass's counts are not real load
        return reserved

    def invalidate_buffers(self) -> None:
        """After an abort: any stale pending layer can no longer be committed."""
        for entry in self.models:
            entry.buffer.generation += 1


def ready_flags(job: Any, timeout_s: float) -> torch.Tensor:
    """This rank's (3,) [ready, failed, late] for the async job in flight (summed over ranks)."""
    if job is None:
        return flags(1.0, 0.0, 0.0)
    if job.done():
        failed = job.error() is not None
        return flags(0.0 if failed else 1.0, 1.0 if failed else 0.0, 0.0)
    late = job.age() > timeout_s
    return flags(0.0, 0.0, 1.0 if late else 0.0)
