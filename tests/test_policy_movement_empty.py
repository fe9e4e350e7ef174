"""The movement-aware policy on old placements with empty slots (elastic scale-up), hierarchical mode above all.

An empty slot on a rank that keeps other experts takes one of them: that moves nothing
and keeps the expert's group on its node, so such a layer is searched like any other and
the move limit holds. Only a rank with no expert at all (a new rank) or a group spread
over nodes forces the renumbered default.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eplb_fsm.policy.default import DefaultEplbPolicy
from eplb_fsm.policy.movement import MovementAwarePolicy, moved_mask, native, plan_movement
from eplb_fsm.sim.loads import drift


def _groups_on_one_node(phy: np.ndarray, num_experts: int, groups: int, nodes: int) -> bool:
    node = np.arange(phy.shape[1]) // (phy.shape[1] // nodes)
    group = phy // (num_experts // groups)
    return all(len(set(node[group[layer] == g].tolist())) <= 1
               for layer in range(phy.shape[0]) for g in range(groups))


def _check_valid(out, replicas: int, num_experts: int) -> None:
    phy, log2phy, count = (t.numpy() for t in out)
    assert phy.min() >= 0 and phy.max() < num_experts
    assert (count >= 1).all() and (count.sum(1) == replicas).all()
    for layer in range(phy.shape[0]):
        assert (np.bincount(phy[layer], minlength=num_experts) == count[layer]).all()
        for e in range(num_experts):
            assert log2phy[layer, e, : count[layer, e]].tolist() == np.flatnonzero(phy[layer] == e).tolist()


def _empty_duplicates(old: np.ndarray, slots_per_rank: int, every: bool) -> np.ndarray:
    """Empty slots whose expert has another replica, never a rank's last expert (one per layer unless ``every``)."""
    holey = old.copy()
    for layer in range(holey.shape[0]):
        for slot in range(holey.shape[1]):
            rank_slots = holey[layer, slot - slot % slots_per_rank:][:slots_per_rank]
            if (holey[layer] == holey[layer, slot]).sum() > 1 and (rank_slots >= 0).sum() > 1:
                holey[layer, slot] = -1
                if not every:
                    break
    return holey


@st.composite
def hierarchical_cases(draw):
    """A hierarchical shape (2 nodes), a drifted load and an old placement with empty slots on kept ranks."""
    nodes = 2
    ranks = nodes * draw(st.integers(1, 3))
    groups = nodes * draw(st.integers(1, 2))
    experts = groups * draw(st.integers(1, 3))
    slots_per_rank = draw(st.integers(-(-experts // ranks) + 1, -(-experts // ranks) + 3))
    replicas = ranks * slots_per_rank
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    base = rng.random((draw(st.integers(1, 3)), experts)) * 100 + draw(st.sampled_from([0.0, 1.0]))
    old = DefaultEplbPolicy.rebalance_experts(base, replicas, groups, nodes, ranks)[0].numpy()
    holey = _empty_duplicates(old, slots_per_rank, every=draw(st.booleans()))
    load = drift(base, draw(st.sampled_from([0.05, 0.3, 1.0])), rng)
    return load, (replicas, groups, nodes, ranks), holey


def test_hierarchical_empty_slot_on_a_kept_rank_moves_nothing_under_max_moves_0():
    """max_moves=0, hierarchical, one empty slot per layer on a rank keeping experts: nothing moves, groups stay."""
    rng = np.random.default_rng(0)
    call = (24, 4, 2, 4)  # 6 slots per rank, 2 ranks per node
    weight = rng.random((2, 16)) + 0.1
    old = _empty_duplicates(DefaultEplbPolicy.rebalance_experts(weight, *call)[0].numpy(), 6, every=False)
    assert (old < 0).sum(1).tolist() == [1, 1]
    load = weight * rng.lognormal(0, 1.0, weight.shape)
    out = MovementAwarePolicy(max_moves=0).rebalance_experts(load, *call, old_phy2log=old)
    _check_valid(out, 24, 16)
    assert moved_mask(old, out[0].numpy(), 4).sum(1).tolist() == [0, 0]
    assert _groups_on_one_node(out[0].numpy(), 16, 4, 2)


@settings(max_examples=60, deadline=None)
@given(hierarchical_cases(), st.integers(0, 2))
def test_hierarchical_move_limit_holds_with_empty_slots(case, limit):
    """Hierarchical, empty slots on ranks that keep other experts: every layer moves at most max_moves, groups stay."""
    load, call, holey = case
    out = MovementAwarePolicy(max_moves=limit).rebalance_experts(load, *call, old_phy2log=holey)
    _check_valid(out, call[0], load.shape[1])
    assert (moved_mask(holey, out[0].numpy(), call[3]).sum(1) <= limit).all()
    assert _groups_on_one_node(out[0].numpy(), load.shape[1], call[1], call[2])


@settings(max_examples=40, deadline=None)
@given(hierarchical_cases())
def test_hierarchical_empty_slots_without_a_limit_stay_valid(case):
    """Without a limit such layers plan validly: groups on one node, never moving more than the default would."""
    load, call, holey = case
    plan = plan_movement(load, *call, holey)
    out = MovementAwarePolicy.rebalance_experts(load, *call, old_phy2log=holey)
    _check_valid(out, call[0], load.shape[1])
    assert _groups_on_one_node(out[0].numpy(), load.shape[1], call[1], call[2])
    assert (plan.moved <= np.maximum(plan.default_moved, 0)).all()


def test_a_new_rank_in_hierarchical_mode_still_takes_the_renumbered_default():
    """A rank whose slots are all empty forces its layer to the (node-valid) renumbered default, limit or not."""
    call = (16, 2, 2, 4)  # 4 slots per rank, ranks 0-1 on node 0
    weight = np.arange(1.0, 9.0)[None] * np.array([[1.0], [2.0]])
    old = DefaultEplbPolicy.rebalance_experts(weight, *call)[0].numpy()
    old[:, 4:8] = -1  # rank 1 is new
    old[:, 0:4] = [0, 1, 2, 3]  # node 0's group still fully placed
    for policy in (MovementAwarePolicy, MovementAwarePolicy(max_moves=0)):
        plan = plan_movement(weight, *call, old, max_moves=getattr(policy, "max_moves", None))
        assert plan.fallback.all()
        out = policy.rebalance_experts(weight, *call, old_phy2log=old)
        _check_valid(out, 16, 8)
        assert _groups_on_one_node(out[0].numpy(), 8, 2, 2)


@pytest.mark.skipif(not native.built(), reason="the C extension is not built")
@pytest.mark.parametrize("limit", [None, 0, 3])
def test_hierarchical_plans_with_empty_slots_are_the_same_in_c(monkeypatch, limit):
    """Hierarchical layers with empty slots are searched (not forced), and the C and numpy searches agree on them."""
    rng = np.random.default_rng(7)
    call = (48, 8, 2, 8)
    base = rng.random((6, 32)) * 100
    old = _empty_duplicates(DefaultEplbPolicy.rebalance_experts(base, *call)[0].numpy(), 6, every=False)
    load = drift(base, 0.3, rng)
    plans = []
    for kernel in ("1", "0"):
        monkeypatch.setenv("EPLB_FSM_NATIVE", kernel)
        plans.append(plan_movement(load, *call, old, max_moves=limit))
    assert np.array_equal(plans[0].phy2log, plans[1].phy2log)
    assert np.array_equal(plans[0].moved, plans[1].moved) and plans[0].rounds == plans[1].rounds
    assert plans[0].rounds > 0 and plans[0].repaired.any()  # the search ran on the filled layers
