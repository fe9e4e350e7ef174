"""The movement-aware search's C scoring (policy/movement/native.py, csearch.c) against the numpy one."""

from __future__ import annotations

import os
import types
from unittest import mock

import numpy as np
import pytest
import torch

from eplb_fsm.policy.default import DefaultEplbPolicy
from eplb_fsm.policy.movement import moves, native, search

csearch = pytest.importorskip("eplb_fsm.policy.movement.csearch", reason="the C extension is not built")
from eplb_fsm.policy.movement.placement import membership, rank_counts
from eplb_fsm.policy.movement import policy as movement_policy
from eplb_fsm.policy.movement.policy import plan_movement
from eplb_fsm.policy.movement.targets import lagrange_levels, renumbered_default

needs_kernel = pytest.mark.skipif(not native.built(), reason="the C extension is not built (no compiler at install)")

# (layers, experts, slots, groups, nodes, ranks): global and hierarchical, 1 to 9 slots per
# rank, odd ranks per node (a rank left without a swap partner)
SHAPES = [(6, 32, 40, 1, 1, 8), (5, 24, 36, 4, 2, 6), (4, 64, 72, 8, 4, 8), (6, 12, 16, 1, 1, 16),
          (3, 30, 45, 1, 1, 5), (5, 40, 48, 1, 1, 4), (4, 48, 64, 4, 2, 16), (4, 64, 96, 1, 1, 32)]


def _problem(shape, seed: int, integer: bool, hot: bool = False):
    """A drifted load, the default's placement of the load before and the call: (new weight, old, call).

    ``hot``: one expert per layer turns 4x hotter (it may then need more replicas).
    """
    layers, experts, slots, groups, nodes, ranks = shape
    rng = np.random.default_rng(seed)
    base = rng.gamma(0.6, 100.0, size=(layers, experts)) + 1.0
    new = base * np.exp(rng.normal(0.0, 0.4, size=base.shape))
    if hot:
        new[np.arange(layers), rng.integers(0, experts, layers)] *= 4.0
    if integer:  # token counts: equal loads, equal scores, so the tie-breaks are compared too
        base, new = np.round(base), np.round(new / 10.0)
    call = (slots, groups, nodes, ranks)
    old = DefaultEplbPolicy.rebalance_experts(torch.from_numpy(base), *call)[0]
    return torch.from_numpy(new), old, call


def _plan(weight, old, call, flag: str, max_moves=None):
    with mock.patch.dict(os.environ, {"EPLB_FSM_NATIVE": flag}):
        return plan_movement(weight, *call, old, max_moves=max_moves)


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("integer", [False, True])
def test_plans_are_the_same_with_and_without_the_kernel(shape, integer):
    """Whole movement-aware plans (placement, moves, rounds) are identical on both paths, with and without a limit."""
    searched = 0
    for seed in range(4):
        weight, old, call = _problem(shape, seed, integer)
        for max_moves in (None, 3):
            c, py = _plan(weight, old, call, "1", max_moves), _plan(weight, old, call, "0", max_moves)
            assert np.array_equal(c.phy2log, py.phy2log)
            assert np.array_equal(c.moved, py.moved)
            assert c.rounds == py.rounds
            searched += c.rounds
    assert searched > 0  # the search ran, so the kernels were compared


@needs_kernel
def test_move_limit_holds_in_c_when_a_round_takes_a_repoint_and_swaps():
    """The C search keeps a round's re-point plus its swaps within max_moves, placing as the numpy search does."""
    weight = np.array([[5.0, 1.0, 5.0, 0.0, 4.0, 3.0, 3.0, 4.0]])
    old = np.array([[2, 2, 0, 2, 3, 1, 5, 5, 6, 5, 4, 7]])  # round 3: a re-point and a swap, 1 move each
    c = _plan(weight, old, (12, 2, 2, 4), "1", max_moves=1)
    py = _plan(weight, old, (12, 2, 2, 4), "0", max_moves=1)
    assert c.rounds >= 3 and c.moved.tolist() == [1]
    assert np.array_equal(c.phy2log, py.phy2log) and c.rounds == py.rounds


def _comparing(compared: dict):
    """Wrappers for search's three candidate functions that run C and numpy and compare them."""
    def numpy_path():
        return mock.patch.dict(os.environ, {"EPLB_FSM_NATIVE": "0"})

    def repoints(st, lr, RL, T):
        got = native.repoints(st, lr, RL, T)
        with numpy_path():
            want = moves.repoints(st, lr, RL, T)
        for a, b in zip(got, want):
            assert np.array_equal(a, b)
        compared["repoints"] += 1
        return want

    def pair_swaps(st, lr, RL, T):
        got = native.pair_swaps(st, lr, RL, T)
        with numpy_path():
            want = moves.pair_swaps(st, lr, RL, T)
        assert (got is None) == (want is None)
        if want is not None:
            for a, b in zip(got, want):
                assert np.array_equal(a, b)
        compared["pair_swaps"] += 1
        return want

    def widened_swap(st, lr):
        found, slot_a, slot_b = native.widened_choice(st, lr)  # before numpy applies its choice
        applied = []
        real_swap = st.swap

        def record(rows, a, b):
            applied.append((rows.copy(), a.copy(), b.copy()))
            real_swap(rows, a, b)

        with numpy_path(), mock.patch.object(st, "swap", record):
            want = moves.widened_swap(st, lr)
        assert np.array_equal(found, want)
        if found.any():
            rows, a, b = applied[0]
            assert np.array_equal(rows, lr[found])
            assert np.array_equal(a, slot_a[found]) and np.array_equal(b, slot_b[found])
        compared["widened_swap"] += 1
        return want

    return repoints, pair_swaps, widened_swap


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES)
def test_every_kernel_call_scores_as_numpy(shape):
    """Inside real searches (the numpy round loop), each C scoring call returns exactly the numpy function's result."""
    compared = {"repoints": 0, "pair_swaps": 0, "widened_swap": 0}
    repoints, pair_swaps, widened_swap = _comparing(compared)
    python_loop = types.SimpleNamespace(usable=lambda st: False)  # search.run keeps its numpy loop
    with mock.patch.object(search, "native", python_loop), mock.patch.object(search, "repoints", repoints), \
            mock.patch.object(search, "pair_swaps", pair_swaps), \
            mock.patch.object(search, "widened_swap", widened_swap):
        for seed in range(4):
            for integer in (False, True):
                weight, old, call = _problem(shape, seed, integer)
                _plan(weight, old, call, "1")
    assert compared["repoints"] + compared["pair_swaps"] > 0


def _a_search_state():
    """A SearchState as the policy builds it, captured at the start of its search."""
    weight, old, call = _problem(SHAPES[0], 0, False)
    seen = []
    real_run = search.SearchState.run

    def capture(self, *args, **kwargs):
        seen.append(self)
        return real_run(self, *args, **kwargs)

    with mock.patch.object(search.SearchState, "run", capture):
        _plan(weight, old, call, "1")
    return seen[0]


@needs_kernel
def test_kernels_refuse_buffers_of_the_wrong_size():
    """A state array or output of the wrong length, or a layer index out of range, is refused with its name."""
    st = _a_search_state()
    state, dims = native._state(st)
    lr = np.arange(st.L, dtype=np.int64)
    outputs = [np.empty(st.L), *(np.empty(st.L, np.int64) for _ in range(4)), np.empty(st.L * st.G)]
    with pytest.raises(ValueError, match="eff has"):
        csearch.repoints(state, dims, lr, np.empty(st.L - 1), *outputs[1:])
    with pytest.raises(ValueError, match="w has"):
        csearch.repoints((st.w[:-1],) + state[1:], dims, lr, *outputs)
    with pytest.raises(ValueError, match="lr must index"):
        csearch.repoints(state, dims, lr + st.L, *outputs)
    with pytest.raises(ValueError, match="12 arrays"):
        csearch.run(state[:-1], dims, 1.0, 0.0, 1, 0)


@needs_kernel
def test_usable_follows_the_environment_and_the_count_type():
    """The C path is taken only with EPLB_FSM_NATIVE unset or not 0, and for int8 replica counts per rank."""
    st = _a_search_state()
    with mock.patch.dict(os.environ, {"EPLB_FSM_NATIVE": "1"}):
        assert native.usable(st)
    with mock.patch.dict(os.environ, {"EPLB_FSM_NATIVE": "0"}):
        assert not native.usable(st)
    st.on_rank = st.on_rank.astype(np.int16)
    assert not native.usable(st)


def _placement(rng, layers: int, slots: int, experts: int, empty: float) -> np.ndarray:
    """(L, P) random placements with repeated experts on a rank and, with ``empty`` > 0, empty slots."""
    phy = rng.integers(0, experts, (layers, slots))
    phy[rng.random(phy.shape) < empty] = -1
    return phy


@needs_kernel
@pytest.mark.parametrize("ranks, nodes, per_rank", [(4, 1, 3), (8, 2, 2), (6, 3, 4), (16, 4, 1), (5, 1, 6), (32, 1, 2)])
@pytest.mark.parametrize("empty", [0.0, 0.2])
def test_renumbered_default_is_the_same_in_c(ranks, nodes, per_rank, empty):
    """The fallback's renumbering (ranks matched, nodes first, then rows aligned) is identical on both paths."""
    rng = np.random.default_rng(ranks * 100 + per_rank)
    experts = max(2, ranks * per_rank // 2)
    for _ in range(20):
        old = _placement(rng, 5, ranks * per_rank, experts, empty)
        new = old.copy() if rng.random() < 0.3 else _placement(rng, 5, ranks * per_rank, experts, empty)
        new[:, :] = new[:, rng.permutation(new.shape[1])] if rng.random() < 0.5 else new
        held = membership(old, experts, ranks)
        got = native.renumbered_default(old, held, new, ranks, nodes)
        with mock.patch.dict(os.environ, {"EPLB_FSM_NATIVE": "0"}):
            want = renumbered_default(old, held, new, ranks, nodes)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


@needs_kernel
def test_renumbered_default_refuses_experts_out_of_range():
    """An expert id outside [-1, N) is refused before anything is written."""
    old = np.zeros((1, 4), np.int64)
    held = membership(old, 2, 2)
    with pytest.raises(ValueError, match=r"\[-1, N\)"):
        native.renumbered_default(old, held, np.full((1, 4), 5), 2, 1)


def _clone(st) -> "search.SearchState":
    """An independent SearchState with the same contents as ``st``."""
    return search.SearchState(st.w.copy(), st.cur.copy(), st.count.copy(), st.slot_load.copy(), st.held.copy(),
                              st.on_rank.copy(), st.goal.copy(), st.G, st.nodes, st.limit.copy())


def _same_state(a, b) -> None:
    for name in ("cur", "count", "slot_load", "rank_load", "on_rank", "moved", "moves"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert a.rounds == b.rounds


@needs_kernel
def test_count_pass_and_search_leave_the_same_state_in_c():
    """From the policy's starting states (all shapes), C's count pass and search leave every array as numpy's do."""
    captured = []
    real_counts = search.rebalance_counts

    def capture(st, cap):
        captured.append((_clone(st), cap.copy()))
        return real_counts(st, cap)

    changed = 0
    with mock.patch.object(movement_policy, "rebalance_counts", capture):
        for shape in SHAPES:
            for seed in range(4):
                for integer in (False, True):
                    for hot in (False, True):
                        weight, old, call = _problem(shape, seed, integer, hot)
                        _plan(weight, old, call, "1")
                        _plan(weight, old, call, "1", max_moves=1)  # the move limit cuts the pass
    assert captured
    for st, cap in captured:
        c, py = _clone(st), _clone(st)
        with mock.patch.dict(os.environ, {"EPLB_FSM_NATIVE": "0"}):
            search.rebalance_counts(py, cap)
        search.rebalance_counts(c, cap)
        _same_state(c, py)
        changed += not np.array_equal(c.cur, st.cur)
        with mock.patch.dict(os.environ, {"EPLB_FSM_NATIVE": "0"}):
            py.run(float(py.rank_load.max(1).sum()) * 0.9, 0.0)
        c.run(float(c.rank_load.max(1).sum()) * 0.9, 0.0)
        _same_state(c, py)
    assert changed > 0  # some passes re-pointed slots


@needs_kernel
@pytest.mark.parametrize("ranks", [1, 3, 8, 32])
def test_flat_goals_are_the_same_in_c(ranks):
    """The flat mode's goals (sorted ranks, floors, the bisected price) are identical on both paths, ties included."""
    rng = np.random.default_rng(ranks)
    for case in range(60):
        layers = int(rng.integers(1, 12))
        loads = rng.gamma(1.0, 10.0, (layers, ranks))
        if case % 3 == 0:
            loads = np.round(loads)  # equal loads
        top = loads.max(1)
        floor = top * rng.uniform(0.5, 1.1, layers)
        budget = float(top.sum()) * rng.uniform(0.6, 1.05)
        got = native.lagrange_levels(loads, floor, budget)
        with mock.patch.dict(os.environ, {"EPLB_FSM_NATIVE": "0"}):
            want = lagrange_levels(loads, floor, budget)
        assert np.array_equal(got, want)


@needs_kernel
@pytest.mark.parametrize("ranks, per_rank", [(4, 3), (8, 1), (5, 9), (16, 127)])
def test_rank_counts_are_the_same_in_c(ranks, per_rank):
    """Slots of every expert on every rank (repeats counted, empty slots ignored) match numpy's, as int8."""
    rng = np.random.default_rng(per_rank)
    for empty in (0.0, 0.3):
        phy = _placement(rng, 4, ranks * per_rank, max(2, per_rank), empty)
        got = native.rank_counts(phy, max(2, per_rank), ranks)
        with mock.patch.dict(os.environ, {"EPLB_FSM_NATIVE": "0"}):
            want = rank_counts(phy, max(2, per_rank), ranks)
        assert got.dtype == want.dtype == np.int8 and np.array_equal(got, want)
