"""Migration batching: coalescing per (src, dst) pair and waves of one peer per rank."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from eplb_fsm.transfer.batching import coalesce, plan_waves, single_wave
from eplb_fsm.transfer.plan import layer_transfers


def _check_waves(t, waves):
    """Each rank talks to <= 1 peer per wave; waves cover every coalesced pair exactly once."""
    seen_pairs = []
    seen_idx = []
    for wave in waves:
        partner: dict[int, int] = {}
        for s, d in wave.pairs:
            assert partner.get(s, d) == d, f"rank {s} talks to two peers in {wave.pairs}"
            assert partner.get(d, s) == s, f"rank {d} talks to two peers in {wave.pairs}"
            partner[s], partner[d] = d, s
        seen_pairs.extend(wave.pairs)
        seen_idx.extend(wave.indices().tolist())
    groups = coalesce(t)
    assert sorted(seen_pairs) == sorted(groups)
    assert sorted(seen_idx) == list(range(len(t)))
    for wave in waves:
        for pair, idx in zip(wave.pairs, wave.transfers):
            assert np.array_equal(idx, groups[pair])


def test_coalesce_groups_per_pair_ordered_by_expert():
    """coalesce returns, per (src, dst), the transfer indices sorted by expert."""
    # rank 0 holds 0,1,2; rank 1 holds 3,4,5 -> full swap: one pair each way, 3 experts
    old = np.array([0, 1, 2, 3, 4, 5])
    new = np.array([3, 4, 5, 0, 1, 2])
    t = layer_transfers(old, new, 2)
    groups = coalesce(t)
    assert sorted(groups) == [(0, 1), (1, 0)]
    assert t.expert[groups[(0, 1)]].tolist() == [0, 1, 2]
    assert t.expert[groups[(1, 0)]].tolist() == [3, 4, 5]


def test_swap_fits_one_wave():
    """Both directions between the same two ranks share a wave (each talks to one peer)."""
    t = layer_transfers(np.array([0, 1, 2, 3]), np.array([2, 3, 0, 1]), 2)
    waves = plan_waves(t)
    assert len(waves) == 1 and waves[0].pairs == ((0, 1), (1, 0))
    _check_waves(t, waves)


def test_ring_needs_three_waves_in_greedy_order():
    """A 3-rank ring (0->1, 1->2, 2->0) cannot share waves: greedy first fit gives 3, in (src, dst) order."""
    old = np.array([0, 1, 2])
    new = np.array([2, 0, 1])
    t = layer_transfers(old, new, 3)
    waves = plan_waves(t)
    assert [w.pairs for w in waves] == [((0, 1),), ((1, 2),), ((2, 0),)]
    assert waves[0].peers_of(0) == [1] and waves[0].peers_of(2) == []


def test_bigger_pairs_first():
    """Pairs with more transfers are placed first (then by (src, dst))."""
    # rank 0 sends 2 experts to rank 2; rank 1 sends 1 expert to rank 2
    old = np.array([0, 1, 2, 5, 3, 4])
    new = np.array([0, 1, 2, 5, 0, 2])
    t = layer_transfers(old, new, 3)
    waves = plan_waves(t)
    assert [w.pairs for w in waves] == [((0, 2),), ((1, 2),)]


def test_no_transfers_no_waves():
    """A layer without remote moves has no waves, batched or not."""
    t = layer_transfers(np.array([0, 1, 2, 3]), np.array([1, 0, 3, 2]), 2)
    assert plan_waves(t) == [] and single_wave(t) == []


def test_single_wave_holds_everything():
    """Without batching one wave carries every pair."""
    t = layer_transfers(np.array([0, 1, 2]), np.array([2, 0, 1]), 3)
    (wave,) = single_wave(t)
    assert wave.pairs == ((0, 1), (1, 2), (2, 0))
    assert wave.indices().tolist() == [0, 1, 2]


@st.composite
def _layer(draw):
    g = draw(st.integers(2, 8))
    s = draw(st.integers(1, 4))
    p = g * s
    n = draw(st.integers(1, p))
    old = np.array(draw(st.lists(st.integers(0, n - 1), min_size=p, max_size=p)))
    held = sorted(set(old.tolist()))
    picks = draw(st.lists(st.integers(0, 10**6), min_size=p, max_size=p))
    new = np.array([held[v % len(held)] for v in picks])
    return old, new, g


@settings(max_examples=500, deadline=None)
@given(_layer())
def test_waves_one_peer_per_rank_and_cover_exactly(case):
    """On random layers every wave is a matching and the waves cover exactly the coalesced transfers."""
    old, new, g = case
    t = layer_transfers(old, new, g)
    waves = plan_waves(t)
    _check_waves(t, waves)
    again = plan_waves(t)  # deterministic: same input, same waves
    assert [w.pairs for w in again] == [w.pairs for w in waves]
