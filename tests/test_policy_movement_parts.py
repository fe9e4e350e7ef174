"""Tests of the movement-aware policy's parts: counting, renumbering, goals, search bookkeeping.

Each fast (vectorised) helper is checked against a slow, obvious version on random input.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eplb_fsm.policy.default import DefaultEplbPolicy
from eplb_fsm.policy.movement import MovementAwarePolicy
from eplb_fsm.policy.movement.targets import lagrange_levels, water_level
from eplb_fsm.policy.movement.placement import (
    check_target, expert_counts, fill_empty_slots, membership, moved_mask, moves_per_layer, rank_counts,
    rank_membership, slot_loads,
)
from eplb_fsm.policy.movement.targets import _first_come_rows, _greedy_assignment, align_rows, renumbered_default
from eplb_fsm.policy.movement.policy import plan_movement
from eplb_fsm.policy.movement.search import SearchState
from eplb_fsm.sim.loads import drift


@st.composite
def placements(draw, allow_empty: bool = True):
    """(old, new, num_experts, num_ranks): two placements of the same shape, repeats likely."""
    layers = draw(st.integers(1, 4))
    ranks = draw(st.integers(1, 5))
    slots_per_rank = draw(st.integers(1, 4))
    experts = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    low = -1 if allow_empty and draw(st.booleans()) else 0
    shape = (layers, ranks * slots_per_rank)
    return rng.integers(low, experts, shape), rng.integers(low, experts, shape), experts, ranks


# --------------------------------------------------------------------------- counting


@settings(max_examples=80)
@given(placements())
def test_counts_match_a_plain_loop(case):
    """membership, rank_counts, expert_counts and moves_per_layer agree with per-slot loops."""
    old, new, experts, ranks = case
    layers, slots = old.shape
    per_rank = slots // ranks
    counts = np.zeros((layers, experts, ranks), dtype=np.int64)
    for layer in range(layers):
        for p in range(slots):
            if old[layer, p] >= 0:
                counts[layer, old[layer, p], p // per_rank] += 1
    assert (rank_counts(old, experts, ranks) == counts).all()
    assert (membership(old, experts, ranks) == (counts > 0)).all()
    assert (expert_counts(old, experts) == counts.sum(2)).all()
    assert (moves_per_layer(counts > 0, new) == moved_mask(old, new, ranks).sum(1)).all()


def test_slot_loads_split_an_expert_evenly():
    """Every slot of an expert carries load / replicas; empty slots carry nothing."""
    w = np.array([[6.0, 3.0]])
    phy = np.array([[0, 0, 1, -1]])
    assert slot_loads(w, phy, expert_counts(phy, 2)).tolist() == [[3.0, 3.0, 3.0, 0.0]]


def test_fill_empty_slots_prefers_the_rank_under_a_move_limit():
    """With num_ranks an empty slot takes its rank's most loaded expert per replica; an empty rank takes any."""
    w = np.array([[1.0, 2.0, 9.0, 4.0]] * 2)
    old = np.array([[0, -1, 1, 3, 2, 2], [0, 1, 2, 3, -1, -1]])
    free, limited = old.copy(), old.copy()
    fill_empty_slots(free, w, np.arange(2))
    fill_empty_slots(limited, w, np.arange(2), num_ranks=3)
    assert free.tolist() == [[0, 2, 1, 3, 2, 2], [0, 1, 2, 3, 2, 2]]
    assert limited.tolist() == [[0, 0, 1, 3, 2, 2], [0, 1, 2, 3, 2, 2]]


# --------------------------------------------------------------------------- renumbering


@settings(max_examples=80)
@given(placements())
def test_align_rows_matches_row_by_row_matching(case):
    """The membership shortcut gives the same rows as matching every rank row by row."""
    old, new, experts, ranks = case
    aligned = align_rows(old, new, ranks)
    per_rank = old.shape[1] // ranks
    old_rows, new_rows = old.reshape(-1, per_rank), new.reshape(-1, per_rank)
    hit, used = _first_come_rows(old_rows, new_rows)
    expected = np.where(hit, old_rows, 0)
    for b in range(old_rows.shape[0]):  # unclaimed rows take the unused entries in order
        expected[b, ~hit[b]] = new_rows[b, ~used[b]]
    assert (aligned == expected.reshape(old.shape)).all()


@settings(max_examples=40)
@given(st.integers(1, 4), st.integers(1, 7), st.integers(0, 2**31 - 1))
def test_greedy_assignment_is_a_permutation(rows, size, seed):
    """Every row index gets a distinct column; a dominant diagonal is kept as the identity."""
    rng = np.random.default_rng(seed)
    score = rng.integers(0, 4, (rows, size, size))
    target = _greedy_assignment(score)
    assert (np.sort(target, 1) == np.arange(size)).all()
    diagonal = score + 10 * np.eye(size, dtype=np.int64)
    assert (_greedy_assignment(diagonal) == np.arange(size)).all()


@settings(max_examples=40)
@given(placements(allow_empty=False))
def test_renumbered_default_moves_no_more(case):
    """The renumbered placement holds the same rank contents, and never moves more slots."""
    old, new, experts, ranks = case
    held = membership(old, experts, ranks)
    out, moved = renumbered_default(old, held, new, ranks, 1)
    per_rank = old.shape[1] // ranks
    rank_sets = lambda x: np.sort(np.sort(x.reshape(x.shape[0], ranks, per_rank), 2).reshape(x.shape[0], ranks, -1), 1)
    assert (rank_sets(out) == rank_sets(new)).all()
    assert (moved == moves_per_layer(held, out)).all()
    assert (moved <= moves_per_layer(held, new)).all()


# --------------------------------------------------------------------------- goals


def _lagrange_on_full_grids(rank_loads, floor, budget):
    """The goals of ``lagrange_levels`` with every grid price evaluated (no bisection)."""
    r = -np.sort(-rank_loads, axis=1)
    need = r[:, 0].sum() - budget
    if need <= 0:
        return r[:, 0].copy()
    level = np.concatenate([np.maximum(r, floor[:, None]), floor[:, None]], axis=1)
    reduction = level[:, :1] - level
    k = np.arange(level.shape[1])
    rows = np.arange(level.shape[0])
    hi = float(reduction.max()) + 1.0
    mu = hi * 0.5 ** np.arange(40.0)[::-1]
    lo_mu, hi_mu, best = 0.0, hi, np.full(level.shape[0], level.shape[1] - 1)
    for _ in range(2):
        pick = (reduction[None] - mu[:, None, None] * k).argmax(2)
        ok = reduction[rows, pick].sum(1) >= need
        if ok.any():
            i = int(np.nonzero(ok)[0].max())
            best, lo_mu = pick[i], float(mu[i])
            hi_mu = float(mu[i + 1]) if i + 1 < mu.size else hi_mu
        else:
            hi_mu = float(mu[0])
        mu = np.linspace(lo_mu, hi_mu, 66)[1:-1]
    return level[rows, best]


@settings(max_examples=80)
@given(st.integers(1, 12), st.integers(1, 9), st.integers(0, 2**31 - 1), st.floats(0.5, 1.1))
def test_lagrange_bisection_equals_full_grid(layers, ranks, seed, share):
    """Bisecting the price grids finds the same goals as evaluating every grid price."""
    rng = np.random.default_rng(seed)
    loads = np.round(rng.random((layers, ranks)) * 100, 1)
    floor = loads.max(1) * rng.uniform(0.5, 1.0, layers)  # as in use: below the current max
    budget = float(loads.max(1).sum() * share)
    goals = lagrange_levels(loads, floor, budget)
    assert np.array_equal(goals, _lagrange_on_full_grids(loads, floor, budget))
    assert (goals >= floor).all() and (goals <= loads.max(1)).all()
    if floor.sum() <= budget:  # the floors leave room: the goals fit the budget
        assert goals.sum() <= budget + 1e-9


def test_water_level_fits_the_budget():
    """sum(min(m, lam * d)) meets the budget exactly when it cannot keep every max."""
    m, d = np.array([3.0, 1.0, 2.0]), np.array([1.0, 1.0, 1.0])
    lam = water_level(m, d, 4.5)
    assert np.minimum(m, lam * d).sum() == pytest.approx(4.5)
    assert water_level(m, d, 10.0) == float("inf")


# --------------------------------------------------------------------------- search bookkeeping


@pytest.mark.parametrize("sigma,seed", [(0.1, 0), (0.3, 1), (1.0, 2)])
def test_search_state_stays_consistent(sigma, seed):
    """After a full search, every incrementally kept array equals its recomputation."""
    rng = np.random.default_rng(seed)
    layers, experts, ranks, per_rank = 6, 16, 4, 5
    probs = 1 / np.arange(1, experts + 1) / 3.38
    base = np.stack([rng.multinomial(20000, rng.permutation(probs)) for _ in range(layers)])
    base = base.astype(np.float64) + 1.0
    call = (ranks * per_rank, 1, 1, ranks)
    old = DefaultEplbPolicy.rebalance_experts(torch.from_numpy(base), *call)[0].numpy()
    w = drift(base, sigma, rng)
    count = expert_counts(old, experts)
    loads = slot_loads(w, old, count)
    held = membership(old, experts, ranks)
    goal = loads.reshape(layers, ranks, per_rank).sum(-1).mean(1) * 1.001
    state = SearchState(w, old.copy(), count, loads, held, rank_counts(old, experts, ranks), goal, ranks, 1,
                        np.full(layers, per_rank * ranks))
    state.run(budget=0.0, fixed_max=0.0)
    cur = state.cur
    assert state.rounds >= 1
    assert (state.count == expert_counts(cur, experts)).all() and (state.count >= 1).all()
    assert (state.on_rank == rank_counts(cur, experts, ranks)).all()
    assert np.allclose(state.slot_load, slot_loads(w, cur, state.count))
    assert np.allclose(state.rank_load, state.slot_load.reshape(layers, ranks, per_rank).sum(-1))
    assert (state.moved == moved_mask(old, cur, ranks)).all()
    assert (state.moves == state.moved.sum(1)).all()


# a layer whose third round takes a re-point and, on ranks it does not touch, a swap: each fits
# max_moves=1 alone, not together (4 ranks of 3 slots, 2 groups on 2 nodes)
LIMIT_CASE = dict(weight=np.array([[5.0, 1.0, 5.0, 0.0, 4.0, 3.0, 3.0, 4.0]]),
                  old=np.array([[2, 2, 0, 2, 3, 1, 5, 5, 6, 5, 4, 7]]), call=(12, 2, 2, 4))


@pytest.mark.parametrize("target", [1.0, 0.99])
def test_search_round_keeps_repoint_and_swaps_within_the_move_limit(monkeypatch, target):
    """A round's re-point plus its swaps never take a layer past max_moves (the numpy search)."""
    monkeypatch.setenv("EPLB_FSM_NATIVE", "0")
    old = LIMIT_CASE["old"]
    plan = plan_movement(LIMIT_CASE["weight"], *LIMIT_CASE["call"], old, target=target, max_moves=1)
    assert plan.repaired.all() and plan.rounds >= 3
    assert moved_mask(old, plan.phy2log, 4).sum() <= 1


_OLD6 = np.array([[0, 1, 2, 3, 0, 1]])
_NEW6 = np.array([[1, 0, 2, 3, 0, 1]])


@pytest.mark.parametrize("call, match", [
    (lambda: moved_mask(_OLD6, _NEW6, 4), r"num_ranks \(4\) must divide the number of slots \(6\)"),
    (lambda: moved_mask(_OLD6, _NEW6, 5), r"num_ranks \(5\) must divide"),
    (lambda: moved_mask(_OLD6, _NEW6, 0), "num_ranks must be >= 1"),
    (lambda: moved_mask(_OLD6, _NEW6, 2.0), "num_ranks must be an integer"),
    (lambda: moved_mask(_OLD6, _NEW6, True), "num_ranks must be an integer"),
    (lambda: moved_mask(_OLD6, np.array([[-5, 0, 2, 3, 0, 1]]), 2), "new_phy2log entries must be >= -1"),
    (lambda: moved_mask(np.array([[-2, 1, 2, 3, 0, 1]]), _NEW6, 2), "old_phy2log entries must be >= -1"),
    (lambda: moved_mask(_OLD6[0], _NEW6[0], 2), "old_phy2log must be 2-D"),
    (lambda: rank_membership(_OLD6, 4, 4), r"num_ranks \(4\) must divide"),
    (lambda: rank_membership(_OLD6, 0, 4), "num_ranks must be >= 1"),
    (lambda: rank_membership(_OLD6, 2, 2), r"phy2log entries must be in \[-1, num_experts\) = \[-1, 2\)"),
    (lambda: rank_membership(np.array([[-3, 1]]), 2, 4), r"phy2log entries must be in \[-1, num_experts\)"),
    (lambda: rank_membership(_OLD6, 2, 0), "num_experts must be >= 1"),
    (lambda: rank_membership(_OLD6, 2, 4.0), "num_experts must be an integer"),
])
def test_moved_mask_and_rank_membership_refuse_bad_ranks_and_entries(call, match):
    """A rank count that is no integer >= 1 dividing P, or an entry outside the range, is a ValueError by name."""
    with pytest.raises(ValueError, match=match):
        call()


def test_moved_mask_with_valid_ranks_still_counts_only_cross_rank_moves():
    """Swaps inside a rank move nothing; the checks leave valid calls as they were."""
    assert moved_mask(_OLD6, _NEW6, 2).tolist() == [[False] * 6]
    assert moved_mask(_OLD6, _NEW6, 6).tolist() == [[True, True, False, False, False, False]]
    assert rank_membership(_OLD6, 3, 4).tolist() == [[[True, True, False, False], [False, False, True, True],
                                                      [True, True, False, False]]]


@pytest.mark.parametrize("target", [10**400, Fraction(10**400, 3), -(10**400), True, "0.9", float("nan")],
                         ids=["10**400", "Fraction(10**400, 3)", "-10**400", "True", "str", "nan"])
def test_check_target_refuses_values_float_cannot_take_by_name(target):
    """10**400 or a huge Fraction is a ValueError naming target (OverflowError before), as the config's rule."""
    with pytest.raises(ValueError, match=r"^target must be a number in \(0, 1\]"):
        check_target(target)
    with pytest.raises(ValueError, match=r"^target must be a number in \(0, 1\]"):
        MovementAwarePolicy(target=target)


def test_check_target_takes_numpy_and_fraction_targets_in_range():
    """Any real in (0, 1] passes as a float: numpy float32, a Fraction, the int 1."""
    assert check_target(np.float32(0.5)) == 0.5
    assert check_target(Fraction(1, 4)) == 0.25
    assert check_target(1) == 1.0
    with pytest.raises(ValueError, match=r"target must be a number in \(0, 1\], got 0"):
        check_target(0)
