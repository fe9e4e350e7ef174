"""All-layers planning (plan_all) equals the per-layer functions of plan, field by field."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eplb_fsm.transfer.plan import layer_transfers, plan_from_transfers
from eplb_fsm.transfer.plan_all import all_layer_transfers, plans_for_rank


def _assert_same(got, want):
    """Every field equal: ints by value, arrays by value and dtype; ours read-only."""
    assert type(got) is type(want)
    for f in dataclasses.fields(want):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if isinstance(b, np.ndarray):
            assert a.dtype == b.dtype == np.int64, f.name
            assert np.array_equal(a, b), (f.name, a, b)
            assert not a.flags.writeable, f.name
        else:
            assert a == b, f.name


def _check(old, new, g, ranks=None):
    """all_layer_transfers and plans_for_rank match layer_transfers / plan_from_transfers."""
    old = np.asarray(old, dtype=np.int64)
    new = np.asarray(new, dtype=np.int64)
    ts = all_layer_transfers(old, new, g)
    assert len(ts) == old.shape[0]
    want_ts = [layer_transfers(old[k], new[k], g, validate=False) for k in range(old.shape[0])]
    for got, want in zip(ts, want_ts):
        _assert_same(got, want)
    for r in range(g) if ranks is None else ranks:
        plans = plans_for_rank(old, new, ts, r)
        assert len(plans) == old.shape[0]
        for k, got in enumerate(plans):
            _assert_same(got, plan_from_transfers(old[k], new[k], want_ts[k], r))
    return ts


def _random_maps(rng, num_layers, g, s, num_experts, empty_old=0.1, empty_new=0.1, keep=0.3, still=0.2):
    """(L, P) old/new maps: replicas, duplicates, kept rows, empties; some layers unchanged.

    Every expert new needs is held somewhere in old (new only picks experts old holds).
    """
    p = g * s
    num_experts = min(num_experts, p)
    old = np.empty((num_layers, p), dtype=np.int64)
    new = np.empty((num_layers, p), dtype=np.int64)
    for k in range(num_layers):
        # every expert once (if room), the rest replicas, then some slots emptied
        row = np.concatenate([np.arange(num_experts), rng.integers(0, num_experts, p - num_experts)])
        row = rng.permutation(row)
        row[rng.random(p) < empty_old] = -1
        old[k] = row
        held = np.unique(row[row >= 0])
        if rng.random() < still or held.size == 0:
            new[k] = row  # a layer with nothing to move (or nothing to hold)
            continue
        n = rng.choice(held, p)  # duplicates and replicas come naturally
        kept = rng.random(p) < keep
        n[kept] = row[kept]
        n[rng.random(p) < empty_new] = -1
        new[k] = n
    return old, new


@pytest.mark.parametrize("g", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("seed", range(6))
def test_random_maps_match_per_layer(g, seed):
    """Random multi-layer maps with replicas, duplicates, kept rows and empties agree for every rank."""
    rng = np.random.default_rng(seed * 10 + g)
    s = int(rng.integers(1, 7))
    empty_old, empty_new = [(0.0, 0.0), (0.2, 0.0), (0.0, 0.3), (0.2, 0.3), (0.5, 0.5), (0.1, 0.1)][seed]
    old, new = _random_maps(rng, 7, g, s, int(rng.integers(1, g * s + 1)), empty_old, empty_new)
    _check(old, new, g)


@pytest.mark.parametrize("g", [1, 2, 3, 4, 8])
def test_single_layer(g):
    """L=1 works and matches the per-layer functions."""
    rng = np.random.default_rng(g)
    old, new = _random_maps(rng, 1, g, 4, 3 * g, still=0.0)
    _check(old, new, g)


def test_unchanged_layers_have_no_transfers():
    """Layers with no change at all give empty transfer lists and no-op plans."""
    rng = np.random.default_rng(7)
    old, _ = _random_maps(rng, 5, 4, 3, 10)
    ts = _check(old, old.copy(), 4)
    assert all(len(t) == 0 for t in ts)
    assert all(p.is_noop for r in range(4) for p in plans_for_rank(old, old, ts, r))


def test_all_empty_layers():
    """A layer whose slots are all empty (old and new), and one emptied entirely, match per-layer."""
    old = np.array([[0, 1, 2, 3, 4, 5], [-1] * 6, [5, 4, 3, 2, 1, 0], [0, 1, 2, 3, 4, 5]])
    new = np.array([[1, 1, 0, 5, 5, -1], [-1] * 6, [-1] * 6, [4, -1, 3, 0, 0, 2]])
    _check(old, new, 3)
    _check(np.full((2, 4), -1), np.full((2, 4), -1), 2)


def test_hand_layer_from_plan_tests():
    """The hand-checked two-rank layer of test_transfer_plan gives the same plans, next to a busy layer."""
    old = np.array([[0, 1, 2, 3, 4, 5, 0, 1], [7, 7, 7, 7, 1, 2, 3, 4]])
    new = np.array([[4, 4, 2, -1, 0, 1, 3, 3], [1, 2, 3, 4, 7, 7, 7, 7]])
    _check(old, new, 2)
    _check(old, new, 4)


def test_no_layers_and_bad_rank():
    """L=0 gives empty lists; a rank outside [0, G) raises ValueError like plan_from_transfers."""
    empty = np.zeros((0, 8), dtype=np.int64)
    assert all_layer_transfers(empty, empty, 2) == []
    assert plans_for_rank(empty, empty, [], 0) == []
    old = np.array([[0, 1, 2, 3]])
    ts = all_layer_transfers(old, old[:, ::-1], 2)
    with pytest.raises(ValueError, match="rank"):
        plans_for_rank(old, old[:, ::-1], ts, 2)


def test_deepseek_v3_shape():
    """(58, 288) maps on 32 ranks over 256 experts agree for every rank and layer."""
    rng = np.random.default_rng(3)
    num_layers, p, g, e = 58, 288, 32, 256
    old = np.stack(
        [rng.permutation(np.concatenate([np.arange(e), rng.integers(0, e, p - e)])) for _ in range(num_layers)]
    )
    new = old.copy()
    for k in range(num_layers):  # ~10% of slots permuted, plus some full reshuffles
        if k % 7 == 0:
            new[k] = rng.permutation(new[k])
        else:
            idx = rng.choice(p, 29, replace=False)
            new[k, idx] = new[k, rng.permutation(idx)]
    _check(old, new, g)


@st.composite
def _layers(draw):
    g = draw(st.integers(1, 6))
    s = draw(st.integers(1, 4))
    num_layers = draw(st.integers(1, 4))
    p = g * s
    n = draw(st.integers(1, p))
    olds, news = [], []
    for _ in range(num_layers):
        old = draw(st.lists(st.integers(-1, n - 1), min_size=p, max_size=p))
        held = sorted({v for v in old if v >= 0})
        picks = draw(st.lists(st.integers(-2, 10**6), min_size=p, max_size=p))
        # -2 keeps the old expert, -1 empties the slot, anything else picks a held expert
        olds.append(old)
        news.append(
            [o if v == -2 else (-1 if v == -1 or not held else held[v % len(held)]) for o, v in zip(old, picks)]
        )
    return np.array(olds), np.array(news), g


@settings(max_examples=400, deadline=None)
@given(_layers())
def test_hypothesis_matches_per_layer(case):
    """Many small random multi-layer cases agree with the per-layer functions for every rank."""
    old, new, g = case
    _check(old, new, g)


# all_layer_transfers checks its maps by check_layer_maps' rules (in C where built, else numpy)

BAD_MAPS = [
    ("P % G", [[0, 1, 2, 3]], [[1, 1, 2, 3]], 3, r"^phy2log: P=4 slots must divide by world_size=3"),
    ("id >= P", [[0, 1, 2, 3]], [[5, 1, 2, 3]], 2,
     r"^new_phy2log\[0\]: expert ids must be -1 \(empty\) or in \[0, P=4\), found 5"),
    ("id < -1", [[0, 1, 2, -2]], [[0, 1, 2, 3]], 2, r"^old_phy2log\[0\]: expert ids must be -1"),
    ("held by nobody", [[0, 1, 2, 3], [0, 1, 2, 2]], [[0, 1, 2, 3], [0, 1, 2, 3]], 2,
     r"^new_phy2log\[1\]: expert 3 is needed but held by no rank in old_phy2log"),
    ("shapes", [[0, 1]], [[0, 1, 1, 0]], 2, r"^new_phy2log: shape \(1, 4\) must equal old_phy2log's \(1, 2\)"),
    ("ndim", [0, 1], [0, 1], 2, r"^old_phy2log: must be an integer array of shape \(L, P\)"),
    ("dtype", [[0.0, 1.0]], [[0, 1]], 2, r"^old_phy2log: must be an integer array of shape \(L, P\), got float64"),
    ("world_size", [[0, 1]], [[0, 1]], 0, r"^world_size: must be a positive int, got 0"),
]


@pytest.mark.parametrize("native", ["1", "0"])
@pytest.mark.parametrize("what,old,new,g,match", BAD_MAPS, ids=[c[0] for c in BAD_MAPS])
def test_all_layer_transfers_refuses_bad_maps_by_name_and_rule(monkeypatch, native, what, old, new, g, match):
    """A wrong P % G, an id out of range or held by nobody, bad shapes/dtypes/world_size raise ValueError by name."""
    monkeypatch.setenv("EPLB_FSM_NATIVE", native)
    with pytest.raises(ValueError, match=match):
        all_layer_transfers(np.array(old), np.array(new), g)


@pytest.mark.parametrize("native", ["1", "0"])
def test_all_layer_transfers_accepts_valid_maps_with_empty_slots(monkeypatch, native):
    """Empty slots (-1) in new where old has none pass the check, and validate=False plans the same maps alike."""
    monkeypatch.setenv("EPLB_FSM_NATIVE", native)
    old, new = np.array([[0, 1, 2, 3], [3, 2, 1, 0]]), np.array([[3, -1, 0, 3], [-1, -1, -1, -1]])
    got = all_layer_transfers(old, new, 2)
    for a, b in zip(got, all_layer_transfers(old, new, 2, validate=False)):
        _assert_same(a, b)
    assert got[0].expert.tolist() == [0, 3] and got[1].expert.size == 0  # by src: rank 0 sends 0, rank 1 sends 3
