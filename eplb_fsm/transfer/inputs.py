"""Checks of the executor's inputs: every one runs before the first copy or message.

Weights come per layer as a list of tensors shaped ``(S, ...)`` (S = P / G rows, one per
local slot), every layer with the first layer's :data:`Layout` (shapes, dtypes, devices:
one buffer serves every layer). A communicator that plays several ranks takes a list over
its local ranks wherever one rank takes a single value. Bad input raises ``ValueError``
naming the argument and the rule.

Weights the executor would move wrongly are refused before anything moves, with
:class:`UnmovableWeightsError` (a ``ValueError`` and a ``TransferError`` with
``committed_layers = 0``): elements that may share memory (a stride 0, as ``expand``
makes, or overlapping strides); a tensor (S, ..., 1) whose last stride is not 1 (torch
calls it contiguous, but its rows have no byte view; a (1,) vector moves row by row);
two tensors whose rows share memory (a weight listed twice: moving one would overwrite
the other); rows with no byte view or that torch cannot copy (sparse, MKL-DNN or nested
layouts, quantized tensors, whose scales would not travel either, and dtypes this torch
cannot view as bytes or ``copy_`` on that device, like the sub-byte ``torch.uint4``);
weights on the ``meta`` device (no memory: nothing would move); lazy conjugate and
negative views (``is_conj()`` or ``is_neg()``: their memory does not hold the values
they read as); an inference tensor when the call runs outside inference mode (torch
would copy into it, then raise, leaving a layer half written); weights off the CPU when
the communicator moves host memory only (gloo reads a tensor's memory as host memory),
off CUDA when it moves CUDA memory only (NCCL), and, on a group with a backend per
device, on a device none serves (the backend serving the weights' device decides).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from eplb_fsm.transfer.communicator import Communicator, TorchDistCommunicator, TransferError

__all__ = [
    "Layout",
    "Placement",
    "UnmovableWeightsError",
    "check_devices",
    "check_flag",
    "check_movable",
    "find_shared_memory",
    "refuse_shared_memory",
    "check_all_weights",
    "check_layer_tensors",
    "check_layer_weights",
    "layout",
    "per_rank",
    "placement",
    "resolve_communicator",
    "tell_device",
    "traces_for",
]

Layout = tuple[tuple[tuple[int, ...], torch.dtype, torch.device], ...]


def layout(tensors: Sequence[torch.Tensor]) -> Layout:
    """(shape, dtype, device) of each tensor (S, ...): what one buffer layer must match."""
    return tuple((tuple(t.shape), t.dtype, t.device) for t in tensors)


Placement = tuple[tuple[tuple[int, ...], torch.dtype, torch.device, int, tuple[int, ...], int], ...]


def placement(tensors: Sequence[torch.Tensor]) -> Placement:
    """Which memory each tensor (S, ...) is: its layout plus address, strides and storage offset.

    A pending layer's commit compares it: another layer's tensors of the same layout would
    otherwise be accepted and overwritten with this layer's experts.
    """
    return tuple((tuple(t.shape), t.dtype, t.device, t.data_ptr(), tuple(t.stride()), t.storage_offset())
                 for t in tensors)


def check_flag(value: Any, name: str) -> bool:
    """``value`` as a bool; anything but True/False (numpy's too) raises: ``"no"`` would read as True."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name}: must be True or False, got {value!r}")
    return bool(value)


def resolve_communicator(group: Any, communicator: Communicator | None, timeout: float | None) -> Communicator:
    """The ``communicator`` given (checked for the protocol's members), else one over ``group`` with ``timeout``."""
    if communicator is not None:
        if group is not None:
            raise ValueError("group: give a process group or a communicator, not both")
        if timeout is not None:  # it would be silently ignored: a communicator carries its own
            raise ValueError("timeout: give it to the communicator you pass (it carries its own), not beside it")
        for attr in ("world_size", "local_ranks", "add_send", "add_recv", "execute"):
            if not hasattr(communicator, attr):
                raise ValueError(f"communicator: missing {attr!r} (see eplb_fsm.transfer.Communicator)")
        return communicator
    return TorchDistCommunicator(group, timeout=timeout)


class UnmovableWeightsError(TransferError, ValueError):
    """Weights the executor cannot move correctly; raised before anything moves.

    ``committed_layers`` is 0 (every layer still holds its old weights); ``layer`` is the
    layer of the offending tensor when known.
    """

    def __init__(self, message: str, layer: int | None = None) -> None:
        super().__init__(message, layer=layer, committed_layers=0)


_PLAIN = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8, torch.int16,
                    torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128})  # any torch copies these


@functools.lru_cache(maxsize=None)
def _byte_copyable(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether torch copies (2,) tensors of ``dtype`` on ``device`` and views them as bytes (asked, not listed: the
    dtypes lacking a copy kernel vary with torch and device). An OOM is raised: not the dtype's, so never cached."""
    try:
        probe = torch.empty(2, dtype=dtype, device=device)
        return probe[:1].copy_(probe[1:]).view(torch.uint8) is not None
    except torch.cuda.OutOfMemoryError:
        raise
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def check_movable(name: str, t: torch.Tensor, layer: int | None = None) -> None:
    """Refuse a tensor (S, ...) whose layout the executor would move wrongly (see the module doc)."""
    if t.layout is not torch.strided or t.is_nested or t.dtype not in _PLAIN:  # first: the rules below read strides
        if t.layout is not torch.strided or t.is_nested or t.is_quantized:
            kind = (f"a quantized tensor ({t.dtype}; its scales would not travel either)" if t.is_quantized
                    else f"a {'nested' if t.is_nested else str(t.layout)} tensor")
            raise UnmovableWeightsError(
                f"{name}: is {kind}; rows travel as bytes, and only a dense strided, unquantized tensor's rows can "
                "be viewed as bytes: pass .to_dense(), or a quantized tensor's .int_repr() and its scales apart", layer)
        if not _byte_copyable(t.dtype, t.device):
            raise UnmovableWeightsError(
                f"{name}: has dtype {t.dtype}, which this torch cannot view as bytes or copy_ on {t.device.type} "
                "(rows travel as bytes and land with copy_): pack the weights into a uint8 tensor", layer)
    if t.is_inference() and not torch.is_inference_mode_enabled():
        raise UnmovableWeightsError(
            f"{name}: is an inference tensor (made under torch.inference_mode()) and this call runs outside "
            "inference mode, where torch refuses to write it in place (after copying into it, so a layer would be "
            "left half written); run the transfer under torch.inference_mode() (in the thread that calls it) "
            "or create the weights outside it", layer)
    if t.is_conj() or t.is_neg():
        # rows travel as bytes, and a lazy conjugate or negation has none: its bits are not the values it reads as
        raise UnmovableWeightsError(
            f"{name}: is a lazy {'conjugate' if t.is_conj() else 'negative'} view (is_conj() or is_neg() is true); "
            "its memory does not hold the values it reads as, so its rows cannot travel as bytes. Pass "
            ".resolve_conj().resolve_neg() (a tensor whose memory holds its values)", layer)
    if t.is_contiguous() and (t.ndim < 2 or t.shape[-1] != 1):
        # the usual case, checked in one call: torch calls a tensor contiguous when every dim of size > 1 has its
        # row-major stride, so none is 0 and none overlaps; only a last dim of size 1 may carry another (below)
        return
    dims = [(st, sz) for sz, st in zip(t.shape, t.stride()) if sz > 1]
    if any(st == 0 for st, _ in dims):
        raise UnmovableWeightsError(
            f"{name}: has shape {tuple(t.shape)} and strides {t.stride()}: a stride of 0 on a dimension of size > 1 "
            "makes elements share memory (an expanded view); writing one row would change others", layer)
    dims.sort()
    span = 1
    for st, sz in dims:
        if st < span:  # not provably free of overlap: sorted strides must each step over the dims below
            raise UnmovableWeightsError(
                f"{name}: has shape {tuple(t.shape)} and strides {t.stride()}: its elements may share memory "
                "(overlapping strides); give a tensor whose elements are distinct", layer)
        span = st * sz
    if t.ndim >= 2 and t.shape[-1] == 1 and t.stride(-1) != 1:
        raise UnmovableWeightsError(
            f"{name}: has shape {tuple(t.shape)} and strides {t.stride()}: a last dimension of size 1 must have "
            "stride 1 (rows travel as bytes); pass .clone(memory_format=torch.contiguous_format)", layer)


def _row_ranges(t: torch.Tensor) -> tuple[tuple, np.ndarray, np.ndarray]:
    """(device, starts, ends): the byte range of each row of ``t`` (S, ...); one range for
    the whole tensor when its rows interleave (a transposed view)."""
    es = t.element_size()
    row_extent = (1 + sum((sz - 1) * st for sz, st in zip(t.shape[1:], t.stride()[1:]))) * es
    base = t.data_ptr()
    device = (t.device.type, t.device.index)
    step = t.stride(0) * es
    if t.shape[0] > 1 and step < row_extent:
        return device, np.array([base]), np.array([base + (t.shape[0] - 1) * step + row_extent])
    starts = base + step * np.arange(t.shape[0], dtype=np.int64)
    return device, starts, starts + row_extent


def _lattice_disjoint(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when no element of ``a`` can share an address with one of ``b``: every element of either lies at
    its base plus a multiple of g, the gcd of both tensors' strides (elements, dims of size > 1), and the bases
    differ by no multiple of g. Views interleaved along a dimension (a fused gate/up projection as
    ``f[:, 0::2]`` and ``f[:, 1::2]``) pass; their byte ranges meet but their elements do not."""
    size = a.element_size()
    gap = b.data_ptr() - a.data_ptr()
    if b.element_size() != size or gap % size:
        return False
    g = 0
    for t in (a, b):
        for extent, stride in zip(t.shape, t.stride()):
            if extent > 1:
                g = math.gcd(g, stride)
    return g > 1 and (gap // size) % g != 0


def find_shared_memory(named: Sequence[tuple[str, torch.Tensor]]) -> tuple[str, str] | None:
    """The names of the first two tensors (in the order of ``named``) whose rows share memory, or None.

    ``named``: (name, tensor (S, ...)) pairs; a tensor listed twice counts. Compares whole
    byte spans first and the rows of a pair only when their spans meet (views that
    interleave rows of one storage, e.g. the two halves of a fused projection, are fine).
    """
    spans = []
    for i, (_, t) in enumerate(named):
        if t.numel() == 0:
            continue
        # the tensor's whole byte span (first row's start to last row's end; strides are
        # never negative); the rows themselves are looked at only when two spans meet
        base = t.data_ptr()
        if t.is_contiguous():  # the usual case: its elements are one dense block
            end = base + t.numel() * t.element_size()
        else:
            es = t.element_size()
            row_extent = (1 + sum((sz - 1) * st for sz, st in zip(t.shape[1:], t.stride()[1:]))) * es
            end = base + (t.shape[0] - 1) * t.stride(0) * es + row_extent
        spans.append(((t.device.type, t.device.index), base, end, i))
    spans.sort(key=lambda s: (s[0], s[1]))
    best = None  # the first pair in the order of ``named``: the error names the earliest layer
    for a in range(len(spans)):
        dev, _, end, i = spans[a]
        for b in range(a + 1, len(spans)):
            dev_b, start_b, _, j = spans[b]
            if dev_b != dev or start_b >= end:
                break
            # rows meet if some row of one starts before a row of the other ends, and vice versa
            _, starts_i, ends_i = _row_ranges(named[i][1])
            _, starts_j, ends_j = _row_ranges(named[j][1])
            lo = np.maximum(starts_i[:, None], starts_j[None, :])
            hi = np.minimum(ends_i[:, None], ends_j[None, :])
            if (lo < hi).any() and not _lattice_disjoint(named[i][1], named[j][1]):
                pair = (min(i, j), max(i, j))
                best = pair if best is None else min(best, pair)
    return None if best is None else (named[best[0]][0], named[best[1]][0])


def check_devices(comm: Communicator, name: str, tensors: Sequence[torch.Tensor], layer: int | None = None) -> None:
    """Refuse tensors ``comm`` cannot move: off the CPU when it moves host memory only (gloo),
    off CUDA when it moves CUDA memory only (NCCL); with ``comm.device_backends`` (a group
    whose backend depends on the device) the backend serving each tensor's device decides,
    and a device no backend of the group serves is refused.

    ``tensors``: one layer's tensors (S, ...); the executor's layout check makes every
    layer and rank match them, so one layer speaks for all.
    """
    backends = getattr(comm, "device_backends", None)
    for t, w in enumerate(tensors):
        serving = backends.get(w.device.type) if isinstance(backends, Mapping) else None
        if getattr(comm, "host_memory_only", False) or serving == "gloo":
            if w.device.type != "cpu":
                raise UnmovableWeightsError(
                    f"{name}[{t}]: is on {w.device}, and the transfer group "
                    f"({getattr(comm, 'backend', 'host memory only')}) moves CPU tensors only: gloo's send and "
                    "receive read and write a tensor's memory as host memory. Keep the expert weights on the CPU, "
                    f"or transfer over a group whose backend moves {w.device.type} tensors (NCCL for CUDA)", layer)
        if getattr(comm, "cuda_memory_only", False) or serving == "nccl":
            if w.device.type != "cuda":
                raise UnmovableWeightsError(
                    f"{name}[{t}]: is on {w.device}, and the transfer group "
                    f"({getattr(comm, 'backend', 'CUDA memory only')}) moves CUDA tensors only: NCCL sends and "
                    "receives GPU memory. Keep the expert weights on the GPU, or transfer CPU weights over a gloo "
                    "group", layer)
        if isinstance(backends, Mapping) and serving is None:
            raise UnmovableWeightsError(
                f"{name}[{t}]: is on {w.device}, and the transfer group ({getattr(comm, 'backend', '?')}) has no "
                f"backend for {w.device.type} tensors (it uses {dict(backends)}): move the weights to one of those "
                "devices, or build the group with a backend for this one", layer)


def _refuse_meta(name: str, tensors: Sequence[torch.Tensor], layer: int | None = None) -> None:
    """Refuse one layer's tensors (S, ...) (every layer's layout) on the meta device: nothing would move."""
    for t, w in enumerate(tensors):
        if w.is_meta:
            raise UnmovableWeightsError(f"{name}[{t}]: is on the meta device, which holds no data: nothing would "
                                        "move. Materialize the weights (.to_empty(), then load them) first", layer)


def tell_device(comm: Communicator, tensors: Sequence[torch.Tensor]) -> None:
    """Give ``comm.use_device`` (when it has one) the device of ``tensors`` (one rank's layer, (S, ...) each),
    after the checks and before anything moves: on a group with a backend per device it picks the one."""
    use = getattr(comm, "use_device", None)
    if use is not None and len(tensors):
        use(tensors[0].device)


def check_layer_tensors(name: str, tensors: Any, rows: int, ref: Layout | None,
                        layer: int | None = None) -> list[torch.Tensor]:
    """``tensors`` as a list of movable tensors (S=``rows``, ...), of layout ``ref`` when given."""
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise ValueError(f"{name}: must be a list of tensors shaped (S, ...)")
    out = list(tensors)
    for t, w in enumerate(out):
        if not isinstance(w, torch.Tensor):
            raise ValueError(f"{name}[{t}]: must be a torch.Tensor, got {type(w).__name__}")
        check_movable(f"{name}[{t}]", w, layer)  # first: a nested tensor has no shape to read
        if w.ndim < 1 or w.shape[0] != rows:
            raise ValueError(f"{name}[{t}]: has shape {tuple(w.shape)}; its first dim must be S = P / G = {rows} rows")
    if ref is not None and layout(out) != ref:
        raise ValueError(
            f"{name}: tensors {[(s, str(d), str(v)) for s, d, v in layout(out)]} must match the first layer's "
            f"{[(s, str(d), str(v)) for s, d, v in ref]} (shape, dtype, device): one buffer serves every layer"
        )
    return out


def refuse_shared_memory(named: Sequence[tuple[str, torch.Tensor]]) -> None:
    """``UnmovableWeightsError`` naming the first two tensors of ``named`` whose rows share memory."""
    shared = find_shared_memory(named)
    if shared is not None:
        raise UnmovableWeightsError(
            f"{shared[0]} and {shared[1]}: share memory; every weight row must be moved on its own "
            "(a tensor listed twice would be overwritten by its other use)")


def per_rank(comm: Communicator, value: Any, name: str) -> dict[int, Any]:
    """``{local rank: value}``: ``value`` is a list over the local ranks when ``comm`` plays several."""
    ranks = tuple(comm.local_ranks)
    if getattr(comm, "multi_rank", False):
        if isinstance(value, torch.Tensor) or not isinstance(value, Sequence) or len(value) != len(ranks):
            raise ValueError(f"{name}: with a communicator that plays {len(ranks)} ranks, give a list over those ranks")
        return dict(zip(ranks, value))
    return {ranks[0]: value}


def check_all_weights(
    comm: Communicator, expert_weights: Any, num_layers: int, rows: int
) -> dict[int, list[list[torch.Tensor]]]:
    """Every check of the full rearrangement's weights: ``{rank: L lists of tensors (S=rows, ...)}``."""
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
            checked.append(check_layer_tensors(f"{name}[{k}]", layer, rows, ref, k))
            if ref is None:
                ref = layout(checked[-1])
        out[r] = checked
    multi = getattr(comm, "multi_rank", False)
    first_rank, first = next(iter(out.items()))
    if first:
        check_devices(comm, f"expert_weights{f'[{first_rank}]' if multi else ''}[0]", first[0], 0)
        _refuse_meta(f"expert_weights{f'[{first_rank}]' if multi else ''}[0]", first[0], 0)
    refuse_shared_memory([
        (f"expert_weights{f'[{r}]' if multi else ''}[{k}][{t}]", w)
        for r, layers in out.items() for k, tensors in enumerate(layers) for t, w in enumerate(tensors)
    ])
    return out


def check_layer_weights(
    comm: Communicator, layer_weights: Any, rows: int
) -> dict[int, list[torch.Tensor]]:
    """Every check of one layer's weights: ``{rank: tensors (S=rows, ...)}``."""
    by_rank = per_rank(comm, layer_weights, "layer_weights")
    ref: Layout | None = None
    out = {}
    for r, tensors in by_rank.items():
        name = f"layer_weights[{r}]" if getattr(comm, "multi_rank", False) else "layer_weights"
        out[r] = check_layer_tensors(name, tensors, rows, ref)
        if ref is None:
            ref = layout(out[r])
            check_devices(comm, name, out[r])
            _refuse_meta(name, out[r])
    multi = getattr(comm, "multi_rank", False)
    refuse_shared_memory([(f"layer_weights{f'[{r}]' if multi else ''}[{t}]", w)
                          for r, tensors in out.items() for t, w in enumerate(tensors)])
    return out


def traces_for(trace: Any, comm: Communicator) -> list[tuple[Any, int | None]]:
    """(trace, rank or None) pairs: one trace per local rank, or one for the whole process."""
    if trace is None:
        return []
    ranks = tuple(comm.local_ranks)
    if isinstance(trace, Sequence) and not isinstance(trace, (str, bytes)):
        if len(trace) != len(ranks):
            raise ValueError(f"trace: a list of traces must have one per local rank ({len(ranks)}), got {len(trace)}")
        pairs = [(t, r) for t, r in zip(trace, ranks) if t is not None]
    else:
        pairs = [(trace, ranks[0] if len(ranks) == 1 else None)]
    for t, _ in pairs:  # refused here, before anything moves, not as an AttributeError half-way through a layer
        if not callable(getattr(t, "collective", None)):
            raise ValueError(f"trace: must be an EventTrace (an object with a collective() method), got "
                             f"{type(t).__name__}")
    return pairs
