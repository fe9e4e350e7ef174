"""The executor through the in-process communicator: bit-exact results, message counts, bad input."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eplb_fsm.trace import EventTrace
from eplb_fsm.transfer import (
    InProcessCommunicator,
    PendingLayer,
    TransferBuffer,
    TransferError,
    commit_layer_from_buffer,
    default_buffer,
    rearrange_expert_weights_inplace,
    transfer_layer_to_buffer,
)

# three weight tensors per layer: a 0-d row (bfloat16), a vector (float32), a matrix (int8)
SPECS = [((), torch.bfloat16), ((3,), torch.float32), ((2, 3), torch.int8)]


def _nbytes(shape, dtype):
    return int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()


def _expert_bytes(num_layers: int, num_experts: int, t: int, nbytes: int) -> np.ndarray:
    """(L, E + 1, nbytes) deterministic bytes seeded by (layer, expert, tensor); row E is 'garbage'."""
    l = np.arange(num_layers, dtype=np.uint64)[:, None, None]
    e = np.arange(num_experts + 1, dtype=np.uint64)[None, :, None]
    b = np.arange(nbytes, dtype=np.uint64)[None, None, :]
    x = (l * np.uint64(1_000_003) + e * np.uint64(7919) + np.uint64(t) * np.uint64(104_729)) * np.uint64(
        0x9E3779B97F4A7C15
    ) + b * np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(31)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(29)
    return (x & np.uint64(0xFF)).astype(np.uint8)


def _rows(table: np.ndarray, layer: int, experts: np.ndarray, shape, dtype) -> torch.Tensor:
    garbage = table.shape[1] - 1
    idx = np.where(experts >= 0, experts, garbage)
    raw = torch.from_numpy(np.ascontiguousarray(table[layer, idx]))  # (S, nbytes) uint8
    return raw.view(dtype).reshape((len(experts),) + tuple(shape)).clone()


def make_world(old: np.ndarray, g: int, specs=SPECS):
    """Weights of every rank for map ``old`` (L, P): list[rank][layer][tensor]; plus the byte tables."""
    num_layers, p = old.shape
    s = p // g
    tables = [_expert_bytes(num_layers, p, t, _nbytes(shape, dtype)) for t, (shape, dtype) in enumerate(specs)]
    weights = [
        [[_rows(tables[t], k, old[k, r * s : (r + 1) * s], shape, dtype) for t, (shape, dtype) in enumerate(specs)]
         for k in range(num_layers)]
        for r in range(g)
    ]
    return weights, tables


def _as_u8(x: torch.Tensor) -> np.ndarray:
    return x.contiguous().reshape(-1).view(torch.uint8).numpy()


def check_world(weights, tables, old: np.ndarray, new: np.ndarray, g: int) -> None:
    """Every slot holds, bit for bit, its new expert's bytes; empty new slots keep their old bytes."""
    num_layers, p = new.shape
    s = p // g
    # an empty new slot keeps what it had: its old expert (or the old 'garbage' row)
    want_experts = np.where(new >= 0, new, old)
    for r in range(g):
        for k in range(num_layers):
            experts = want_experts[k, r * s : (r + 1) * s]
            for t, w in enumerate(weights[r][k]):
                garbage = tables[t].shape[1] - 1
                want = tables[t][k, np.where(experts >= 0, experts, garbage)]  # (S, nbytes)
                got = w.contiguous().view(torch.uint8).reshape(s, -1).numpy()
                if not np.array_equal(got, want):
                    bad = int(np.flatnonzero((got != want).any(axis=1))[0])
                    raise AssertionError(f"rank {r} layer {k} tensor {t} row {bad} != expert {experts[bad]}")


def expected_messages(old: np.ndarray, new: np.ndarray, g: int, num_tensors: int) -> int:
    """Messages a minimal transfer needs: one per tensor per (rank, expert) not held before."""
    s = old.shape[1] // g
    total = 0
    for k in range(old.shape[0]):
        for r in range(g):
            need = set(new[k, r * s : (r + 1) * s].tolist()) - set(old[k, r * s : (r + 1) * s].tolist())
            total += len(need - {-1})
    return total * num_tensors


@st.composite
def placements(draw, max_ranks=5, max_slots=4, max_layers=3):
    """Random (old, new, G): duplicates, unchanged rows, empty slots in both maps.

    Hypothesis draws the sizes and the mix (how often a slot is empty, kept, or given a
    random held expert); a drawn seed fills the maps, which keeps thousands of examples fast.
    """
    g = draw(st.integers(1, max_ranks))
    s = draw(st.integers(1, max_slots))
    num_layers = draw(st.integers(1, max_layers))
    p = g * s
    n = draw(st.integers(1, p))
    p_empty_old = draw(st.sampled_from([0.0, 0.1, 0.4]))
    p_empty_new = draw(st.sampled_from([0.0, 0.1, 0.4]))
    p_keep = draw(st.sampled_from([0.0, 0.3, 0.7, 1.0]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    old = rng.integers(0, n, size=(num_layers, p))
    old[rng.random((num_layers, p)) < p_empty_old] = -1
    new = np.empty_like(old)
    for k in range(num_layers):
        held = np.unique(old[k][old[k] >= 0])
        pick = held[rng.integers(0, len(held), size=p)] if held.size else np.full(p, -1)
        keep = rng.random(p) < p_keep
        empty = rng.random(p) < p_empty_new
        new[k] = np.where(keep, old[k], np.where(empty, -1, pick))
    return old, new, g


@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(placements(), st.booleans(), st.sampled_from([1, 2]))
def test_random_rearrangements_bit_exact_and_minimal(case, batching, buffer_layers):
    """Thousands of random placements, one- or two-layer buffer: every slot ends exact; no message is extra."""
    old, new, g = case
    weights, tables = make_world(old, g)
    comm = InProcessCommunicator(g)
    rearrange_expert_weights_inplace(
        torch.from_numpy(old), torch.from_numpy(new), weights, communicator=comm,
        migration_batching=batching, buffer=TransferBuffer(buffer_layers),
    )
    check_world(weights, tables, old, new, g)
    assert comm.total_messages == expected_messages(old, new, g, len(SPECS))


@settings(max_examples=400, deadline=None)
@given(placements(max_layers=1), st.booleans())
def test_transfer_leaves_weights_until_commit(case, batching):
    """transfer_layer_to_buffer never writes the weights; commit_layer_from_buffer completes the layer."""
    old, new, g = case
    weights, tables = make_world(old, g)
    layer_w = [weights[r][0] for r in range(g)]
    before = [[w.clone() for w in ws] for ws in layer_w]
    comm = InProcessCommunicator(g)
    buf = TransferBuffer()
    pending = transfer_layer_to_buffer(old[0], new[0], layer_w, buf, communicator=comm, migration_batching=batching)
    for ws, bs in zip(layer_w, before):
        for w, b in zip(ws, bs):
            assert torch.equal(_u8(w), _u8(b))
    commit_layer_from_buffer(pending, layer_w)
    check_world(weights, tables, old, new, g)


def _u8(x):
    return x.contiguous().reshape(-1).view(torch.uint8)


def _swap_layer():
    """One layer on 2 ranks whose rows all cross ranks: (old, new, weights, tables, per-rank layer weights)."""
    old = np.array([0, 1, 2, 3])
    new = np.array([2, 3, 0, 1])
    weights, tables = make_world(old[None], 2)
    return old, new, weights, tables, [weights[r][0] for r in range(2)]


def test_stale_pending_layer_is_refused():
    """A pending layer whose buffer was reused by a later transfer, or already committed, cannot commit."""
    old, new, _, _, lw = _swap_layer()
    comm = InProcessCommunicator(2)
    buf = TransferBuffer()
    first = transfer_layer_to_buffer(old, new, lw, buf, communicator=comm)
    second = transfer_layer_to_buffer(old, new, lw, buf, communicator=comm)
    with pytest.raises(ValueError, match="reused"):
        commit_layer_from_buffer(first, lw)
    commit_layer_from_buffer(second, lw)
    with pytest.raises(ValueError, match="already committed"):
        commit_layer_from_buffer(second, lw)
    assert isinstance(second, PendingLayer) and second.moved_rows == 4



def test_a_pending_layer_refuses_other_tensors_of_the_same_layout():
    """Committing into another layer's tensors, a clone, or a same-shape view elsewhere is refused; nothing is
    written."""
    old, new, _, _, lw = _swap_layer()
    comm = InProcessCommunicator(2)
    pending = transfer_layer_to_buffer(old, new, lw, TransferBuffer(), communicator=comm)
    before = [[w.clone() for w in ws] for ws in lw]
    wide = [[torch.zeros((4,) + tuple(w.shape[1:]), dtype=w.dtype) for w in ws] for ws in lw]
    others = {
        "another layer": [[torch.zeros_like(w) for w in ws] for ws in lw],
        "a clone": [[w.clone() for w in ws] for ws in lw],
        "an offset view": [[x[2:] for x in ws] for ws in wide],  # same shape and strides, storage offset 2
        "a strided view": [[x[::2] for x in ws] for ws in wide],  # same shape, other strides
    }
    for what, tensors in others.items():
        snap = [[w.clone() for w in ws] for ws in tensors]
        with pytest.raises(ValueError, match=r"^layer_weights: rank 0's tensors differ from the ones transferred"):
            commit_layer_from_buffer(pending, tensors)
        assert all(torch.equal(_u8(a), _u8(b)) for xs, ys in zip(tensors, snap) for a, b in zip(xs, ys)), what
    assert all(torch.equal(_u8(a), _u8(b)) for xs, ys in zip(lw, before) for a, b in zip(xs, ys))
    assert not pending.committed
    commit_layer_from_buffer(pending, lw)
    assert all(torch.equal(_u8(a), _u8(b)) for xs, ys in zip(lw, before[::-1]) for a, b in zip(xs, ys))


def test_profile_reserves_buffers_and_moves_nothing():
    """Profile mode allocates the worst-case buffer once, copies nothing; the real run allocates nothing."""
    old = np.array([[0, 1, 2, 3, 4, 5], [5, 4, 3, 2, 1, 0]])
    new = np.array([[5, 4, 3, 2, 1, 0], [0, 0, 0, 1, 1, 1]])
    weights, tables = make_world(old, 3)
    before = [[[w.clone() for w in lw] for lw in rw] for rw in weights]
    comm = InProcessCommunicator(3)
    buf = TransferBuffer()
    rearrange_expert_weights_inplace(old, new, weights, communicator=comm, is_profile=True, buffer=buf)
    assert buf.allocations == 3 and comm.total_messages == 0 and comm.executes == 0
    assert buf.nbytes == sum(w.numel() * w.element_size() for rw in weights for w in rw[0])
    for rw, rb in zip(weights, before):
        for lw, lb in zip(rw, rb):
            assert all(torch.equal(_u8(a), _u8(b)) for a, b in zip(lw, lb))
    ptrs = [t.data_ptr() for r in range(3) for t in buf.tensors(r)]
    rearrange_expert_weights_inplace(old, new, weights, communicator=comm, buffer=buf)
    assert buf.allocations == 3
    assert ptrs == [t.data_ptr() for r in range(3) for t in buf.tensors(r)]
    check_world(weights, tables, old, new, 3)


def test_default_buffer_is_reused_after_profile():
    """Without an explicit buffer, the shared default one is reserved by profile mode and reused."""
    old = np.array([[0, 1, 2, 3]])
    new = np.array([[3, 2, 1, 0]])
    weights, tables = make_world(old, 2)
    comm = InProcessCommunicator(2)
    rearrange_expert_weights_inplace(old, new, weights, communicator=comm, is_profile=True)
    n = default_buffer().allocations
    rearrange_expert_weights_inplace(old, new, weights, communicator=comm)
    assert default_buffer().allocations == n
    check_world(weights, tables, old, new, 2)
    default_buffer().release()


def test_non_contiguous_weights():
    """Weights given as non-contiguous views are read and written correctly."""
    old = np.array([[0, 1, 2, 3]])
    new = np.array([[3, 3, 0, 1]])
    ws = []
    for r in range(2):
        t = torch.empty(6, 2).t()  # (2, 6), non-contiguous: rows are strided
        for i in range(2):
            t[i] = float(old[0, r * 2 + i])
        ws.append([[t]])
    assert not ws[0][0][0].is_contiguous()
    rearrange_expert_weights_inplace(old, new, ws, communicator=InProcessCommunicator(2), buffer=TransferBuffer())
    assert [ws[r][0][0].tolist() for r in range(2)] == [[[3.0] * 6] * 2, [[0.0] * 6, [1.0] * 6]]


def test_trace_brackets_every_wave_on_every_rank():
    """Each rank's trace gets a start/end pair per wave with the layer, the same cseq on all ranks."""
    old = np.array([[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]])
    new = np.array([[2, 3, 4, 5, 0, 1], [0, 1, 2, 3, 4, 5]])  # a ring on layer 0, nothing on layer 1
    weights, tables = make_world(old, 3)
    traces = [EventTrace(rank=r, world=3, keep=True) for r in range(3)]
    rearrange_expert_weights_inplace(
        old, new, weights, communicator=InProcessCommunicator(3), trace=traces,
        migration_batching=True, buffer=TransferBuffer(),
    )
    check_world(weights, tables, old, new, 3)
    starts = [[rec for rec in t.records if rec["event"] == "collective_start"] for t in traces]
    ends = [[rec for rec in t.records if rec["event"] == "collective_end"] for t in traces]
    assert [len(s) for s in starts] == [3, 3, 3]  # three waves, every rank runs each
    assert [len(e) for e in ends] == [3, 3, 3]
    for r in range(3):
        assert [rec["cseq"] for rec in starts[r]] == [0, 1, 2]
        assert all(rec["layer"] == 0 and rec["op"] == "batch_isend_irecv" for rec in starts[r])
    # pairs (0,2), (1,0), (2,1) carry 2 experts each; wave 0 takes (0, 2): rank 1 is idle in it
    assert starts[0][0]["peers"] == [2] and starts[1][0]["peers"] == [] and starts[1][0]["sends"] == 0


class _FailingComm(InProcessCommunicator):
    """Fails on the n-th execute (a timeout stand-in)."""

    def __init__(self, g, fail_at):
        super().__init__(g)
        self.fail_at = fail_at

    def start(self):
        if self.executes == self.fail_at:
            self.executes += 1
            raise RuntimeError("simulated timeout")
        super().start()


@pytest.mark.parametrize("buffer_layers,fail_at", [(1, 1), (2, 1), (2, 2)])
def test_failure_keeps_committed_layers_new_and_the_rest_old(buffer_layers, fail_at):
    """A failing wave raises TransferError: earlier layers are new, the failing and later ones old."""
    old = np.array([[0, 1, 2, 3]] * 3)
    new = np.array([[2, 3, 0, 1]] * 3)
    weights, tables = make_world(old, 2)
    trace = EventTrace(keep=True)
    comm = _FailingComm(2, fail_at=fail_at)
    with pytest.raises(TransferError) as info:
        rearrange_expert_weights_inplace(old, new, weights, communicator=comm, trace=trace,
                                         buffer=TransferBuffer(buffer_layers))
    # fail_at counts start() calls: the one that fails is layer fail_at's first
    assert info.value.layer == fail_at and info.value.committed_layers == fail_at
    mixed = np.concatenate([new[:fail_at], old[fail_at:]])
    check_world(weights, tables, old, mixed, 2)
    assert [r["event"] for r in trace.records][-1] == "collective_error"


class _FailingTrace:
    """A trace whose n-th collective bracket raises OSError (a full disk), not a TransferError."""

    def __init__(self, fail_at):
        self.fail_at, self.calls = fail_at, 0

    def collective(self, op, **fields):
        self.calls += 1
        if self.calls == self.fail_at:
            raise OSError(28, "No space left on device")
        return contextlib.nullcontext({})


@pytest.mark.parametrize("comm_cls", [InProcessCommunicator, "one_phase"])
def test_any_error_leaves_earlier_layers_new_and_the_rest_old(comm_cls):
    """A non-TransferError (the trace's disk full at layer 1) still ends layer 0 new, layer 1 old: committed 1."""
    comm_cls = _OnePhaseComm if comm_cls == "one_phase" else comm_cls
    old = np.array([[0, 1, 2, 3, 4, 5, 6, 7]] * 2)
    new = np.array([[4, 5, 2, 3, 0, 1, 6, 7], [4, 1, 2, 3, 0, 5, 6, 7]])
    weights, tables = make_world(old, 2)
    with pytest.raises(OSError, match="No space left") as info:
        rearrange_expert_weights_inplace(old, new, weights, communicator=comm_cls(2), trace=_FailingTrace(2),
                                         buffer=TransferBuffer())
    assert info.value.committed_layers == 1
    check_world(weights, tables, old, np.concatenate([new[:1], old[1:]]), 2)


class _FinishCounting(_FailingComm):
    """Counts finish() calls: where a CUDA communicator makes the caller's stream wait for the transfer stream."""

    finishes = 0

    def finish(self):
        self.finishes += 1


@pytest.mark.parametrize("fail_at", [None, 0])
def test_one_layer_transfer_hands_its_stream_back_even_when_it_fails(fail_at):
    """transfer_layer_to_buffer ends with finish() (the caller's stream waits for its buffer writes), also on error."""
    comm = _FinishCounting(2, fail_at=-1 if fail_at is None else fail_at)
    lw = [[torch.arange(6.0).reshape(2, 3) + 10 * r] for r in range(2)]
    old, new = np.array([0, 1, 2, 3]), np.array([2, 3, 0, 1])  # every row crosses ranks
    if fail_at is None:
        transfer_layer_to_buffer(old, new, lw, TransferBuffer(), communicator=comm)
    else:
        with pytest.raises(TransferError):
            transfer_layer_to_buffer(old, new, lw, TransferBuffer(), communicator=comm)
    assert comm.finishes == 1


# ---------------------------------------------------------------------------------------
# bad input: ValueError naming the field and rule, nothing sent, nothing written

G = 2
OLD = np.array([[0, 1, 2, 3], [3, 2, 1, 0]])
NEW = np.array([[1, 0, 3, 2], [0, 0, 1, 1]])


def _w(rows=2, layers=2, ranks=G, dtype=torch.float32):
    return [[[torch.zeros(rows, 3, dtype=dtype)] for _ in range(layers)] for _ in range(ranks)]


BAD = [
    ("old float", dict(old=OLD.astype(np.float32)), "old_phy2log: must be an integer"),
    ("new on meta", dict(new=torch.from_numpy(NEW).to("meta")), "new_phy2log must hold data"),
    ("new bool", dict(new=NEW.astype(bool)), "new_phy2log: must be an integer"),
    ("old 1-d", dict(old=OLD[0], new=NEW[0]), r"old_phy2log: must have shape \(L, P\)"),
    ("shape mismatch", dict(new=np.concatenate([NEW, NEW], axis=1)), "new_phy2log: shape"),
    ("layers mismatch", dict(new=NEW[:1]), "new_phy2log: shape"),
    ("P % G", dict(comm=3), r"P % G"),
    ("id too large", dict(new=np.array([[1, 0, 3, 4], [0, 0, 1, 1]])), r"new_phy2log\[0\]: expert ids"),
    ("id below -1", dict(old=np.array([[0, 1, 2, -2], [3, 2, 1, 0]])), r"old_phy2log\[0\]: expert ids"),
    ("expert held by no rank", dict(old=np.array([[0, 1, 2, 2], [3, 2, 1, 0]])), "held by no rank"),
    ("weights not per rank", dict(weights=_w(layers=3)[0]), "list over those ranks"),
    ("weights wrong layers", dict(weights=_w(layers=3)), r"expert_weights\[0\]: must be a list over the L=2"),
    ("weights wrong rows", dict(weights=_w(rows=3)), "first dim must be S = P / G = 2"),
    ("weights not tensor", dict(weights=[[[np.zeros((2, 3))]] * 2] * 2), "must be a torch.Tensor"),
    ("layers differ", dict(weights=[[[torch.zeros(2, 3)], [torch.zeros(2, 4)]]] * 2), "must match the first layer"),
    ("ranks differ", dict(weights=[_w()[0], _w(dtype=torch.int8)[0]]), "must match the first layer"),
    ("a later layer on meta", dict(weights=[[[torch.zeros(2, 3)], [torch.zeros(2, 3, device="meta")]]] * 2),
     r"must match the first layer's \[\(\(2, 3\), 'torch.float32', 'cpu'\)\]"),
    ("mapping too big", dict(rank_mapping={0: 0, 1: 1, 2: -1}), "rank_mapping: has 3 old ranks"),
    ("mapping dup", dict(rank_mapping={0: 0, 1: 0}), "rank_mapping: two old ranks"),
    ("mapping keys", dict(rank_mapping={0: 0, 2: 1}), "rank_mapping: keys"),
    ("group and comm", dict(group=object()), "group: give a process group or a communicator"),
    ("trace list", dict(trace=[EventTrace()]), "trace: a list of traces"),
    ("trace a path", dict(trace="events.jsonl"), "trace: must be an EventTrace"),
    ("buffer not a TransferBuffer", dict(buffer="x"), "buffer: must be a TransferBuffer or None"),
    ("timeout beside comm", dict(timeout=-1), "timeout: give it to the communicator"),
    ("new uint64 wraps", dict(new=np.array([[1, 0, 3, 2], [0, 0, 1, 2**64 - 1]], dtype=np.uint64)),
     r"new_phy2log: entries must be in \[-1, P\)"),
    ("ragged maps", dict(old=[[0, 1, 2, 3], [0, 1]]), r"old_phy2log: must be an integer array of shape \(L, P\) "
     "with rows of equal length"),
    ("migration_batching a string", dict(migration_batching="no"), "migration_batching: must be True or False"),
    ("is_profile a string", dict(is_profile="no"), "is_profile: must be True or False"),
]


@pytest.mark.parametrize("name,override,match", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises_before_anything_moves(name, override, match):
    """Each bad input raises ValueError naming the field and rule; no message, no write."""
    weights = override.get("weights", _w())
    snapshot = _clone_tree(weights)
    comm = InProcessCommunicator(override.get("comm", G))
    kwargs = dict(communicator=comm, buffer=TransferBuffer())
    for key in ("rank_mapping", "group", "trace", "buffer", "timeout", "migration_batching", "is_profile"):
        if key in override:
            kwargs[key] = override[key]
    with pytest.raises(ValueError, match=match):
        rearrange_expert_weights_inplace(override.get("old", OLD), override.get("new", NEW), weights, **kwargs)
    assert comm.total_messages == 0 and comm.executes == 0
    assert _same_tree(weights, snapshot)


def _clone_tree(x):
    if isinstance(x, list):
        return [_clone_tree(v) for v in x]
    return x.clone() if isinstance(x, torch.Tensor) else x


def _same_tree(a, b):
    if isinstance(a, list):
        return len(a) == len(b) and all(_same_tree(x, y) for x, y in zip(a, b))
    return torch.equal(a, b) if isinstance(a, torch.Tensor) and not a.is_meta else True   # meta: no data


def test_default_group_needs_initialized_dist():
    """group=None without a communicator needs torch.distributed initialized, else ValueError."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a default group exists in this process")
    with pytest.raises(ValueError, match="group: torch.distributed is not initialized"):
        rearrange_expert_weights_inplace(OLD, NEW, [[torch.zeros(2, 3)]] * 2)


def test_bad_one_layer_input():
    """The one-layer entry points check rows and buffers the same way."""
    comm = InProcessCommunicator(2)
    lw = [[torch.zeros(2, 3)] for _ in range(2)]
    with pytest.raises(ValueError, match=r"old_phy2log: must have shape \(P,\)"):
        transfer_layer_to_buffer(OLD, NEW, lw, TransferBuffer(), communicator=comm)
    with pytest.raises(ValueError, match="buffer: must be a TransferBuffer"):
        transfer_layer_to_buffer(OLD[0], NEW[0], lw, None, communicator=comm)  # type: ignore[arg-type]
    for bad in ("8", 1.5, True, -1):
        with pytest.raises(ValueError, match="max_chunk_bytes must be"):
            transfer_layer_to_buffer(OLD[0], NEW[0], lw, TransferBuffer(), communicator=comm, max_chunk_bytes=bad)
    with pytest.raises(ValueError, match="pending: must be the PendingLayer"):
        commit_layer_from_buffer(None, lw)  # type: ignore[arg-type]
    assert comm.executes == 0


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_chunk_bytes=16, between_chunks=5), "between_chunks: must be a callable or None, got int"),
    (dict(migration_batching="no"), "migration_batching: must be True or False"),
])
def test_one_layer_flags_and_hooks_are_checked_before_the_first_message(kwargs, match):
    """A non-callable between_chunks or a non-bool migration_batching raises ValueError before any message goes out."""
    comm = InProcessCommunicator(2)
    lw = [[torch.zeros(2, 4) + r] for r in range(2)]
    with pytest.raises(ValueError, match=match):
        transfer_layer_to_buffer([0, 1, 2, 3], [2, 3, 0, 1], lw, TransferBuffer(), communicator=comm, **kwargs)
    assert comm.total_messages == 0 and comm.executes == 0


# ---------------------------------------------------------------------------------------
# a commit that raises: not counted as committed, not labelled a failure of the next layer's wave


def _fail_commit_into(monkeypatch, tensors):
    """Make the executor's commit copies into any of ``tensors`` raise (after copying, as torch does)."""
    import eplb_fsm.transfer.execute as execute

    real = execute.copy_runs

    def copy_runs(dst, src, runs):
        real(dst, src, runs)
        if runs and any(d is t for d in dst for t in tensors):
            raise RuntimeError("injected commit failure")

    monkeypatch.setattr(execute, "copy_runs", copy_runs)


@pytest.mark.parametrize("comm_cls,buffer_layers,fail_layer", [
    (InProcessCommunicator, 1, 1),  # layer 1's commit held in layer 2's first wave (two phases)
    (InProcessCommunicator, 2, 1),  # run while layer 2's messages fly
    ("one_phase", 1, 1),  # run before layer 2 posts
    ("one_phase", 2, 1),  # run before layer 2's batch executes
    (InProcessCommunicator, 1, 2),  # the last layer's, after the loop
])
def test_a_commit_that_raises_counts_only_the_layers_before_it(monkeypatch, comm_cls, buffer_layers, fail_layer):
    """A commit that raises propagates as itself with committed_layers = its layer; earlier layers new, later old."""
    comm_cls = _OnePhaseComm if comm_cls == "one_phase" else comm_cls
    old = np.array([[0, 1, 2, 3]] * 3)
    new = np.array([[2, 3, 0, 1]] * 3)  # every row crosses ranks: each commit writes every row
    weights, tables = make_world(old, 2)
    _fail_commit_into(monkeypatch, [w for r in range(2) for w in weights[r][fail_layer]])
    with pytest.raises(RuntimeError, match="injected commit failure") as info:
        rearrange_expert_weights_inplace(old, new, weights, communicator=comm_cls(2),
                                         buffer=TransferBuffer(buffer_layers))
    assert not isinstance(info.value, TransferError)  # not "layer fail_layer + 1, wave 0"
    assert info.value.committed_layers == fail_layer
    if hasattr(info.value, "add_note"):
        assert any(f"commit of layer {fail_layer}" in n for n in info.value.__notes__)
    for k in range(3):
        if k != fail_layer:  # the failed layer may be partly written
            check_world([[weights[r][k]] for r in range(2)], [t[k : k + 1] for t in tables], old[k : k + 1],
                        (new if k < fail_layer else old)[k : k + 1], 2)


def test_a_one_layer_commit_that_raised_cannot_be_committed_again(monkeypatch):
    """commit_layer_from_buffer that raised part-way marks the pending layer failed; a retry is refused."""
    old, new, _, _, lw = _swap_layer()
    pending = transfer_layer_to_buffer(old, new, lw, TransferBuffer(), communicator=InProcessCommunicator(2))
    _fail_commit_into(monkeypatch, [w for rw in lw for w in rw])
    with pytest.raises(RuntimeError, match="injected commit failure"):
        commit_layer_from_buffer(pending, lw)
    assert pending.failed and not pending.committed
    monkeypatch.undo()
    with pytest.raises(ValueError, match="raised part-way .* cannot be committed again"):
        commit_layer_from_buffer(pending, lw)


# ---------------------------------------------------------------------------------------
# two-phase posting: receives into rows the previous layer's commit still reads wait for it


class _OnePhaseComm(InProcessCommunicator):
    """The in-process communicator without tags: every wave goes out in one batch."""

    supports_tags = False


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(placements(max_layers=4), st.booleans(), st.sampled_from([1, 2]))
def test_one_phase_path_stays_bit_exact(case, batching, buffer_layers):
    """Without tag support the executor commits before posting (one-layer buffer), and every slot still ends exact."""
    old, new, g = case
    weights, tables = make_world(old, g)
    comm = _OnePhaseComm(g)
    rearrange_expert_weights_inplace(old, new, weights, communicator=comm, migration_batching=batching,
                                     buffer=TransferBuffer(buffer_layers))
    check_world(weights, tables, old, new, g)
    assert comm.total_messages == expected_messages(old, new, g, len(SPECS))


class _PhaseSpy(InProcessCommunicator):
    """Records, at every start(), the queued receives and whether layer 0 is already committed."""

    def __init__(self, g, weights, layer0_new):
        super().__init__(g)
        self.weights, self.layer0_new = weights, layer0_new
        self.starts: list[tuple[int, int, bool]] = []  # (sends queued, receives queued, layer 0 committed)

    def start(self):
        committed = all(
            torch.equal(_u8(w), _u8(x))
            for r in range(self.world_size) for w, x in zip(self.weights[r][0], self.layer0_new[r])
        )
        self.starts.append((sum(map(len, self._sends.values())), sum(map(len, self._recvs.values())), committed))
        super().start()


def test_held_receives_are_posted_after_the_previous_commit():
    """Layer 1 receives into every row layer 0's commit reads: its sends go first, its receives after that commit."""
    old = np.array([[0, 1, 2, 3]] * 2)
    new = np.array([[2, 3, 0, 1]] * 2)  # every row crosses ranks in both layers
    weights, tables = make_world(old, 2)
    expect, _ = make_world(new, 2)
    spy = _PhaseSpy(2, weights, [expect[r][0] for r in range(2)])
    rearrange_expert_weights_inplace(old, new, weights, communicator=spy, buffer=TransferBuffer())
    check_world(weights, tables, old, new, 2)
    messages = 2 * 2 * len(SPECS)  # per layer: 2 ranks x 2 rows x tensors
    layer0, phase1, phase2 = spy.starts
    assert layer0 == (messages, messages, False)  # layer 0: nothing pending, one batch
    assert phase1 == (messages, 0, False)  # layer 1: sends only, layer 0 not yet committed
    assert phase2 == (messages, messages, True)  # its receives once layer 0 is committed
    assert spy.executes == 2 and spy.total_messages == 2 * messages


def test_two_layer_buffer_holds_no_receive():
    """With a two-layer buffer layer 1 goes out in one batch, before layer 0's commit, which runs while it flies."""
    old = np.array([[0, 1, 2, 3]] * 2)
    new = np.array([[2, 3, 0, 1]] * 2)
    weights, tables = make_world(old, 2)
    expect, _ = make_world(new, 2)
    spy = _PhaseSpy(2, weights, [expect[r][0] for r in range(2)])
    buffer = TransferBuffer(layers=2)
    rearrange_expert_weights_inplace(old, new, weights, communicator=spy, buffer=buffer)
    check_world(weights, tables, old, new, 2)
    messages = 2 * 2 * len(SPECS)
    assert spy.starts == [(messages, messages, False)] * 2
    assert spy.executes == 2 and buffer.allocations == 4  # two halves for each of the 2 ranks


def test_profile_reserves_both_halves_of_a_two_layer_buffer():
    """Profile mode allocates both layers of a two-layer buffer; the real run reuses them, allocating nothing."""
    old = np.array([[0, 1, 2, 3], [3, 2, 1, 0], [1, 0, 3, 2]])
    new = np.array([[3, 2, 1, 0], [0, 1, 2, 3], [2, 3, 0, 1]])
    weights, tables = make_world(old, 2)
    comm = InProcessCommunicator(2)
    buf = TransferBuffer(2)
    rearrange_expert_weights_inplace(old, new, weights, communicator=comm, is_profile=True, buffer=buf)
    one_layer = sum(w.numel() * w.element_size() for rw in weights for w in rw[0])
    assert buf.nbytes == 2 * one_layer and buf.allocations == 4 and comm.total_messages == 0
    ptrs = [t.data_ptr() for r in range(2) for i in range(2) for t in buf.tensors(r, i)]
    rearrange_expert_weights_inplace(old, new, weights, communicator=comm, buffer=buf)
    assert buf.allocations == 4
    assert ptrs == [t.data_ptr() for r in range(2) for i in range(2) for t in buf.tensors(r, i)]
    check_world(weights, tables, old, new, 2)


def test_one_layer_entry_uses_the_first_half_of_a_two_layer_buffer():
    """transfer_layer_to_buffer with a two-layer buffer fills only its first layer and commits exactly."""
    old, new, weights, tables, lw = _swap_layer()
    buf = TransferBuffer(2)
    pending = transfer_layer_to_buffer(old, new, lw, buf, communicator=InProcessCommunicator(2))
    commit_layer_from_buffer(pending, lw)
    check_world(weights, tables, old[None], new[None], 2)
    assert buf.allocations == 2 and buf.nbytes == sum(w.numel() * w.element_size() for ws in lw for w in ws)
    with pytest.raises(KeyError, match="no buffer layer 1"):
        buf.tensors(0, 1)


@pytest.mark.parametrize("layers", [0, 3, True, 1.0, "2"])
def test_bad_buffer_layers_are_refused(layers):
    """TransferBuffer(layers) other than 1 or 2 raises ValueError naming the field and rule."""
    with pytest.raises(ValueError, match=r"layers: must be 1 or 2"):
        TransferBuffer(layers)


# layouts the executor would move wrongly: refused before anything moves, nothing committed


def _unmovable(layer1_tensor_of_rank):
    """Two layers per rank: layer 0 ordinary, layer 1 the given tensor (per rank)."""
    return [[[torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * r],
             [layer1_tensor_of_rank(r)]] for r in range(G)]


UNMOVABLE = [
    # (2, 1) viewed from (1, 2).t(): torch calls it contiguous, but its stride(-1) is 2
    ("last dim of size 1, stride 2", lambda r: torch.tensor([[1.0 + r, 2.0 + r]]).t(), "last dimension of size 1"),
    ("expanded rows", lambda r: torch.tensor([[1.0 + r, 2.0, 3.0]]).expand(2, 3), "stride of 0"),
    ("overlapping strides", lambda r: torch.arange(4.0 + r).as_strided((2, 3), (1, 1)), "may share memory"),
]


@pytest.mark.parametrize("name,make,match", UNMOVABLE, ids=[u[0] for u in UNMOVABLE])
def test_unmovable_layout_is_refused_before_any_layer_moves(name, make, match):
    """A layer-1 view the executor would move wrongly raises TransferError with 0 committed layers; layer 0 stays
    old."""
    weights = _unmovable(make)
    snapshot = _clone_tree(weights)
    comm = InProcessCommunicator(G)
    with pytest.raises(TransferError, match=match) as info:
        rearrange_expert_weights_inplace(OLD, NEW, weights, communicator=comm, buffer=TransferBuffer())
    assert isinstance(info.value, ValueError)  # bad input, like every other input check
    assert info.value.committed_layers == 0 and info.value.layer == 1
    assert r"expert_weights[0][1][0]" in str(info.value)
    assert comm.total_messages == 0 and comm.executes == 0
    assert _same_tree(weights, snapshot)


def test_one_layer_entry_refuses_an_unmovable_layout():
    """transfer_layer_to_buffer applies the same layout check before its first message."""
    comm = InProcessCommunicator(2)
    lw = [[torch.tensor([[1.0, 2.0]]).t()] for _ in range(2)]
    with pytest.raises(TransferError, match="last dimension of size 1") as info:
        transfer_layer_to_buffer(OLD[0], NEW[0], lw, TransferBuffer(), communicator=comm, layer=4)
    assert info.value.committed_layers == 0
    assert comm.executes == 0


SHARED = [
    ("one tensor in two layers", lambda: (lambda t: [[[t], [t]], [[torch.zeros(2, 3)], [torch.ones(2, 3)]]])(
        torch.zeros(2, 3)), r"expert_weights\[0\]\[0\]\[0\] and expert_weights\[0\]\[1\]\[0\]"),
    ("one tensor for two ranks", lambda: (lambda t: [[[t], [torch.zeros(2, 3)]], [[t], [torch.ones(2, 3)]]])(
        torch.zeros(2, 3)), r"expert_weights\[0\]\[0\]\[0\] and expert_weights\[1\]\[0\]\[0\]"),
    ("overlapping row slices",
     lambda: (lambda big: [[[big[0:2]], [big[1:3]]], [[torch.zeros(2, 3)], [torch.ones(2, 3)]]])(torch.zeros(3, 3)),
     r"expert_weights\[0\]\[0\]\[0\] and expert_weights\[0\]\[1\]\[0\]"),
]


@pytest.mark.parametrize("name,make,match", SHARED, ids=[s[0] for s in SHARED])
def test_weights_sharing_memory_are_refused(name, make, match):
    """Two weight entries that share rows are refused before anything moves, naming both."""
    weights = make()
    snapshot = _clone_tree(weights)
    comm = InProcessCommunicator(G)
    with pytest.raises(TransferError, match=match) as info:
        rearrange_expert_weights_inplace(OLD, NEW, weights, communicator=comm, buffer=TransferBuffer())
    assert info.value.committed_layers == 0 and "share memory" in str(info.value)
    assert comm.executes == 0 and _same_tree(weights, snapshot)


def test_adjacent_row_slices_of_one_storage_are_moved():
    """Two layers that are adjacent row slices of one tensor touch but do not overlap: accepted and moved exactly."""
    weights = []
    for r in range(G):
        big = torch.arange(4 * 3, dtype=torch.float32).reshape(4, 3) + 100 * r
        weights.append([[big[0:2]], [big[2:4]]])
    snapshot = _clone_tree(weights)
    rearrange_expert_weights_inplace(OLD, NEW, weights, communicator=InProcessCommunicator(G), buffer=TransferBuffer())
    s = OLD.shape[1] // G
    for k in range(OLD.shape[0]):
        for slot, expert in enumerate(NEW[k].tolist()):
            held = int(np.flatnonzero(OLD[k] == expert)[0])  # any old slot of the expert holds its row
            assert torch.equal(weights[slot // s][k][0][slot % s], snapshot[held // s][k][0][held % s])


def test_interleaved_views_of_one_storage_are_moved():
    """Views that interleave rows of one storage (halves of a fused projection) are distinct and move exactly."""
    old = np.array([[0, 1, 2, 3]])
    new = np.array([[3, 2, 1, 0]])
    ws, fused = [], []
    for r in range(2):
        f = torch.zeros(2, 2, 3)  # (S, 2 halves, 3): gate = f[:, 0], up = f[:, 1]
        for i in range(2):
            f[i, 0] = float(old[0, r * 2 + i])
            f[i, 1] = 100.0 + old[0, r * 2 + i]
        fused.append(f)
        ws.append([[f[:, 0], f[:, 1]]])
    rearrange_expert_weights_inplace(old, new, ws, communicator=InProcessCommunicator(2), buffer=TransferBuffer())
    for r in range(2):
        expect = new[0, r * 2 : r * 2 + 2]
        assert fused[r][:, 0, 0].tolist() == [float(e) for e in expect]
        assert fused[r][:, 1, 0].tolist() == [100.0 + e for e in expect]


def test_views_interleaved_element_by_element_are_moved_and_overlapping_ones_refused():
    """f[:, 0::2] and f[:, 1::2] (alternate elements of a fused row) move bit-exact; overlapping views are refused."""
    old, new = np.array([[0, 1, 2, 3]]), np.array([[3, 2, 1, 0]])
    fused = [torch.arange(16.0).reshape(2, 8) + 100 * r for r in range(2)]
    before = {int(old[0, r * 2 + i]): fused[r][i].clone() for r in range(2) for i in range(2)}
    ws = [[[f[:, 0::2], f[:, 1::2]]] for f in fused]
    rearrange_expert_weights_inplace(old, new, ws, communicator=InProcessCommunicator(2), buffer=TransferBuffer())
    for r in range(2):
        for i in range(2):
            assert torch.equal(fused[r][i], before[int(new[0, r * 2 + i])])
    f = torch.zeros(2, 10)
    with pytest.raises(ValueError, match="share memory"):
        rearrange_expert_weights_inplace(np.array([[0, 1]]), np.array([[1, 0]]), [[[f[:, 0:8:2], f[:, 2:10:2]]]],
                                         communicator=InProcessCommunicator(1), buffer=TransferBuffer())


def test_a_pending_layer_cannot_commit_rows_reallocated_or_released():
    """A profile call that reallocates the buffer, or release(), makes the pending layer's commit a ValueError."""
    old, new, _, _, lw = _swap_layer()
    comm = InProcessCommunicator(2)
    buf = TransferBuffer()
    pending = transfer_layer_to_buffer(old, new, lw, buf, communicator=comm)
    other = [[[torch.zeros(2, 8)]] for _ in range(2)]   # another model's row width: the buffer is reallocated
    rearrange_expert_weights_inplace(old[None], old[None], other, communicator=comm, is_profile=True, buffer=buf)
    before = [[w.clone() for w in rw] for rw in lw]
    with pytest.raises(ValueError, match="re-allocated or released"):
        commit_layer_from_buffer(pending, lw)
    assert all(torch.equal(a, b) for rw, rb in zip(lw, before) for a, b in zip(rw, rb))
    pending = transfer_layer_to_buffer(old, new, lw, buf, communicator=comm)
    buf.release()
    with pytest.raises(ValueError, match="re-allocated or released"):
        commit_layer_from_buffer(pending, lw)


def test_weights_that_require_grad_move_bit_exact():
    """nn.Parameter weights (requires_grad=True) move in place exactly as plain tensors do, in both entry points."""
    old, new, _, _, lw = _swap_layer()
    plain = [[w.detach().float() for w in rw] for rw in lw]
    comm = InProcessCommunicator(2)
    expected = [[w.clone() for w in rw] for rw in plain]
    rearrange_expert_weights_inplace(old[None], new[None], [[rw] for rw in expected], communicator=comm)
    params = [[torch.nn.Parameter(w.clone()) for w in rw] for rw in plain]
    commit_layer_from_buffer(transfer_layer_to_buffer(old, new, params, TransferBuffer(), communicator=comm), params)
    full = [[torch.nn.Parameter(w.clone()) for w in rw] for rw in plain]
    rearrange_expert_weights_inplace(old[None], new[None], [[rw] for rw in full], communicator=comm)
    for moved in (params, full):
        assert all(p.requires_grad and torch.equal(p.detach(), e) for rp, re in zip(moved, expected)
                   for p, e in zip(rp, re))
    assert not all(torch.equal(e, p) for re, rp in zip(expected, plain) for e, p in zip(re, rp))  # rows did move
