"""Local-copy ordering: direct copies read every row before it is overwritten, one staged copy per cycle."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eplb_fsm.transfer import (
    InProcessCommunicator,
    TransferBuffer,
    commit_layer_from_buffer,
    rearrange_expert_weights_inplace,
    transfer_layer_to_buffer,
)
from eplb_fsm.transfer.local_copies import order_local_copies
from test_transfer_execute import check_world, make_world


def _simulate(dst, src, order, num_rows):
    """Run the order on symbolic rows: returns what each row holds afterwards."""
    rows = {r: ("old", r) for r in range(num_rows)}
    buffer = {d: rows[s] for d, s in zip(order.staged_rows.tolist(), order.staged_src_rows.tolist())}
    for d, s in zip(order.direct_rows.tolist(), order.direct_src_rows.tolist()):
        rows[d] = rows[s]
    for d in order.staged_rows.tolist():
        rows[d] = buffer[d]
    return rows


def _cycles(dst, src) -> int:
    """Cycles of 'copy i reads the row copy j writes' (the least number of staged copies)."""
    writer = {d: i for i, d in enumerate(dst)}
    colour = [0] * len(dst)
    count = 0
    for start in range(len(dst)):
        path = []
        i = start
        while i is not None and colour[i] == 0:
            colour[i] = 1
            path.append(i)
            i = writer.get(src[i])
        if i is not None and colour[i] == 1:
            count += 1
        for j in path:
            colour[j] = 2
    return count


def test_swap_stages_one_row_and_copies_the_other_directly():
    """Two rows trading experts: one is staged through the buffer, the other copied straight."""
    order = order_local_copies(np.array([0, 1]), np.array([1, 0]))
    assert order.staged_rows.tolist() == [0] and order.staged_src_rows.tolist() == [1]
    assert order.direct_rows.tolist() == [1] and order.direct_src_rows.tolist() == [0]


def test_chain_needs_no_buffer_and_reads_before_writing():
    """A chain 3<-2<-1<-0 is copied directly, from the end of the chain back."""
    order = order_local_copies(np.array([1, 2, 3]), np.array([0, 1, 2]))
    assert order.staged_rows.size == 0
    assert order.direct_rows.tolist() == [3, 2, 1]


def test_one_source_read_by_two_rows_before_it_is_rewritten():
    """Row 0 feeds rows 1 and 2 and is itself refilled from row 2: every reader sees the old row 0."""
    dst, src = [0, 1, 2], [2, 0, 0]
    order = order_local_copies(np.array(dst), np.array(src))
    rows = _simulate(dst, src, order, 3)
    assert [rows[d] for d in dst] == [("old", s) for s in src]
    assert order.staged_rows.size == 1


def test_order_is_deterministic_and_integer():
    """The same input gives the same int64 arrays."""
    a = order_local_copies(np.array([4, 1, 3, 0]), np.array([1, 4, 0, 3]))
    b = order_local_copies(np.array([4, 1, 3, 0]), np.array([1, 4, 0, 3]))
    for x, y in zip((a.direct_rows, a.direct_src_rows, a.staged_rows, a.staged_src_rows),
                    (b.direct_rows, b.direct_src_rows, b.staged_rows, b.staged_src_rows)):
        assert x.dtype == np.int64 and np.array_equal(x, y)
    assert a.staged_rows.tolist() == [0, 1]  # two 2-cycles, each broken at its lowest row


@pytest.mark.parametrize(
    "dst, src, match",
    [([0, 1], [1], "local_src_rows: length 1"), ([0, 0], [1, 2], "local_rows: destination rows must be distinct")],
)
def test_bad_input_is_rejected(dst, src, match):
    """Mismatched lengths and repeated destinations raise ValueError naming the field."""
    with pytest.raises(ValueError, match=match):
        order_local_copies(np.array(dst), np.array(src))


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_random_local_copies_are_exact_and_stage_one_row_per_cycle(data):
    """Any set of local copies ends with every row holding its source's old contents, staging exactly one copy per
    cycle."""
    num_rows = data.draw(st.integers(1, 12))
    dst = data.draw(st.lists(st.integers(0, num_rows - 1), unique=True, max_size=num_rows))
    src = [data.draw(st.integers(0, num_rows - 1).filter(lambda s, d=d: s != d)) if num_rows > 1 else 0 for d in dst]
    if num_rows == 1:
        dst, src = [], []
    order = order_local_copies(np.array(dst, dtype=np.int64), np.array(src, dtype=np.int64))
    rows = _simulate(dst, src, order, num_rows)
    assert [rows[d] for d in dst] == [("old", s) for s in src]
    assert sorted(order.direct_rows.tolist() + order.staged_rows.tolist()) == sorted(dst)
    assert order.staged_rows.size == _cycles(dst, src)


@settings(max_examples=60, deadline=None)
@given(st.permutations(list(range(8))), st.permutations(list(range(8))))
def test_in_rank_permutations_are_bit_exact_and_buffer_only_the_staged_rows(perm_a, perm_b):
    """Two ranks permuting their own rows: bit-exact, and only one buffer row per cycle is written before commit."""
    g, s = 2, 8
    old = np.arange(g * s, dtype=np.int64)[None, :]
    new = np.concatenate([np.array(perm_a), s + np.array(perm_b)])[None, :]
    weights, tables = make_world(old, g)
    comm = InProcessCommunicator(g)
    buffer = TransferBuffer()
    layer = [weights[r][0] for r in range(g)]
    for r in range(g):
        for t in buffer.ensure(r, layer[r]):
            t.view(torch.uint8).fill_(0xA5)  # a sentinel no row of the fill pattern equals everywhere
    pending = transfer_layer_to_buffer(old[0], new[0], layer, buffer, communicator=comm)
    assert comm.total_messages == 0
    for r in range(g):
        o, n = old[0, r * s : (r + 1) * s], new[0, r * s : (r + 1) * s]
        changed = np.flatnonzero(o != n)
        src_of = {int(e): i for i, e in enumerate(o)}
        staged = order_local_copies(changed, np.array([src_of[int(n[d])] for d in changed])).staged_rows
        touched = [i for i in range(s) if not bool((buffer.tensors(r)[1][i].view(torch.uint8) == 0xA5).all())]
        assert touched == sorted(staged.tolist())
    commit_layer_from_buffer(pending, layer)
    check_world(weights, tables, old, new, g)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_pipelined_layers_with_cycles_and_remote_rows_are_bit_exact(seed):
    """Several layers mixing in-rank cycles, chains and remote rows stay bit-exact through the pipelined commit
    split."""
    rng = np.random.default_rng(seed)
    g, s, num_layers = 3, 6, 4
    p = g * s
    old = np.stack([rng.permutation(p) for _ in range(num_layers)])
    new = old.copy()
    for k in range(num_layers):
        for r in range(g):  # permute within each rank: cycles and chains of local copies
            new[k, r * s : (r + 1) * s] = rng.permutation(old[k, r * s : (r + 1) * s])
        swap = rng.choice(p, size=4, replace=False)  # plus a few rows that cross ranks
        new[k, swap] = new[k, swap[::-1]]
    weights, tables = make_world(old, g)
    comm = InProcessCommunicator(g)
    rearrange_expert_weights_inplace(old, new, weights, communicator=comm, buffer=TransferBuffer())
    check_world(weights, tables, old, new, g)
