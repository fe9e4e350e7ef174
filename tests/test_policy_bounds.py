"""Tests for eplb_fsm.policy.bounds: rank loads, balancedness and the lower bound."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eplb_fsm.policy.bounds import (
    balancedness_bound,
    balancedness_per_layer,
    max_load_lower_bound,
    placement_balancedness,
    rank_loads,
)
from eplb_fsm.policy.default import DefaultEplbPolicy


def test_rank_loads_split_replicas_and_skip_empty_slots():
    """A slot carries load / replica count; -1 slots carry nothing."""
    weight = np.array([[6.0, 2.0, 4.0]])
    phy2log = np.array([[0, 1, 0, 2, -1, 0]])  # expert 0 has 3 replicas
    assert rank_loads(phy2log, weight, 3).tolist() == [[2.0 + 2.0, 2.0 + 4.0, 0.0 + 2.0]]


def test_balancedness_hand_case():
    """Per layer mean/max; aggregate is sum(mean)/sum(max), not the mean of ratios."""
    weight = np.array([[3.0, 1.0], [1.0, 1.0]])
    phy2log = np.array([[0, 1], [0, 1]])
    # layer 0: ranks 3, 1 -> mean 2, max 3; layer 1: 1, 1 -> mean 1, max 1
    assert balancedness_per_layer(phy2log, weight, 2).tolist() == [2 / 3, 1.0]
    assert placement_balancedness(phy2log, weight, 2) == pytest.approx(3 / 4)


def test_a_bfloat16_load_scores_as_its_float32_values():
    """A bfloat16 weight (a dtype numpy lacks) is read exactly, and a meta one is refused by name."""
    weight = torch.tensor([[3.0, 1.0, 0.5], [1.0, 1.0, 2.0]])
    phy2log = np.array([[0, 1, 2, 0], [0, 1, 2, 2]])
    assert placement_balancedness(phy2log, weight.bfloat16(), 2) == placement_balancedness(phy2log, weight, 2)
    with pytest.raises(ValueError, match="weight must hold data"):
        rank_loads(phy2log, weight.to("meta"), 2)


def test_zero_load_layers_are_perfect():
    """A layer without load counts as balanced (1.0) and does not divide by zero."""
    weight = np.array([[0.0, 0.0], [4.0, 0.0]])
    phy2log = np.array([[0, 1], [0, 1]])
    assert balancedness_per_layer(phy2log, weight, 2).tolist() == [1.0, 0.5]
    assert placement_balancedness(phy2log, weight, 2) == 0.5
    assert placement_balancedness(phy2log, np.zeros((2, 2)), 2) == 1.0
    assert balancedness_bound(np.zeros((2, 2)), 2, 2) == 1.0


def test_torch_and_numpy_inputs_agree():
    """Tensors and arrays give the same figures."""
    weight = np.random.default_rng(0).random((3, 8))
    phy2log = np.tile(np.arange(8), (3, 1))
    a = placement_balancedness(phy2log, weight, 4)
    b = placement_balancedness(torch.from_numpy(phy2log), torch.from_numpy(weight), 4)
    assert a == b
    assert max_load_lower_bound(torch.from_numpy(weight), 8, 4).tolist() == max_load_lower_bound(weight, 8, 4).tolist()


@pytest.mark.parametrize(
    "weight, replicas, ranks, expected",
    [
        ([[8, 2, 2]], 4, 2, 6.0),  # total/G = 6 beats best per-replica 4 (counts 2,1,1)
        ([[9, 1]], 3, 3, 4.5),  # per-replica 9/2 beats total/G = 10/3
        ([[9, 1]], 2, 2, 9.0),  # no redundancy: the hot expert alone
        ([[0, 0]], 4, 2, 0.0),
    ],
)
def test_max_load_lower_bound_hand_cases(weight, replicas, ranks, expected):
    """The lower bound is max(total / G, best max per-replica load)."""
    assert max_load_lower_bound(np.array(weight, dtype=float), replicas, ranks).tolist() == [expected]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=4), st.integers(0, 4))
def test_greedy_replication_bound_is_optimal(values, extra):
    """The bound's per-replica term equals brute force over all replica-count assignments."""
    w = np.array([values], dtype=float)
    n = len(values)
    best = min(
        max(v / c for v, c in zip(values, counts))
        for counts in itertools.product(range(1, extra + 2), repeat=n)
        if sum(counts) == n + extra
    )
    bound = max_load_lower_bound(w, n + extra, 10**9)  # huge G: total/G ~ 0, only the replica term
    assert bound[0] == pytest.approx(best)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 3), st.integers(1, 4), st.integers(0, 6), st.integers(0, 2**32 - 1))
def test_no_placement_beats_the_bound(layers, ranks, extra, seed):
    """Random placements and the policy's placement never exceed balancedness_bound."""
    rng = np.random.default_rng(seed)
    experts = int(rng.integers(1, 8))
    replicas = ranks * -(-(experts + extra) // ranks)
    weight = rng.integers(0, 100, (layers, experts)).astype(float)
    bound = balancedness_bound(weight, replicas, ranks)
    phy2log = np.concatenate(
        [np.tile(np.arange(experts), (layers, 1)), rng.integers(0, experts, (layers, replicas - experts))], axis=1
    )
    phy2log = rng.permuted(phy2log, axis=1)
    assert placement_balancedness(phy2log, weight, ranks) <= bound + 1e-12
    planned = DefaultEplbPolicy.rebalance_experts(torch.from_numpy(weight), replicas, 1, 1, ranks)[0]
    assert placement_balancedness(planned, weight, ranks) <= bound + 1e-12
    per_layer_bound = max_load_lower_bound(weight, replicas, ranks)
    assert (rank_loads(planned, weight, ranks).max(axis=1) >= per_layer_bound - 1e-9).all()


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: rank_loads(np.zeros((2, 4), int), np.ones((3, 2)), 2), "layers"),
        (lambda: rank_loads(np.zeros((1, 4), int), np.ones((1, 2)), 3), "num_ranks"),
        (lambda: rank_loads(np.array([[0, 5]]), np.ones((1, 2)), 1), "phy2log entries"),
        (lambda: rank_loads(np.zeros((1, 2)), np.ones((1, 2)), 1), "integers"),
        (lambda: rank_loads(np.zeros(4, int), np.ones((1, 4)), 1), "2-D"),
        (lambda: max_load_lower_bound(np.ones((1, 4)), 3, 1), "num_replicas"),
        (lambda: max_load_lower_bound(np.ones((1, 4)), 4, 0), "num_ranks"),
    ],
)
def test_bad_input(call, match):
    """Mismatched shapes and impossible counts raise ValueError."""
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -1.0])
def test_a_nan_infinite_or_negative_load_is_refused(bad):
    """A NaN, infinite or negative weight raises ValueError naming weight (a NaN scored as perfect 1.0 before)."""
    weight = np.array([[bad, 1.0, 1.0, 1.0]])
    for call in (lambda: placement_balancedness(np.array([[0, 1, 2, 3]]), weight, 2),
                 lambda: balancedness_bound(weight, 4, 2), lambda: max_load_lower_bound(weight, 4, 2)):
        with pytest.raises(ValueError, match="weight must hold finite loads >= 0"):
            call()


@pytest.mark.parametrize("replicas, ranks, name", [(4.0, 2, "num_replicas"), (4, 2.0, "num_ranks"),
                                                   (True, 2, "num_replicas"), (4, True, "num_ranks")])
def test_counts_that_are_not_integers_are_refused_by_name(replicas, ranks, name):
    """A float or bool count is a ValueError naming the argument, not a TypeError or a count of 1."""
    with pytest.raises(ValueError, match=f"{name} must be an integer"):
        max_load_lower_bound(np.ones((1, 4)), replicas, ranks)
    with pytest.raises(ValueError, match="num_ranks must be an integer"):
        rank_loads(np.array([[0, 1, 2, 3]]), np.ones((1, 4)), 2.0)


@pytest.mark.parametrize("weight", [
    np.full((1, 4), 1e308),  # each load finite, the layer's total is not
    np.full((2, 1), 1e308),  # each layer's total finite, their sum over layers is not
])
@pytest.mark.parametrize("call", [
    lambda w: placement_balancedness(np.zeros((w.shape[0], 4), np.int64) + np.arange(4) % w.shape[1], w, 1),
    lambda w: balancedness_per_layer(np.zeros((w.shape[0], 4), np.int64) + np.arange(4) % w.shape[1], w, 2),
    lambda w: rank_loads(np.zeros((w.shape[0], 4), np.int64) + np.arange(4) % w.shape[1], w, 2),
    lambda w: max_load_lower_bound(w, 4, 1),
    lambda w: balancedness_bound(w, 4, 1),
])
def test_loads_whose_total_overflows_float64_are_refused_naming_weight(weight, call):
    """Finite loads that sum past float64's range raise ValueError naming weight, never NaN, inf or another name."""
    with pytest.raises(ValueError, match=r"^weight: .* must sum to a finite float64"):
        call(weight)


def test_loads_just_inside_float64_are_scored():
    """Loads whose total is finite (two of 8e307) still give finite scores."""
    weight = np.full((1, 2), 8e307)
    assert balancedness_bound(weight, 2, 2) == 1.0
    assert np.isfinite(max_load_lower_bound(weight, 2, 1)).all()


def _greedy_lower_bound(weight, num_replicas, num_ranks):
    """The bound as first written: one greedy replication step per redundant slot, from one replica each."""
    w = np.asarray(weight, dtype=np.float64)
    count = np.ones_like(w)
    per_replica = w.copy()
    rows = np.arange(w.shape[0])
    for _ in range(num_replicas - w.shape[1]):
        expert = per_replica.argmax(axis=1)
        count[rows, expert] += 1
        per_replica[rows, expert] = w[rows, expert] / count[rows, expert]
    return np.maximum(w.sum(axis=1) / num_ranks, per_replica.max(axis=1, initial=0.0))


def _random_loads(rng, kind, shape):
    """Loads of one of eight kinds: uniform, small integers (ties), subnormal, huge, 0/1, zipf, wide, tiny."""
    if kind == 0:
        return rng.random(shape)
    if kind == 1:
        return rng.integers(0, 5, shape).astype(np.float64)
    if kind == 2:
        return 5e-324 * rng.integers(0, 50, shape)
    if kind == 3:
        return rng.random(shape) * 1e307 / shape[1]
    if kind == 4:
        return (rng.random(shape) < 0.3).astype(np.float64)
    if kind == 5:
        return rng.zipf(1.5, shape).astype(np.float64)
    if kind == 6:
        return np.exp(rng.normal(0.0, 30.0, shape))
    return rng.random(shape) * 2.0**-1020


def test_lower_bound_equals_one_greedy_step_per_slot_on_random_loads():
    """The head-started greedy returns bit for bit what one step per redundant slot returns, ties and subnormals too."""
    rng = np.random.default_rng(7)
    for case in range(800):
        layers, experts = int(rng.integers(1, 5)), int(rng.integers(1, 9))
        replicas, ranks = experts + int(rng.integers(0, 300)), int(rng.integers(1, 5))
        weight = _random_loads(rng, case % 8, (layers, experts))
        want = _greedy_lower_bound(weight, replicas, ranks)
        assert np.array_equal(max_load_lower_bound(weight, replicas, ranks), want), (case, weight, replicas)
        total = float((weight.sum(axis=1) / ranks).sum())
        expected = total / float(want.sum()) if want.sum() > 0 else 1.0
        assert balancedness_bound(weight, replicas, ranks) == expected


@pytest.mark.timeout(30)
def test_lower_bound_with_a_billion_slots_is_exact_without_a_step_per_slot():
    """P = 3 * 2**29: the optimum (2**29 and 2**30 replicas of loads 1, 2) comes back at once, not in 1.6e9 steps."""
    replicas = 3 * 2**29
    assert max_load_lower_bound(np.array([[1.0, 2.0]]), replicas, 2**31 - 1).tolist() == [2.0**-29]
    assert max_load_lower_bound(np.array([[2.0**-1000]]), 2**31 - 1, 2**31 - 1).tolist() == [2.0**-1000 / (2**31 - 1)]


@pytest.mark.timeout(30)
def test_num_replicas_at_the_policies_limit_is_refused():
    """num_replicas >= 2**31, which every policy refuses, is a ValueError naming it rather than a very long loop."""
    for call in (max_load_lower_bound, balancedness_bound):
        with pytest.raises(ValueError, match=r"^num_replicas must be below 2\*\*31"):
            call(np.ones((1, 2)), 2**31, 1)


@pytest.mark.parametrize("weight", [np.ones((1, 2), dtype=bool), np.array([["1", "2"]]), np.ones((1, 2)) * 1j])
def test_weight_that_is_not_real_numbers_is_refused(weight):
    """Bools, strings and complex loads are a ValueError naming weight, as the policies and stats.balancedness do."""
    with pytest.raises(ValueError, match=r"^weight must hold real numbers"):
        max_load_lower_bound(weight, 2, 1)


def test_a_layer_without_experts_has_a_lower_bound_of_zero():
    """(L, 0) weights: no expert takes a slot, so every layer's bound is 0 (the greedy never asks argmax of nothing)."""
    np.testing.assert_array_equal(max_load_lower_bound(np.zeros((2, 0)), 4, 2), [0.0, 0.0])
