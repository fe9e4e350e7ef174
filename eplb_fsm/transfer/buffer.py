"""The executor's reusable receive buffer: one (or two) layers' worth of weight rows per local rank.

With one layer (the default), layer k's receives land in the rows layer k-1's commit
still reads, so the executor holds those receives until that part of the commit ran
(docs/transfer.md, "Two phases"). With two layers, consecutive layers alternate between
them: layer k-1's whole commit runs while every message of layer k is in flight, at the
price of one more layer of rows per local rank.
"""

from __future__ import annotations

import threading
from typing import Sequence

import torch

from eplb_fsm.transfer.inputs import layout

__all__ = ["TransferBuffer", "default_buffer", "default_buffer_lock"]


class TransferBuffer:
    """Reusable buffer rows per local rank, across layers and calls.

    ``layers``: 1 or 2, how many layers' rows it holds (2: layer k uses part ``k % 2``).
    ``ensure(rank, layer_weights, part=0)`` returns the rank's tensors of that part
    (contiguous, same shapes/dtypes/devices as the layer's weights), allocating only when
    the layout changed. ``allocations`` counts allocations (profile mode reserves every
    part up front). ``generation`` advances on every transfer so a stale pending commit is
    caught.
    """

    def __init__(self, layers: int = 1) -> None:
        if isinstance(layers, bool) or not isinstance(layers, int) or layers not in (1, 2):
            raise ValueError(f"layers: must be 1 or 2 (layers of rows the buffer holds), got {layers!r}")
        self.layers = layers
        self._by_part: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.allocations = 0
        self.generation = 0

    def ensure(self, rank: int, layer_weights: Sequence[torch.Tensor], part: int = 0) -> list[torch.Tensor]:
        if not 0 <= part < self.layers:
            raise ValueError(f"part: must be in [0, {self.layers}) for a buffer of {self.layers} layer(s), got {part}")
        current = self._by_part.get((rank, part))
        if current is not None and layout(current) == layout(layer_weights):
            return current
        tensors = [torch.empty(tuple(w.shape), dtype=w.dtype, device=w.device) for w in layer_weights]
        self._by_part[(rank, part)] = tensors
        self.allocations += 1
        return tensors

    def tensors(self, rank: int, part: int = 0) -> list[torch.Tensor]:
        return self._by_part[(rank, part)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self._by_part.values() for t in ts)

    def release(self) -> None:
        """Drop every tensor (the next use allocates again)."""
        self._by_part.clear()


_DEFAULT_BUFFER = TransferBuffer()
_DEFAULT_LOCK = threading.Lock()


def default_buffer() -> TransferBuffer:
    """The buffer :func:`~eplb_fsm.transfer.execute.rearrange_expert_weights_inplace` uses when none is given."""
    return _DEFAULT_BUFFER


def default_buffer_lock() -> threading.Lock:
    """Serialises the calls that share :func:`default_buffer`."""
    return _DEFAULT_LOCK
