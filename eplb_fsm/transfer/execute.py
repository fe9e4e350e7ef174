"""Execute a rearrangement: move expert weights so every slot holds its new expert.

Per layer (design §6) each rank:

1. plans the layer from the replicated old/new rows (:mod:`eplb_fsm.transfer.plan`);
   the plans, messages and copy runs of every layer are kept per (maps, group size,
   local ranks, batching) in a small LRU cache, so a repeated rearrangement neither
   re-validates nor re-plans: the CPU left on the critical path between layers is
   posting the messages and the copies;
2. runs the waves of point-to-point messages: sends read the old weight rows, receives
   land in the buffer's primary rows (one wave, or several with migration batching);
3. while the first wave is in flight, copies into the buffer the source of one *local*
   row (new expert already on this rank) per in-rank cycle (:mod:`.local_copies`);
4. commits: the other local rows straight from their source rows, in an order that
   reads every row before overwriting it, then the staged local, primary and duplicate
   rows from the buffer (a duplicate from its primary's buffer row). Locally moved rows
   are thus copied once, not twice.

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
import dataclasses
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from eplb_fsm.transfer.batching import Wave, plan_waves, single_wave
from eplb_fsm.transfer.communicator import Communicator, TorchDistCommunicator, TransferError
from eplb_fsm.transfer.local_copies import order_local_copies
from eplb_fsm.transfer.plan import LayerPlan, LayerTransfers, check_layer_maps
from eplb_fsm.transfer.plan_all import all_layer_transfers, plans_for_rank
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
    commits: dict[int, "_Commit"] | None = field(repr=False, default=None)

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
    old_phy2log: Any,
    new_phy2log: Any,
    world_size: int,
    rank_mapping: Mapping[int, int] | None,
    ndim: int,
    local_ranks: tuple[int, ...],
    migration_batching: bool,
) -> tuple[np.ndarray, np.ndarray, "_Schedule"]:
    """Maps as int64 (L, P) in the group's index space, checked layer by layer, and their schedule.

    The schedule (every layer's plan, messages and copy runs) is cached per (maps, group
    size, local ranks, batching): the same maps were validated when it was built, so a
    cache hit skips the per-layer checks and the planning.
    """
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
    old = np.ascontiguousarray(old)
    new = np.ascontiguousarray(new)
    key = (old.shape, old.tobytes(), new.tobytes(), int(world_size), tuple(local_ranks), bool(migration_batching))
    with _SCHEDULES_LOCK:
        sched = _SCHEDULES.get(key)
        if sched is not None:
            _SCHEDULES.move_to_end(key)
    if sched is None:
        if not _maps_valid(old, new):
            # the per-layer check names the first layer and rule that fails
            for k in range(old.shape[0]):
                check_layer_maps(old[k], new[k], world_size, what=f"[{k}]" if ndim == 2 else "")
        sched = _Schedule(old, new, int(world_size), tuple(local_ranks), bool(migration_batching))
        with _SCHEDULES_LOCK:
            _SCHEDULES[key] = sched
            while len(_SCHEDULES) > _SCHEDULE_CACHE_SIZE:
                _SCHEDULES.popitem(last=False)
    return sched.old, sched.new, sched


def _maps_valid(old: np.ndarray, new: np.ndarray) -> bool:
    """All layers at once: ids in [-1, P) and every needed expert held in its layer.

    ``old``/``new``: (L, P) int64 of the same shape, P % G == 0 already checked.
    """
    num_layers, p = old.shape
    if old.size == 0:
        return True
    if min(old.min(), new.min()) < -1 or max(old.max(), new.max()) >= p:
        return False
    held = np.zeros((num_layers, p + 1), dtype=bool)  # column p: the empty slot (-1)
    layer = np.arange(num_layers)[:, None]
    held[layer, old] = True
    return bool(held[layer, new][new >= 0].all())


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


Run = tuple[int, int, int]


def _runs(dst_rows: np.ndarray, src_rows: np.ndarray) -> tuple[Run, ...]:
    """(dst_start, src_start, length) runs where both row sequences advance by one."""
    runs: list[Run] = []
    for d, s in zip(dst_rows.tolist(), src_rows.tolist()):
        if runs and runs[-1][0] + runs[-1][2] == d and runs[-1][1] + runs[-1][2] == s:
            a, b, n = runs[-1]
            runs[-1] = (a, b, n + 1)
        else:
            runs.append((d, s, 1))
    return tuple(runs)


def _copy_runs(dst: list[torch.Tensor], src: list[torch.Tensor], runs: Sequence[Run]) -> None:
    if not runs:
        return
    for d_t, s_t in zip(dst, src):
        nb = d_t.is_cuda
        for a, b, n in runs:
            if n == 1:
                d_t[a].copy_(s_t[b], non_blocking=nb)
            else:
                d_t[a : a + n].copy_(s_t[b : b + n], non_blocking=nb)


def _direct_runs(dst_rows: np.ndarray, src_rows: np.ndarray) -> tuple[Run, ...]:
    """Like :func:`_runs` for copies within one tensor, in the given order.

    Consecutive copies merge into one slice copy only while the destination and source
    ranges stay disjoint (a slice copy over overlapping rows would read rows it writes).
    """
    runs: list[Run] = []
    for d, s in zip(dst_rows.tolist(), src_rows.tolist()):
        if runs:
            a, b, n = runs[-1]
            if a + n == d and b + n == s and abs(a - b) > n:
                runs[-1] = (a, b, n + 1)
                continue
        runs.append((d, s, 1))
    return tuple(runs)


def _as_bytes(row: torch.Tensor, for_recv: bool) -> torch.Tensor:
    if not row.is_contiguous():
        if for_recv:  # buffers are allocated contiguous; this guards against misuse
            raise RuntimeError("receive target must be contiguous")
        row = row.contiguous()
    return row.reshape(-1).view(torch.uint8)


class _RowBytes:
    """``rows[i]``: row i of a tensor as a flat uint8 tensor (a view when the tensor is contiguous)."""

    __slots__ = ("_t", "_bytes", "_for_recv")

    def __init__(self, t: torch.Tensor, for_recv: bool) -> None:
        self._t = t
        self._for_recv = for_recv
        self._bytes = None
        if t.is_contiguous() and t.ndim >= 1 and t.shape[0] > 0 and t[0].numel() > 0:
            self._bytes = t.view(t.shape[0], -1).view(torch.uint8)

    def __getitem__(self, row: int) -> torch.Tensor:
        if self._bytes is not None:
            return self._bytes[row]
        return _as_bytes(self._t[row], self._for_recv)


def _row_nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum((t[0].numel() if t.shape[0] else 0) * t.element_size() for t in tensors)


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
class _WaveOps:
    """One wave's messages per local rank: ((peer, row), ...) in posting order."""

    sends: dict[int, tuple[tuple[int, int], ...]]
    recvs: dict[int, tuple[tuple[int, int], ...]]


@dataclass(frozen=True)
class _PreparedLayer:
    """A layer's plans (one per local rank), waves, messages and copy runs: nothing moved."""

    layer: int
    plans: dict[int, LayerPlan]
    waves: list[Wave]
    ops: tuple[_WaveOps, ...] = ()
    local_runs: dict[int, tuple[Run, ...]] = field(default_factory=dict)  # staged local rows: weights -> buffer
    commit: dict[int, "_Commit"] = field(default_factory=dict)
    staged: dict[int, np.ndarray] = field(default_factory=dict)  # buffer rows the local copies write


@dataclass(frozen=True)
class _Commit:
    """One rank's commit of one layer.

    ``direct``: weights → weights copies of local rows, in the order that reads every
    source row before it is overwritten (:func:`order_local_copies`); they run first.
    ``dst``/``src``: then weight rows written from buffer rows (staged local, primary and
    duplicate rows; ascending by ``dst``), ``runs`` the same as coalesced runs.
    """

    direct: tuple[Run, ...]
    direct_reads: np.ndarray
    dst: np.ndarray
    src: np.ndarray
    runs: tuple[Run, ...]

    def part(self, keep: np.ndarray, with_direct: bool) -> "_Commit":
        """The direct copies (or none) and the buffer writes selected by ``keep``."""
        d, s = self.dst[keep], self.src[keep]
        direct = self.direct if with_direct else ()
        reads = self.direct_reads if with_direct else _NO_ROWS
        return _Commit(direct, reads, d, s, _runs(d, s))

    @property
    def empty(self) -> bool:
        return not self.direct and not self.runs


_NO_ROWS = np.zeros(0, dtype=np.int64)


def _commit_of(plan: LayerPlan) -> tuple[_Commit, tuple[Run, ...], np.ndarray]:
    """(commit, staged local runs weights -> buffer, staged buffer rows) of one rank's plan."""
    order = order_local_copies(plan.local_rows, plan.local_src_rows)
    dst = np.concatenate([order.staged_rows, plan.primary_rows, plan.duplicate_rows])
    src = np.concatenate([order.staged_rows, plan.primary_rows, plan.duplicate_src_rows])
    by_dst = np.argsort(dst, kind="stable")
    dst, src = dst[by_dst], src[by_dst]
    commit = _Commit(
        _direct_runs(order.direct_rows, order.direct_src_rows), order.direct_src_rows, dst, src, _runs(dst, src)
    )
    return commit, _runs(order.staged_rows, order.staged_src_rows), order.staged_rows


def _prepare_layer(
    layer: int, transfers: LayerTransfers, plans: dict[int, LayerPlan], migration_batching: bool
) -> _PreparedLayer:
    waves = plan_waves(transfers) if migration_batching else single_wave(transfers)
    ops = []
    for wave in waves:
        pairs = set(wave.pairs)
        sends, recvs = {}, {}
        for r, plan in plans.items():
            sends[r] = tuple(
                (peer, row)
                for peer, row in zip(plan.send_peers.tolist(), plan.send_rows.tolist())
                if (r, peer) in pairs
            )
            recvs[r] = tuple(
                (peer, row)
                for peer, row in zip(plan.recv_peers.tolist(), plan.recv_rows.tolist())
                if (peer, r) in pairs
            )
        ops.append(_WaveOps(sends, recvs))
    commits, local_runs, staged = {}, {}, {}
    for r, plan in plans.items():
        commits[r], local_runs[r], staged[r] = _commit_of(plan)
    return _PreparedLayer(layer, plans, waves, tuple(ops), local_runs, commits, staged)


def _split_runs(prev: _PreparedLayer, nxt: _PreparedLayer) -> tuple[dict[int, _Commit], dict[int, _Commit]]:
    """Split ``prev``'s commit into what must run before ``nxt`` writes the buffer, and the rest.

    Early: the buffer writes whose buffer rows ``nxt`` overwrites (its receives and staged
    local rows), preceded by all of ``prev``'s direct copies if any of those writes hits a
    row a direct copy still reads. Late: everything else, direct copies first.
    """
    early, late = {}, {}
    for r, commit in prev.commit.items():
        overwritten = np.concatenate([nxt.plans[r].recv_rows, nxt.staged[r]])
        hit = np.isin(commit.src, overwritten)
        direct_early = bool(commit.direct) and bool(np.isin(commit.dst[hit], commit.direct_reads).any())
        early[r] = commit.part(hit, with_direct=direct_early)
        rest = commit.part(~hit, with_direct=not direct_early)
        if not rest.empty:
            late[r] = rest
    return early, late


class _Schedule:
    """Every layer of one (old, new) pair of maps, prepared on first use and kept.

    Built for one group size, set of local ranks and batching mode; the maps it holds are
    read-only copies. Layers (and the commit split between consecutive layers) are
    prepared lazily, so a first call still plans layer k+1 while layer k is in flight.
    """

    def __init__(self, old: np.ndarray, new: np.ndarray, world_size: int, local_ranks: tuple[int, ...], batching: bool):
        self.old = old.copy()
        self.new = new.copy()
        self.old.flags.writeable = False
        self.new.flags.writeable = False
        self.world_size = world_size
        self.local_ranks = local_ranks
        self.batching = batching
        n = old.shape[0]
        self._layers: list[_PreparedLayer | None] = [None] * n
        self._splits: list[tuple[dict, dict] | None] = [None] * max(n - 1, 0)
        self._transfers: list[LayerTransfers] | None = None
        self._plans: dict[int, list[LayerPlan]] = {}

    def layer(self, k: int) -> _PreparedLayer:
        prep = self._layers[k]
        if prep is None:
            if self._transfers is None:
                # every layer's transfers and plans in one vectorised pass (plan_all)
                self._transfers = all_layer_transfers(self.old, self.new, self.world_size)
                self._plans = {r: plans_for_rank(self.old, self.new, self._transfers, r) for r in self.local_ranks}
            plans = {r: self._plans[r][k] for r in self.local_ranks}
            prep = _prepare_layer(k, self._transfers[k], plans, self.batching)
            self._layers[k] = prep
        return prep

    def split(self, k: int) -> tuple[dict[int, tuple[Run, ...]], dict[int, tuple[Run, ...]]]:
        """(early, late) runs of layer k's commit with respect to layer k+1."""
        sp = self._splits[k]
        if sp is None:
            sp = _split_runs(self.layer(k), self.layer(k + 1))
            self._splits[k] = sp
        return sp


_SCHEDULE_CACHE_SIZE = 16
_SCHEDULES: "OrderedDict[tuple, _Schedule]" = OrderedDict()
_SCHEDULES_LOCK = threading.Lock()


def clear_schedule_cache() -> None:
    """Forget every cached schedule (benchmarks use it to time planning as a new rearrangement would)."""
    with _SCHEDULES_LOCK:
        _SCHEDULES.clear()


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
        for r, runs in prep.local_runs.items():
            _copy_runs(buffers[r], weights[r], runs)
        if meanwhile is not None:
            meanwhile()

    if not prep.waves:
        local_copies()
        return
    send_bytes = {r: [_RowBytes(t, False) for t in weights[r]] for r in prep.plans}
    recv_bytes = {r: [_RowBytes(t, True) for t in buffers[r]] for r in prep.plans}
    row_nbytes = {r: _row_nbytes(weights[r]) for r in prep.plans} if traces else {}
    for w, wave in enumerate(prep.waves):
        _run_wave(prep, w, wave, send_bytes, recv_bytes, row_nbytes, comm, traces, local_copies if w == 0 else None)


def _run_wave(
    prep: _PreparedLayer,
    w: int,
    wave: Wave,
    send_bytes: dict[int, list[_RowBytes]],
    recv_bytes: dict[int, list[_RowBytes]],
    row_nbytes: dict[int, int],
    comm: Communicator,
    traces: list[tuple[Any, int | None]],
    meanwhile: Callable[[], None] | None,
) -> None:
    layer, num_waves = prep.layer, len(prep.waves)
    ops = prep.ops[w]
    add_send, add_recv = comm.add_send, comm.add_recv
    for r in prep.plans:
        for peer, row in ops.sends[r]:
            for tb in send_bytes[r]:
                add_send(tb[row], r, peer)
        for peer, row in ops.recvs[r]:
            for tb in recv_bytes[r]:
                add_recv(tb[row], peer, r)
    stats: dict[int, list[int]] = {}
    if traces:
        for r in prep.plans:
            n_s, n_r = len(ops.sends[r]), len(ops.recvs[r])
            stats[r] = [n_s, n_r, (n_s + n_r) * row_nbytes[r]]
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
    old, new, sched = _prepare_maps(
        old_phy2log, new_phy2log, comm.world_size, rank_mapping, 2, tuple(comm.local_ranks), migration_batching
    )
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
                _rearrange_layers(sched, weights, buffers, comm, traces, buf)
        finally:
            _finish(comm)


def _rearrange_layers(
    sched: _Schedule,
    weights: dict[int, list[list[torch.Tensor]]],
    buffers: dict[int, list[torch.Tensor]],
    comm: Communicator,
    traces: list[tuple[Any, int | None]],
    buf: TransferBuffer,
) -> None:
    """All layers, pipelined over the one buffer.

    While layer k's first wave is in flight, this process also finishes layer k-1's
    commit and (first use of these maps only) plans layer k+1. Only the part of layer
    k-1's commit that reads buffer rows layer k is about to overwrite runs before layer k
    starts. If layer k fails, layer k-1's commit is completed first, so layers < k are
    new and layers >= k are old.
    """
    num_layers = sched.old.shape[0]
    prev_w: dict[int, list[torch.Tensor]] | None = None
    for k in range(num_layers):
        prep = sched.layer(k)
        layer_w = {r: weights[r][k] for r in comm.local_ranks}
        late: dict[int, _Commit] = {}
        if prev_w is not None:
            early, late = sched.split(k - 1)
            _apply_runs(early, prev_w, buffers)
        state = {"late_done": not late}

        def meanwhile(k: int = k, late=late, prev_w=prev_w, state=state) -> None:
            if not state["late_done"]:
                _apply_runs(late, prev_w, buffers)
                state["late_done"] = True
            if k + 1 < num_layers:
                sched.split(k)  # plans layer k+1 too (a no-op once the schedule is complete)

        buf.generation += 1
        try:
            _run_layer(prep, layer_w, buffers, comm, traces, meanwhile=meanwhile)
        except TransferError as exc:
            if not state["late_done"]:
                _apply_runs(late, prev_w, buffers)  # layer k-1 ends fully new
            exc.committed_layers = k
            raise
        prev_w = layer_w
    if prev_w is not None:
        _apply_runs(sched.layer(num_layers - 1).commit, prev_w, buffers)


def _apply_runs(
    commits: dict[int, _Commit],
    weights: dict[int, list[torch.Tensor]],
    buffers: dict[int, list[torch.Tensor]],
) -> None:
    """Run commits: each rank's direct copies (weights -> weights), then its buffer writes."""
    for r, commit in commits.items():
        _copy_runs(weights[r], weights[r], commit.direct)
        _copy_runs(weights[r], buffers[r], commit.runs)


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
    old, new, sched = _prepare_maps(
        old_phy2log_row, new_phy2log_row, comm.world_size, rank_mapping, 1, tuple(comm.local_ranks), migration_batching
    )
    rows = old.shape[1] // comm.world_size
    weights = _check_layer_weights(comm, layer_weights, rows)
    traces = _traces_for(trace, comm)
    buffers = {r: buffer.ensure(r, weights[r]) for r in comm.local_ranks}
    buffer.generation += 1
    prep = sched.layer(0)
    if prep.layer != layer:
        prep = dataclasses.replace(prep, layer=layer)
    with _stream(comm):
        _run_layer(prep, weights, buffers, comm, traces)
    return PendingLayer(
        layer=layer,
        plans=prep.plans,
        buffer=buffer,
        generation=buffer.generation,
        layouts={r: _layout(w) for r, w in weights.items()},
        communicator=comm,
        commits=prep.commit,
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
        _apply_runs(pending.commits, weights, buffers)
    _finish(comm)
    pending.committed = True
