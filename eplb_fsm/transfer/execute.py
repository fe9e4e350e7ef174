"""Execute a rearrangement: move expert weights so every slot holds its new expert.

Per layer (design §6) each rank:

1. plans the layer from the replicated old/new rows (:mod:`eplb_fsm.transfer.plan`);
2. runs the waves of point-to-point messages: sends read the old weight rows, receives
   land in the buffer's primary rows (one wave, or several with migration batching);
3. while the first wave is in flight, copies its *local* rows (new expert already on
   this rank) from the weights into the buffer;
4. commits: local, primary and duplicate rows are copied from the buffer into the
   weights (a duplicate from its primary's buffer row).

Steps 1–3 never write the weights, so the old weights stay valid until step 4; the
one-layer entry points split the two halves for the asynchronous controller
(:func:`transfer_layer_to_buffer`, :func:`commit_layer_from_buffer`).

Messages carry raw bytes (each row viewed as uint8), so any dtype travels the same way.
Every check on the input runs before the first copy or message; a failure while
messages are in flight raises :class:`TransferError` with the layer: layers before it
are committed (new), it and the ones after are untouched (old).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from eplb_fsm.transfer.batching import Wave, plan_waves, single_wave
from eplb_fsm.transfer.communicator import Communicator, TorchDistCommunicator, TransferError
from eplb_fsm.transfer.plan import LayerPlan, check_layer_maps, layer_transfers, plan_from_transfers
from eplb_fsm.transfer.rank_mapping import expand_maps

__all__ = [
    "TransferBuffer",
    "PendingLayer",
    "default_buffer",
    "rearrange_expert_weights_inplace",
    "transfer_layer_to_buffer",
    "commit_layer_from_buffer",
]

Layout = tuple[tuple[tuple[int, ...], torch.dtype, torch.device], ...]


def _layout(tensors: Sequence[torch.Tensor]) -> Layout:
    return tuple((tuple(t.shape), t.dtype, t.device) for t in tensors)


class TransferBuffer:
    """One layer's worth of weight rows per local rank, reused across layers and calls.

    ``ensure(rank, layer_weights)`` returns the rank's buffer tensors (contiguous, same
    shapes/dtypes/devices as the layer's weights), allocating only when the layout
    changed. ``allocations`` counts allocations (profile mode reserves them up front).
    ``generation`` advances on every transfer so a stale pending commit is caught.
    """

    def __init__(self) -> None:
        self._by_rank: dict[int, list[torch.Tensor]] = {}
        self.allocations = 0
        self.generation = 0

    def ensure(self, rank: int, layer_weights: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        current = self._by_rank.get(rank)
        if current is not None and _layout(current) == _layout(layer_weights):
            return current
        tensors = [torch.empty(tuple(w.shape), dtype=w.dtype, device=w.device) for w in layer_weights]
        self._by_rank[rank] = tensors
        self.allocations += 1
        return tensors

    def tensors(self, rank: int) -> list[torch.Tensor]:
        return self._by_rank[rank]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self._by_rank.values() for t in ts)

    def release(self) -> None:
        """Drop every tensor (the next use allocates again)."""
        self._by_rank.clear()


_DEFAULT_BUFFER = TransferBuffer()
_DEFAULT_LOCK = threading.Lock()


def default_buffer() -> TransferBuffer:
    """The buffer :func:`rearrange_expert_weights_inplace` uses when none is given."""
    return _DEFAULT_BUFFER


@dataclass
class PendingLayer:
    """A layer whose messages have landed in the buffer and wait for their commit."""

    layer: int
    plans: dict[int, LayerPlan]
    buffer: TransferBuffer
    generation: int
    layouts: dict[int, Layout]
    communicator: Any = field(repr=False, default=None)
    committed: bool = False

    @property
    def moved_rows(self) -> int:
        """Rows this process will write at commit (local + primary + duplicate)."""
        return sum(p.local_rows.size + p.primary_rows.size + p.duplicate_rows.size for p in self.plans.values())


# ---------------------------------------------------------------------------------------
# input checks (all run before any copy or message)


def _resolve_communicator(group: Any, communicator: Communicator | None, timeout: float | None) -> Communicator:
    if communicator is not None:
        if group is not None:
            raise ValueError("group: give a process group or a communicator, not both")
        for attr in ("world_size", "local_ranks", "add_send", "add_recv", "execute"):
            if not hasattr(communicator, attr):
                raise ValueError(f"communicator: missing {attr!r} (see eplb_fsm.transfer.Communicator)")
        return communicator
    return TorchDistCommunicator(group, timeout=timeout)


def _as_maps(name: str, m: Any, ndim: int) -> np.ndarray:
    if hasattr(m, "detach"):
        m = m.detach().cpu().numpy()
    arr = np.asarray(m)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{name}: must be an integer array (int64 phy2log), got dtype {arr.dtype}")
    want = "(L, P)" if ndim == 2 else "(P,)"
    if arr.ndim != ndim:
        raise ValueError(f"{name}: must have shape {want}, got {arr.shape}")
    return arr.astype(np.int64, copy=False)


def _prepare_maps(
    old_phy2log: Any, new_phy2log: Any, world_size: int, rank_mapping: Mapping[int, int] | None, ndim: int
) -> tuple[np.ndarray, np.ndarray]:
    """Maps as int64 (L, P) in the group's index space, checked layer by layer."""
    old = _as_maps("old_phy2log", old_phy2log, ndim)
    new = _as_maps("new_phy2log", new_phy2log, ndim)
    if rank_mapping is not None:
        old, new, _ = expand_maps(old, new, rank_mapping, world_size)
    if ndim == 1:
        old, new = old[None, :], new[None, :]
    if old.shape != new.shape:
        raise ValueError(f"new_phy2log: shape {new.shape} must equal old_phy2log's {old.shape}")
    if old.shape[1] % world_size:
        raise ValueError(
            f"phy2log: P={old.shape[1]} slots must divide by the group size G={world_size} (P % G == 0)"
        )
    for k in range(old.shape[0]):
        check_layer_maps(old[k], new[k], world_size, what=f"[{k}]" if ndim == 2 else "")
    return old, new


def _check_layer_tensors(name: str, tensors: Any, rows: int, ref: Layout | None) -> list[torch.Tensor]:
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
    if ref is not None and _layout(out) != ref:
        raise ValueError(
            f"{name}: tensors {[(tuple(s), str(d)) for s, d, _ in _layout(out)]} must match the first layer's "
            f"{[(tuple(s), str(d)) for s, d, _ in ref]} (shape, dtype, device): one buffer serves every layer"
        )
    return out


def _per_rank(comm: Communicator, value: Any, name: str) -> dict[int, Any]:
    ranks = tuple(comm.local_ranks)
    if getattr(comm, "multi_rank", False):
        if isinstance(value, torch.Tensor) or not isinstance(value, Sequence) or len(value) != len(ranks):
            raise ValueError(
                f"{name}: with a communicator that plays {len(ranks)} ranks, give a list over those ranks"
            )
        return dict(zip(ranks, value))
    return {ranks[0]: value}


def _check_all_weights(
    comm: Communicator, expert_weights: Any, num_layers: int, rows: int
) -> dict[int, list[list[torch.Tensor]]]:
    by_rank = _per_rank(comm, expert_weights, "expert_weights")
    ref: Layout | None = None
    out: dict[int, list[list[torch.Tensor]]] = {}
    for r, layers in by_rank.items():
        name = f"expert_weights[{r}]" if getattr(comm, "multi_rank", False) else "expert_weights"
        if isinstance(layers, torch.Tensor) or not isinstance(layers, Sequence) or len(layers) != num_layers:
            got = len(layers) if isinstance(layers, Sequence) else type(layers).__name__
            raise ValueError(f"{name}: must be a list over the L={num_layers} layers of the maps, got {got}")
        checked = []
        for k, layer in enumerate(layers):
            checked.append(_check_layer_tensors(f"{name}[{k}]", layer, rows, ref))
            if ref is None:
                ref = _layout(checked[-1])
        out[r] = checked
    return out


def _check_layer_weights(
    comm: Communicator, layer_weights: Any, rows: int
) -> dict[int, list[torch.Tensor]]:
    by_rank = _per_rank(comm, layer_weights, "layer_weights")
    ref: Layout | None = None
    out = {}
    for r, tensors in by_rank.items():
        name = f"layer_weights[{r}]" if getattr(comm, "multi_rank", False) else "layer_weights"
        out[r] = _check_layer_tensors(name, tensors, rows, ref)
        ref = _layout(out[r]) if ref is None else ref
    return out


# ---------------------------------------------------------------------------------------
# data movement


def _runs(dst_rows: np.ndarray, src_rows: np.ndarray) -> list[tuple[int, int, int]]:
    """(dst_start, src_start, length) runs where both row sequences advance by one."""
    runs: list[tuple[int, int, int]] = []
    for d, s in zip(dst_rows.tolist(), src_rows.tolist()):
        if runs and runs[-1][0] + runs[-1][2] == d and runs[-1][1] + runs[-1][2] == s:
            a, b, n = runs[-1]
            runs[-1] = (a, b, n + 1)
        else:
            runs.append((d, s, 1))
    return runs


def _copy_rows(dst: list[torch.Tensor], dst_rows: np.ndarray, src: list[torch.Tensor], src_rows: np.ndarray) -> None:
    if dst_rows.size == 0:
        return
    runs = _runs(dst_rows, src_rows)
    for d_t, s_t in zip(dst, src):
        nb = d_t.is_cuda
        for a, b, n in runs:
            d_t[a : a + n].copy_(s_t[b : b + n], non_blocking=nb)


def _as_bytes(row: torch.Tensor, for_recv: bool) -> torch.Tensor:
    if not row.is_contiguous():
        if for_recv:  # buffers are allocated contiguous; this guards against misuse
            raise RuntimeError("receive target must be contiguous")
        row = row.contiguous()
    return row.reshape(-1).view(torch.uint8)


def _traces_for(trace: Any, comm: Communicator) -> list[tuple[Any, int | None]]:
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


@dataclass(frozen=True)
class _PreparedLayer:
    """A layer's plans (one per local rank) and waves: everything decided, nothing moved."""

    layer: int
    plans: dict[int, LayerPlan]
    waves: list[Wave]


def _prepare_layer(
    layer: int, old_row: np.ndarray, new_row: np.ndarray, comm: Communicator, migration_batching: bool
) -> _PreparedLayer:
    transfers = layer_transfers(old_row, new_row, comm.world_size, validate=False)
    plans = {r: plan_from_transfers(old_row, new_row, transfers, r) for r in comm.local_ranks}
    waves = plan_waves(transfers) if migration_batching else single_wave(transfers)
    return _PreparedLayer(layer, plans, waves)


def _run_layer(
    prep: _PreparedLayer,
    weights: dict[int, list[torch.Tensor]],
    buffers: dict[int, list[torch.Tensor]],
    comm: Communicator,
    traces: list[tuple[Any, int | None]],
    meanwhile: Callable[[], None] | None = None,
) -> None:
    """Steps 2-3 for one layer: local copies into the buffer and every wave of messages.

    The local copies (and ``meanwhile``, e.g. planning the next layer) run while the first
    wave is in flight: they read the weights and write buffer rows no message touches.
    """

    def local_copies() -> None:
        for r, plan in prep.plans.items():
            _copy_rows(buffers[r], plan.local_rows, weights[r], plan.local_src_rows)
        if meanwhile is not None:
            meanwhile()

    if not prep.waves:
        local_copies()
        return
    for w, wave in enumerate(prep.waves):
        _run_wave(prep, w, wave, weights, buffers, comm, traces, local_copies if w == 0 else None)


def _run_wave(
    prep: _PreparedLayer,
    w: int,
    wave: Wave,
    weights: dict[int, list[torch.Tensor]],
    buffers: dict[int, list[torch.Tensor]],
    comm: Communicator,
    traces: list[tuple[Any, int | None]],
    meanwhile: Callable[[], None] | None,
) -> None:
    layer, num_waves = prep.layer, len(prep.waves)
    pairs = set(wave.pairs)
    stats: dict[int, list[int]] = {}
    for r, plan in prep.plans.items():
        sends = recvs = nbytes = 0
        for peer, row in zip(plan.send_peers.tolist(), plan.send_rows.tolist()):
            if (r, peer) not in pairs:
                continue
            for t in weights[r]:
                msg = _as_bytes(t[row], for_recv=False)
                comm.add_send(msg, r, peer)
                nbytes += msg.numel()
            sends += 1
        for peer, row in zip(plan.recv_peers.tolist(), plan.recv_rows.tolist()):
            if (peer, r) not in pairs:
                continue
            for t in buffers[r]:
                msg = _as_bytes(t[row], for_recv=True)
                comm.add_recv(msg, peer, r)
                nbytes += msg.numel()
            recvs += 1
        stats[r] = [sends, recvs, nbytes]
    start = getattr(comm, "start", None)
    wait = getattr(comm, "wait", None)
    with contextlib.ExitStack() as stack:
        for trace, r in traces:
            if r is None:  # one record for every rank this process plays
                fields = {"pairs": [list(p) for p in wave.pairs]}
                s = [sum(v[i] for v in stats.values()) for i in range(3)]
            else:
                fields = {"peers": wave.peers_of(r)}
                s = stats[r]
            stack.enter_context(
                trace.collective(
                    "batch_isend_irecv",
                    group=getattr(comm, "name", "world"),
                    layer=layer,
                    wave=w,
                    waves=num_waves,
                    sends=s[0],
                    recvs=s[1],
                    nbytes=s[2],
                    **fields,
                )
            )
        try:
            if start is not None and wait is not None:
                start()
            else:
                if meanwhile is not None:
                    meanwhile()
                    meanwhile = None
                comm.execute()
        except Exception as exc:
            raise _failed(comm, layer, w, num_waves, exc) from exc
        # start() returned: overlap local work with the messages in flight, then wait
        # for them even if that work failed (no request is left dangling)
        local_error: BaseException | None = None
        if meanwhile is not None:
            try:
                meanwhile()
            except BaseException as exc:  # re-raised below, after the wait
                local_error = exc
        if wait is not None and start is not None:
            try:
                wait()
            except Exception as exc:
                if local_error is None:
                    raise _failed(comm, layer, w, num_waves, exc) from exc
        if local_error is not None:
            raise local_error


def _failed(comm: Communicator, layer: int, w: int, num_waves: int, exc: BaseException) -> TransferError:
    discard = getattr(comm, "discard", None)
    if discard is not None:
        discard()
    return TransferError(f"layer {layer}, wave {w}/{num_waves}: {type(exc).__name__}: {exc}", layer=layer, wave=w)


def _commit(plans: dict[int, LayerPlan], weights: dict[int, list[torch.Tensor]], buffers: dict[int, list[torch.Tensor]]) -> None:
    for r, plan in plans.items():
        dst, src = plan.commit_rows()
        _copy_rows(weights[r], dst, buffers[r], src)


def _stream(comm: Communicator) -> contextlib.AbstractContextManager:
    ctx = getattr(comm, "stream_context", None)
    return ctx() if ctx is not None else contextlib.nullcontext()


def _finish(comm: Communicator) -> None:
    fin = getattr(comm, "finish", None)
    if fin is not None:
        fin()


# ---------------------------------------------------------------------------------------
# public entry points


def rearrange_expert_weights_inplace(
    old_phy2log: Any,
    new_phy2log: Any,
    expert_weights: Sequence[Any],
    group: Any = None,
    communicator: Communicator | None = None,
    is_profile: bool = False,
    rank_mapping: Mapping[int, int] | None = None,
    trace: Any = None,
    migration_batching: bool = False,
    *,
    buffer: TransferBuffer | None = None,
    timeout: float | None = None,
) -> None:
    """Rearrange every layer's expert weights in place from ``old_phy2log`` to ``new_phy2log``.

    ``old_phy2log``/``new_phy2log``: (L, P) integer tensors or arrays, identical on every
    rank (with ``rank_mapping``: old over the old ranks, new over the new ranks).
    ``expert_weights``: a list over the L layers of lists of tensors shaped (S, ...), any
    dtype; with a multi-rank communicator (:class:`InProcessCommunicator`) a list over its
    ranks of such lists. ``group``: the process group (None: the default group), used
    when no ``communicator`` is given (then ``timeout`` bounds each wait).
    ``is_profile``: check the input and reserve the worst-case buffer, move nothing.
    ``rank_mapping``: ``{old_rank: new_rank or -1}`` for elastic EP (see rank_mapping).
    ``trace``: an EventTrace (or one per local rank) that brackets every wave.
    ``migration_batching``: coalesce per (src, dst) and run waves where each rank talks
    to at most one peer. ``buffer``: the reusable one-layer buffer (default: a shared one).

    Raises ``ValueError`` on bad input before anything moves; :class:`TransferError` if a
    layer's messages fail (``committed_layers`` layers are new, the rest old).
    """
    comm = _resolve_communicator(group, communicator, timeout)
    old, new = _prepare_maps(old_phy2log, new_phy2log, comm.world_size, rank_mapping, ndim=2)
    num_layers, p = old.shape
    rows = p // comm.world_size
    weights = _check_all_weights(comm, expert_weights, num_layers, rows)
    traces = _traces_for(trace, comm)
    if num_layers == 0:
        return
    buf = buffer if buffer is not None else _DEFAULT_BUFFER
    lock = _DEFAULT_LOCK if buffer is None else contextlib.nullcontext()
    with lock:
        buffers = {r: buf.ensure(r, weights[r][0]) for r in comm.local_ranks}
        if is_profile:
            return
        try:
            with _stream(comm):
                _rearrange_layers(old, new, weights, buffers, comm, traces, migration_batching, buf)
        finally:
            _finish(comm)


def _rearrange_layers(
    old: np.ndarray,
    new: np.ndarray,
    weights: dict[int, list[list[torch.Tensor]]],
    buffers: dict[int, list[torch.Tensor]],
    comm: Communicator,
    traces: list[tuple[Any, int | None]],
    migration_batching: bool,
    buf: TransferBuffer,
) -> None:
    """All layers, pipelined over the one buffer.

    While layer k's first wave is in flight, this process also finishes layer k-1's
    commit and plans layer k+1. Only the part of layer k-1's commit that reads buffer rows
    layer k is about to overwrite runs before layer k starts. If layer k fails, layer
    k-1's commit is completed first, so layers < k are new and layers >= k are old.
    """
    num_layers = old.shape[0]
    prep = _prepare_layer(0, old[0], new[0], comm, migration_batching)
    prev: tuple[dict[int, list[torch.Tensor]], dict[int, tuple[np.ndarray, np.ndarray]]] | None = None
    for k in range(num_layers):
        layer_w = {r: weights[r][k] for r in comm.local_ranks}
        late: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        if prev is not None:
            early, late = _split_commit(prev[1], prep)
            _apply_commit(early, prev[0], buffers)
        state = {"late_done": not late, "next": None}

        def meanwhile(k: int = k, late=late, prev=prev, state=state) -> None:
            if not state["late_done"]:
                _apply_commit(late, prev[0], buffers)
                state["late_done"] = True
            if k + 1 < num_layers:
                state["next"] = _prepare_layer(k + 1, old[k + 1], new[k + 1], comm, migration_batching)

        buf.generation += 1
        try:
            _run_layer(prep, layer_w, buffers, comm, traces, meanwhile=meanwhile)
        except TransferError as exc:
            if not state["late_done"]:
                _apply_commit(late, prev[0], buffers)  # layer k-1 ends fully new
            exc.committed_layers = k
            raise
        prev = (layer_w, {r: plan.commit_rows() for r, plan in prep.plans.items()})
        if k + 1 < num_layers:
            prep = state["next"] or _prepare_layer(k + 1, old[k + 1], new[k + 1], comm, migration_batching)
    if prev is not None:
        _apply_commit(prev[1], prev[0], buffers)


def _split_commit(
    entries: dict[int, tuple[np.ndarray, np.ndarray]], nxt: _PreparedLayer
) -> tuple[dict[int, tuple[np.ndarray, np.ndarray]], dict[int, tuple[np.ndarray, np.ndarray]]]:
    """Split a layer's commit into what must run before ``nxt`` writes the buffer, and the rest."""
    early, late = {}, {}
    for r, (dst, src) in entries.items():
        plan = nxt.plans[r]
        overwritten = np.concatenate([plan.recv_rows, plan.local_rows])
        hit = np.isin(src, overwritten)
        early[r] = (dst[hit], src[hit])
        if (~hit).any():
            late[r] = (dst[~hit], src[~hit])
    return early, late


def _apply_commit(
    entries: dict[int, tuple[np.ndarray, np.ndarray]],
    weights: dict[int, list[torch.Tensor]],
    buffers: dict[int, list[torch.Tensor]],
) -> None:
    for r, (dst, src) in entries.items():
        _copy_rows(weights[r], dst, buffers[r], src)


def transfer_layer_to_buffer(
    old_phy2log_row: Any,
    new_phy2log_row: Any,
    layer_weights: Sequence[Any],
    buffer: TransferBuffer,
    *,
    layer: int = 0,
    group: Any = None,
    communicator: Communicator | None = None,
    rank_mapping: Mapping[int, int] | None = None,
    trace: Any = None,
    migration_batching: bool = False,
    timeout: float | None = None,
) -> PendingLayer:
    """Run one layer's local copies and messages into ``buffer``; the weights stay untouched.

    ``old_phy2log_row``/``new_phy2log_row``: the layer's (P,) rows. ``layer_weights``: this
    rank's list of tensors (S, ...) for the layer (a list over ranks with a multi-rank
    communicator). ``layer`` only labels trace records and errors. The old weights stay
    valid (and in use) until :func:`commit_layer_from_buffer` is called with the result.
    """
    if not isinstance(buffer, TransferBuffer):
        raise ValueError(f"buffer: must be a TransferBuffer, got {type(buffer).__name__}")
    comm = _resolve_communicator(group, communicator, timeout)
    old, new = _prepare_maps(old_phy2log_row, new_phy2log_row, comm.world_size, rank_mapping, ndim=1)
    rows = old.shape[1] // comm.world_size
    weights = _check_layer_weights(comm, layer_weights, rows)
    traces = _traces_for(trace, comm)
    buffers = {r: buffer.ensure(r, weights[r]) for r in comm.local_ranks}
    buffer.generation += 1
    prep = _prepare_layer(layer, old[0], new[0], comm, migration_batching)
    with _stream(comm):
        _run_layer(prep, weights, buffers, comm, traces)
    return PendingLayer(
        layer=layer,
        plans=prep.plans,
        buffer=buffer,
        generation=buffer.generation,
        layouts={r: _layout(w) for r, w in weights.items()},
        communicator=comm,
    )


def commit_layer_from_buffer(pending: PendingLayer, layer_weights: Sequence[Any]) -> None:
    """Write a transferred layer into its weights: local, primary and duplicate rows.

    ``layer_weights`` must be the tensors given to :func:`transfer_layer_to_buffer`
    (same shapes; a list over ranks with a multi-rank communicator). Raises
    ``ValueError`` if the buffer has since been reused or the pending layer was committed.
    """
    if not isinstance(pending, PendingLayer):
        raise ValueError(f"pending: must be the PendingLayer returned by transfer_layer_to_buffer, got {type(pending).__name__}")
    if pending.committed:
        raise ValueError(f"pending: layer {pending.layer} is already committed")
    if pending.buffer.generation != pending.generation:
        raise ValueError(
            f"pending: the buffer of layer {pending.layer} was reused by a later transfer; commit each layer "
            "before transferring the next one into the same buffer"
        )
    comm = pending.communicator
    rows = next(iter(pending.plans.values())).slots_per_rank
    weights = _check_layer_weights(comm, layer_weights, rows)
    for r, w in weights.items():
        if _layout(w) != pending.layouts[r]:
            raise ValueError(f"layer_weights: rank {r}'s tensors differ from the ones transferred")
    buffers = {r: pending.buffer.tensors(r) for r in pending.plans}
    with _stream(comm):
        _commit(pending.plans, weights, buffers)
    _finish(comm)
    pending.committed = True
