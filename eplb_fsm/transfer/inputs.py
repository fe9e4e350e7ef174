"""Checks of the executor's inputs: every one runs before the first copy or message.

Weights come per layer as a list of tensors shaped ``(S, ...)`` (S = P / G rows, one per
local slot); every layer must have the first layer's :data:`Layout` (shapes, dtypes,
devices), since one buffer serves every layer. A communicator that plays several ranks
takes a list over its local ranks wherever one rank takes a single value. Bad input
raises ``ValueError`` naming the argument and the rule.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from eplb_fsm.transfer.communicator import Communicator, TorchDistCommunicator

__all__ = [
    "Layout",
    "check_all_weights",
    "check_layer_tensors",
    "check_layer_weights",
    "layout",
    "per_rank",
    "resolve_communicator",
    "traces_for",
]

Layout = tuple[tuple[tuple[int, ...], torch.dtype, torch.device], ...]


def layout(tensors: Sequence[torch.Tensor]) -> Layout:
    return tuple((tuple(t.shape), t.dtype, t.device) for t in tensors)


def resolve_communicator(group: Any, communicator: Communicator | None, timeout: float | None) -> Communicator:
    if communicator is not None:
        if group is not None:
            raise ValueError("group: give a process group or a communicator, not both")
        for attr in ("world_size", "local_ranks", "add_send", "add_recv", "execute"):
            if not hasattr(communicator, attr):
                raise ValueError(f"communicator: missing {attr!r} (see eplb_fsm.transfer.Communicator)")
        return communicator
    return TorchDistCommunicator(group, timeout=timeout)


def check_layer_tensors(name: str, tensors: Any, rows: int, ref: Layout | None) -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise ValueError(f"{name}: must be a list of tensors shaped (S, ...)")
    out = list(tensors)
    for t, w in enumerate(out):
        if not isinstance(w, torch.Tensor):
            raise ValueError(f"{name}[{t}]: must be a torch.Tensor, got {type(w).__name__}")
        if w.ndim < 1 or w.shape[0] != rows:
            raise ValueError(
                f"{name}[{t}]: has shape {tuple(w.shape)}; its first dim must be S = P / G = {rows} rows"
            )
    if ref is not None and layout(out) != ref:
        raise ValueError(
            f"{name}: tensors {[(tuple(s), str(d)) for s, d, _ in layout(out)]} must match the first layer's "
            f"{[(tuple(s), str(d)) for s, d, _ in ref]} (shape, dtype, device): one buffer serves every layer"
        )
    return out


def per_rank(comm: Communicator, value: Any, name: str) -> dict[int, Any]:
    ranks = tuple(comm.local_ranks)
    if getattr(comm, "multi_rank", False):
        if isinstance(value, torch.Tensor) or not isinstance(value, Sequence) or len(value) != len(ranks):
            raise ValueError(
                f"{name}: with a communicator that plays {len(ranks)} ranks, give a list over those ranks"
            )
        return dict(zip(ranks, value))
    return {ranks[0]: value}


def check_all_weights(
    comm: Communicator, expert_weights: Any, num_layers: int, rows: int
) -> dict[int, list[list[torch.Tensor]]]:
    by_rank = per_rank(comm, expert_weights, "expert_weights")
    ref: Layout | None = None
    out: dict[int, list[list[torch.Tensor]]] = {}
    for r, layers in by_rank.items():
        name = f"expert_weights[{r}]" if getattr(comm, "multi_rank", False) else "expert_weights"
        if isinstance(layers, torch.Tensor) or not isinstance(layers, Sequence) or len(layers) != num_layers:
            got = len(layers) if isinstance(layers, Sequence) else type(layers).__name__
            raise ValueError(f"{name}: must be a list over the L={num_layers} layers of the maps, got {got}")
        checked = []
        for k, layer in enumerate(layers):
            checked.append(check_layer_tensors(f"{name}[{k}]", layer, rows, ref))
            if ref is None:
                ref = layout(checked[-1])
        out[r] = checked
    return out


def check_layer_weights(
    comm: Communicator, layer_weights: Any, rows: int
) -> dict[int, list[torch.Tensor]]:
    by_rank = per_rank(comm, layer_weights, "layer_weights")
    ref: Layout | None = None
    out = {}
    for r, tensors in by_rank.items():
        name = f"layer_weights[{r}]" if getattr(comm, "multi_rank", False) else "layer_weights"
        out[r] = check_layer_tensors(name, tensors, rows, ref)
        ref = layout(out[r]) if ref is None else ref
    return out


def traces_for(trace: Any, comm: Communicator) -> list[tuple[Any, int | None]]:
    """(trace, rank or None) pairs: one trace per local rank, or one for the whole process."""
    if trace is None:
        return []
    if isinstance(trace, Sequence) and not isinstance(trace, (str, bytes)):
        ranks = tuple(comm.local_ranks)
        if len(trace) != len(ranks):
            raise ValueError(f"trace: a list of traces must have one per local rank ({len(ranks)}), got {len(trace)}")
        return [(t, r) for t, r in zip(trace, ranks) if t is not None]
    ranks = tuple(comm.local_ranks)
    return [(trace, ranks[0] if len(ranks) == 1 else None)]
