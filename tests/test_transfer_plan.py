"""Pure per-layer planning: classification of rows, the pairing rule (docs/design.md §6.2), moved slots."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eplb_fsm.transfer.plan import (
    check_layer_maps,
    layer_transfers,
    moved_slots,
    plan_layer,
    plan_layer_all_ranks,
)


def _pairs(t, expert):
    """(src, dst) pairs of one expert's transfers, sorted by dst."""
    m = t.expert == expert
    return sorted(zip(t.src[m].tolist(), t.dst[m].tolist()), key=lambda p: p[1])


def test_pairing_blocks_and_remainder():
    """2 senders, 5 receivers: k=2, sender 0 gets receivers 0,1 and 4, sender 1 gets 2,3."""
    # 7 ranks, 1 slot each; expert 0 on ranks 0 and 1, needed by ranks 2..6
    old = np.array([0, 0, 1, 2, 3, 4, 5])
    new = np.array([0, 0, 0, 0, 0, 0, 0])
    t = layer_transfers(old, new, 7)
    assert _pairs(t, 0) == [(0, 2), (0, 3), (1, 4), (1, 5), (0, 6)]


def test_pairing_more_senders_than_receivers():
    """3 senders, 2 receivers: k=0, so receiver i is served by sender i (the remainder rule)."""
    old = np.array([4, 4, 4, 1, 2])
    new = np.array([4, 4, 4, 4, 4])
    t = layer_transfers(old, new, 5)
    assert _pairs(t, 4) == [(0, 3), (1, 4)]


def test_pairing_exact_multiple():
    """2 senders, 4 receivers: k=2 and no remainder; senders take contiguous blocks."""
    old = np.array([3, 5, 3, 4, 4, 4])
    new = np.array([3, 3, 3, 3, 3, 3])
    t = layer_transfers(old, new, 6)
    assert _pairs(t, 3) == [(0, 1), (0, 3), (2, 4), (2, 5)]


def test_pairing_one_sender_many_receivers():
    """1 sender, 3 receivers: k=3, the only sender serves everyone."""
    old = np.array([3, 0, 1, 2])
    new = np.array([3, 3, 3, 3])
    t = layer_transfers(old, new, 4)
    assert _pairs(t, 3) == [(0, 1), (0, 2), (0, 3)]


def test_rows_classified_on_a_two_rank_layer():
    """Unchanged, local, primary, duplicate and empty rows and the send/recv lists, by hand."""
    # rank 0 rows: old [0 1 2 3] new [4 4 2 -1]; rank 1 rows: old [4 5 0 1] new [0 1 3 3]
    old = np.array([0, 1, 2, 3, 4, 5, 0, 1])
    new = np.array([4, 4, 2, -1, 0, 1, 3, 3])
    p0, p1 = plan_layer_all_ranks(old, new, 2)
    assert p0.unchanged_rows.tolist() == [2]
    assert p0.empty_rows.tolist() == [3]
    assert p0.primary_rows.tolist() == [0] and p0.primary_experts.tolist() == [4]
    assert p0.duplicate_rows.tolist() == [1] and p0.duplicate_src_rows.tolist() == [0]
    assert p0.local_rows.size == 0
    assert list(zip(p0.recv_peers.tolist(), p0.recv_experts.tolist(), p0.recv_rows.tolist())) == [(1, 4, 0)]
    assert list(zip(p0.send_peers.tolist(), p0.send_experts.tolist(), p0.send_rows.tolist())) == [(1, 3, 3)]
    # rank 1: rows 0,1 take experts 0,1 which it already holds at rows 2,3
    assert p1.local_rows.tolist() == [0, 1] and p1.local_src_rows.tolist() == [2, 3]
    assert p1.primary_rows.tolist() == [2] and p1.primary_experts.tolist() == [3]
    assert p1.duplicate_rows.tolist() == [3] and p1.duplicate_src_rows.tolist() == [2]
    assert list(zip(p1.send_peers.tolist(), p1.send_experts.tolist(), p1.send_rows.tolist())) == [(0, 4, 0)]


def test_sender_uses_first_row_and_receiver_primary():
    """A sender reads its first old row holding the expert; the receiver fills its first row needing it."""
    old = np.array([1, 5, 5, 2, 3, 4])  # rank 0 holds 5 at rows 1 and 2
    new = np.array([1, 5, 5, 3, 5, 5])  # rank 1 needs 5 at rows 1 and 2
    t = layer_transfers(old, new, 2)
    m = t.expert == 5
    assert t.src_row[m].tolist() == [1] and t.dst_row[m].tolist() == [1]


def test_plan_is_frozen_and_read_only():
    """Plans are frozen dataclasses with read-only arrays (safe to share between threads)."""
    p = plan_layer(np.array([0, 1]), np.array([1, 0]), 2, 0)
    with pytest.raises(Exception):
        p.rank = 3  # type: ignore[misc]
    with pytest.raises(ValueError):
        p.recv_rows[0] = 5


def test_moved_slots_counts_new_experts_per_rank():
    """moved_slots counts slots whose expert was not on that rank before; empties never count."""
    old = np.array([[0, 1, 2, 3], [0, 1, 2, 3]])
    new = np.array([[1, 0, 3, 2], [2, 2, -1, 0]])
    assert moved_slots(old[0], new[0], 2) == 0  # swaps within each rank
    assert moved_slots(old[1], new[1], 2) == 3  # rank 0 needs 2 twice, rank 1 needs 0
    assert moved_slots(old, new, 2) == 3


@pytest.mark.parametrize(
    "old,new,g,match",
    [
        (np.array([0, 1, 2]), np.array([0, 1, 2]), 2, "P % G"),
        (np.array([0, 1]), np.array([0, 1, 1]), 1, "shape"),
        (np.array([0.0, 1.0]), np.array([0, 1]), 1, "integer"),
        (np.array([0, -2]), np.array([0, 1]), 1, r"-1 \(empty\)"),
        (np.array([0, 1]), np.array([0, 2]), 1, r"-1 \(empty\)"),
        (np.array([0, 0]), np.array([0, 1]), 1, "held by no rank"),
        (np.array([[0, 1]]), np.array([[0, 1]]), 1, r"\(P,\)"),
        (torch.zeros(2, dtype=torch.int64, device="meta"), np.array([0, 1]), 1, "must hold data"),
    ],
)
def test_check_layer_maps_rejects(old, new, g, match):
    """Bad rows raise ValueError naming the field and the rule."""
    with pytest.raises(ValueError, match=match):
        check_layer_maps(old, new, g)


@st.composite
def _layer(draw):
    g = draw(st.integers(1, 6))
    s = draw(st.integers(1, 4))
    p = g * s
    n = draw(st.integers(1, p))
    old = np.array(draw(st.lists(st.integers(-1, n - 1), min_size=p, max_size=p)))
    held = sorted(set(old[old >= 0].tolist()))
    picks = draw(st.lists(st.integers(-2, 10**6), min_size=p, max_size=p))
    new = np.array(
        [o if v == -2 else (-1 if v == -1 or not held else held[v % len(held)]) for o, v in zip(old, picks)]
    )
    return old, new, g


@settings(max_examples=400, deadline=None)
@given(_layer())
def test_every_remote_need_received_once_from_a_holder(case):
    """Each (rank, expert) remote need gets exactly one transfer, from a rank holding the expert."""
    old, new, g = case
    s = old.size // g
    t = layer_transfers(old, new, g)
    got = sorted(zip(t.dst.tolist(), t.expert.tolist()))
    want = sorted(
        (r, e)
        for r in range(g)
        for e in set(new[r * s : (r + 1) * s].tolist()) - set(old[r * s : (r + 1) * s].tolist())
        if e >= 0
    )
    assert got == want
    for src, e, row in zip(t.src.tolist(), t.expert.tolist(), t.src_row.tolist()):
        assert old[src * s + row] == e
    assert moved_slots(old, new, g) == sum(p.primary_rows.size + p.duplicate_rows.size
                                           for p in plan_layer_all_ranks(old, new, g))
    # sends of every plan mirror the receives of its peers
    plans = plan_layer_all_ranks(old, new, g)
    sends = sorted((p.rank, int(q), int(e)) for p in plans for q, e in zip(p.send_peers, p.send_experts))
    recvs = sorted((int(q), p.rank, int(e)) for p in plans for q, e in zip(p.recv_peers, p.recv_experts))
    assert sends == recvs


def test_received_rows_counts_an_expert_once_per_rank_however_many_slots_gain_it():
    """A rank gaining two slots of one expert receives one row: received_rows 3 where moved_slots counts 4."""
    from eplb_fsm.transfer.plan import received_rows

    assert moved_slots([0, 1, 2, 3], [2, 2, 0, 1], 2) == 4 and received_rows([0, 1, 2, 3], [2, 2, 0, 1], 2) == 3
    old, new = np.array([[0, 1, 2, 3]] * 2), np.array([[2, 3, 0, 1], [1, 0, 3, 2]])
    assert received_rows(old, new, 2) == moved_slots(old, new, 2) == 4
    assert received_rows([0, 1, 2, 3], [-1, 1, 2, 2], 2) == 0  # empties and local duplicates cross no rank


def test_moved_slots_refuses_a_bad_world_size_and_bad_ids():
    """world_size 0 or a bool, float maps and ids outside [-1, P) are ValueErrors naming the field."""
    row = np.array([0, 1, 2, 3])
    for args, match in [((row, row, 0), "world_size must be >= 1"), ((row, row, True), "world_size must be"),
                        ((row, row.astype(float), 2), "new_phy2log: must hold integer"),
                        ((row, np.array([7, -5, 0, 1]), 2), r"new_phy2log: expert ids must be in \[-1, P=4\)")]:
        with pytest.raises(ValueError, match=match):
            moved_slots(*args)
