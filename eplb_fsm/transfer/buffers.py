"""The buffers a transfer lands in, and a layer waiting in one for its commit."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from eplb_fsm.transfer.inputs import Placement, layout
from eplb_fsm.transfer.plan import LayerPlan
from eplb_fsm.transfer.schedule import Commit

__all__ = ["PendingLayer", "TransferBuffer"]


class TransferBuffer:
    """``layers`` layers' worth of weight rows per local rank, reused across layers and calls.

    ``ensure(rank, layer_weights, index)`` returns the rank's buffer tensors of layer
    ``index`` < ``layers`` (contiguous, same shapes/dtypes/devices as the layer's weights),
    allocating only when the layout changed. ``layers=2`` costs one more layer of memory
    and is used by :func:`rearrange_expert_weights_inplace` only: layer k's messages land in
    one half while layer k-1's commit reads the other, so no receive waits for that commit
    (the one-layer entry points use the first half). ``allocations`` counts allocations
    (profile mode reserves every half up front). ``generation`` advances on every transfer,
    allocation and release, so a pending commit whose rows were since replaced is caught.

    Every rank of a group must use the same ``layers`` for
    :func:`rearrange_expert_weights_inplace`: it decides how a layer's first wave is posted
    (one or two phases, with or without tags), and ranks that differ wait for messages the
    other side never sends (a hang until the group's timeout). Nothing checks this across
    ranks. Buffer tensors are always allocated outside ``torch.inference_mode()``, so a
    buffer first used under it still takes writes outside it.
    """

    def __init__(self, layers: int = 1) -> None:
        if isinstance(layers, bool) or not isinstance(layers, int) or layers not in (1, 2):
            raise ValueError(f"layers: must be 1 or 2 (layers of rows held per rank), got {layers!r}")
        self.layers = layers
        self._by_rank: dict[int, list[list[torch.Tensor] | None]] = {}
        self.allocations = 0
        self.generation = 0

    def ensure(self, rank: int, layer_weights: Sequence[torch.Tensor], index: int = 0) -> list[torch.Tensor]:
        """``rank``'s buffer layer ``index``: a tensor (S, ...) like each of ``layer_weights``, reallocated
        (advancing ``generation``) only when their layout changed; call it after the input checks."""
        halves = self._by_rank.setdefault(rank, [None] * self.layers)
        current = halves[index]
        if current is not None and layout(current) == layout(layer_weights):
            return current
        with torch.inference_mode(False):  # a normal tensor: writable inside inference mode and out of it
            tensors = [torch.empty(tuple(w.shape), dtype=w.dtype, device=w.device) for w in layer_weights]
        halves[index] = tensors
        self.allocations += 1
        self.generation += 1  # a layer still pending in the old rows can no longer commit
        return tensors

    def tensors(self, rank: int, index: int = 0) -> list[torch.Tensor]:
        """``rank``'s buffer layer ``index`` as allocated (tensors (S, ...)); ``KeyError`` if it has none."""
        tensors = self._by_rank[rank][index]
        if tensors is None:
            raise KeyError(f"rank {rank} has no buffer layer {index}")
        return tensors

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for halves in self._by_rank.values() for ts in halves if ts
                   for t in ts)

    def release(self) -> None:
        """Drop every tensor (the next use allocates again; a pending layer can no longer commit)."""
        self._by_rank.clear()
        self.generation += 1


@dataclass
class PendingLayer:
    """A layer whose messages have landed in the buffer and wait for their commit.

    ``failed``: its commit raised part-way (the layer may be partly written); it cannot be
    committed again (its direct copies chain rows, so a second run would read rows the
    first one already overwrote).
    """

    layer: int
    plans: dict[int, LayerPlan]
    buffer: TransferBuffer
    generation: int
    layouts: dict[int, Placement]   # per rank: which tensors (memory, not only layout) the commit must get
    communicator: Any = field(repr=False, default=None)
    committed: bool = False
    commits: dict[int, "Commit"] | None = field(repr=False, default=None)
    failed: bool = False

    @property
    def moved_rows(self) -> int:
        """Rows this process will write at commit (local + primary + duplicate)."""
        return sum(p.local_rows.size + p.primary_rows.size + p.duplicate_rows.size for p in self.plans.values())
