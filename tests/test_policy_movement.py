"""Tests of the movement-aware policy (eplb_fsm.policy.movement)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eplb_fsm.policy import get_policy
from eplb_fsm.policy.bounds import placement_balancedness
from eplb_fsm.policy.default import DefaultEplbPolicy
from eplb_fsm.policy.movement import MovementAwarePolicy, plan_movement
from eplb_fsm.policy.movement.placement import moved_mask, rank_membership
from eplb_fsm.policy.movement.targets import align_rows, relabel_ranks
from eplb_fsm.sim.loads import drift, load_scenarios, scenario_load

# --------------------------------------------------------------------------- generators


@st.composite
def cases(draw, hierarchical: bool = False):
    """A small shape, a load, a drifted load and an old placement planned by the default."""
    if hierarchical:
        nodes = 2
        ranks_per_node = draw(st.integers(1, 3))
        ranks = nodes * ranks_per_node
        groups = nodes * draw(st.integers(1, 2))
        group_size = draw(st.integers(1, 3))
        experts = groups * group_size
    else:
        nodes = draw(st.sampled_from([1, 1, 3]))  # 3 nodes with 1 or 2 groups: not hierarchical
        groups = draw(st.sampled_from([1, 2])) if nodes == 3 else 1
        ranks = draw(st.integers(1, 5))
        experts = draw(st.integers(1, 12)) * groups
    slots_per_rank = draw(st.integers(max(1, -(-experts // ranks)), max(1, -(-experts // ranks)) + 3))
    replicas = ranks * slots_per_rank
    layers = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**31 - 1))
    sigma = draw(st.sampled_from([0.0, 0.05, 0.1, 0.3, 1.0]))
    rng = np.random.default_rng(seed)
    probs = 1.0 / np.arange(1, experts + 1) ** draw(st.sampled_from([0.0, 0.5, 1.0, 1.5]))
    base = np.stack([rng.multinomial(4000, rng.permutation(probs / probs.sum())) for _ in range(layers)])
    base = base.astype(np.float64) + draw(st.sampled_from([0.0, 0.0, 1.0]))  # some zero loads too
    load = drift(base, sigma, rng)
    call = (replicas, groups, nodes, ranks)
    planned_on = base
    if draw(st.booleans()):  # the old placement was made for other traffic altogether
        planned_on = base[:, rng.permutation(experts)]
    old = DefaultEplbPolicy.rebalance_experts(torch.from_numpy(planned_on), *call)[0]
    return torch.from_numpy(load), call, old


def _check_valid(phy2log, log2phy, count, call, num_experts):
    replicas, groups, nodes, ranks = call
    phy = phy2log.numpy()
    layers = phy.shape[0]
    assert phy2log.dtype == log2phy.dtype == count.dtype == torch.int64
    assert phy.shape == (layers, replicas)
    assert phy.min() >= 0 and phy.max() < num_experts  # every slot of every rank holds an expert
    assert log2phy.shape == (layers, num_experts, replicas - num_experts + 1)
    counts = count.numpy()
    assert (counts >= 1).all()
    assert (counts.sum(1) == replicas).all()
    for layer in range(layers):
        for e in range(num_experts):
            slots = log2phy[layer, e].numpy()
            held = slots[slots >= 0]
            assert held.size == counts[layer, e]
            assert (slots[held.size:] == -1).all()
            assert (np.diff(held) > 0).all()
            assert (phy[layer, held] == e).all()


def _groups_on_one_node(phy: np.ndarray, num_experts: int, groups: int, nodes: int) -> bool:
    per_node = phy.shape[1] // nodes
    group = phy // (num_experts // groups)
    node = np.arange(phy.shape[1]) // per_node
    for layer in range(phy.shape[0]):
        for g in range(groups):
            if len(set(node[group[layer] == g].tolist())) > 1:
                return False
    return True


# --------------------------------------------------------------------------- properties


@settings(max_examples=60)
@given(cases())
def test_valid_placement(case):
    """Every output is a valid placement: counts sum to P, all experts present, log2phy consistent."""
    load, call, old = case
    out = MovementAwarePolicy.rebalance_experts(load, *call, old)
    _check_valid(*out, call, load.shape[1])


@settings(max_examples=60)
@given(cases())
def test_never_more_moves_than_default(case):
    """In every layer the movement-aware plan moves at most as many slots as the default's."""
    load, call, old = case
    ranks = call[3]
    mine = MovementAwarePolicy.rebalance_experts(load, *call, old)[0].numpy()
    default = DefaultEplbPolicy.rebalance_experts(load, *call)[0].numpy()
    assert (moved_mask(old.numpy(), mine, ranks).sum(1) <= moved_mask(old.numpy(), default, ranks).sum(1)).all()


@settings(max_examples=60)
@given(cases(), st.sampled_from([0.9, 0.99, 1.0]))
def test_meets_target(case, target):
    """Without a move limit the plan reaches target x the default's balancedness on the load."""
    load, call, old = case
    ranks = call[3]
    mine = MovementAwarePolicy(target=target).rebalance_experts(load, *call, old)[0]
    default = DefaultEplbPolicy.rebalance_experts(load, *call)[0]
    reached = target * placement_balancedness(default, load, ranks) * (1 - 1e-9)
    assert placement_balancedness(mine, load, ranks) >= reached


@settings(max_examples=60)
@given(cases())
def test_zero_moves_when_old_meets_target(case):
    """When the old placement already meets the target under the new load it is returned unchanged."""
    load, call, old = case
    ranks = call[3]
    default = DefaultEplbPolicy.rebalance_experts(load, *call)[0]
    target = 0.99
    if placement_balancedness(old, load, ranks) >= target * placement_balancedness(default, load, ranks) * (1 + 1e-6):
        out = MovementAwarePolicy.rebalance_experts(load, *call, old)[0]
        assert torch.equal(out, old)
    # and a plan on the very load the old placement was made for never moves anything
    same = DefaultEplbPolicy.rebalance_experts(load, *call)[0]
    assert torch.equal(MovementAwarePolicy.rebalance_experts(load, *call, same)[0], same)


@settings(max_examples=40)
@given(cases(hierarchical=True))
def test_hierarchical_groups_stay_on_one_node(case):
    """In hierarchical mode every group's replicas stay on one node, as with the default."""
    load, call, old = case
    replicas, groups, nodes, ranks = call
    out = MovementAwarePolicy.rebalance_experts(load, *call, old)
    _check_valid(*out, call, load.shape[1])
    assert _groups_on_one_node(out[0].numpy(), load.shape[1], groups, nodes)


@settings(max_examples=40)
@given(cases(hierarchical=True))
def test_hierarchical_old_spanning_nodes_is_replanned(case):
    """An old placement that spreads a group over nodes is not kept: the plan is hierarchical again."""
    load, call, old = case
    replicas, groups, nodes, ranks = call
    spread = old.clone()
    spread[:, [0, -1]] = spread[:, [-1, 0]]  # swap the first slot of node 0 with the last of node 1
    if _groups_on_one_node(spread.numpy(), load.shape[1], groups, nodes):
        return
    out = MovementAwarePolicy.rebalance_experts(load, *call, spread)[0].numpy()
    assert _groups_on_one_node(out, load.shape[1], groups, nodes)


@settings(max_examples=40)
@given(cases(), st.booleans())
def test_without_old_placement_equals_default(case, instance):
    """With old_phy2log=None the output is exactly the default policy's (all three tensors)."""
    load, call, _ = case
    policy = MovementAwarePolicy(target=0.9, max_moves=1) if instance else MovementAwarePolicy
    mine = policy.rebalance_experts(load, *call)
    theirs = DefaultEplbPolicy.rebalance_experts(load, *call)
    assert all(torch.equal(a, b) for a, b in zip(mine, theirs))


@settings(max_examples=60)
@given(st.booleans().flatmap(lambda hier: cases(hierarchical=hier)), st.integers(0, 3))
def test_move_limit(case, limit):
    """With max_moves each layer moves at most that many slots and the placement stays valid."""
    load, call, old = case
    out = MovementAwarePolicy(max_moves=limit).rebalance_experts(load, *call, old)
    _check_valid(*out, call, load.shape[1])
    assert (moved_mask(old.numpy(), out[0].numpy(), call[3]).sum(1) <= limit).all()


@settings(max_examples=30)
@given(cases())
def test_empty_slots_are_filled(case):
    """An old placement with empty slots (-1, elastic scale-up) gets every slot filled."""
    load, call, old = case
    replicas, groups, nodes, ranks = call
    num_experts = load.shape[1]
    holey = old.clone()
    counts = torch.stack([torch.bincount(row, minlength=num_experts) for row in old])
    # empty a slot whose expert has another replica, if there is one
    for layer in range(old.shape[0]):
        dup = [p for p in range(replicas) if counts[layer, old[layer, p]] > 1]
        if dup:
            holey[layer, dup[-1]] = -1
    out = MovementAwarePolicy.rebalance_experts(load, *call, holey)
    _check_valid(*out, call, num_experts)


# --------------------------------------------------------------------------- errors and API


def _small():
    load = torch.tensor([[5.0, 1.0, 3.0, 2.0], [1.0, 1.0, 8.0, 1.0]])
    call = (6, 1, 1, 2)
    old = DefaultEplbPolicy.rebalance_experts(load, *call)[0]
    return load, call, old


@pytest.mark.parametrize(
    "bad",
    [
        lambda old: old[:1],  # too few layers
        lambda old: old[:, :4],  # wrong number of slots
        lambda old: old[0],  # 1-D
        lambda old: torch.full_like(old, 4),  # expert id out of range
        lambda old: torch.full_like(old, -2),  # below -1
        lambda old: torch.zeros_like(old),  # experts 1..3 missing
        lambda old: old.double(),  # not integers
        lambda old: old.to("meta"),  # no data to read
    ],
)
def test_bad_old_placement_raises(bad):
    """A bad old_phy2log (shape, range, missing expert, dtype, no data) raises ValueError naming the argument."""
    load, call, old = _small()
    with pytest.raises(ValueError, match="old_phy2log"):
        MovementAwarePolicy.rebalance_experts(load, *call, bad(old))


@pytest.mark.parametrize("kwargs", [{"target": 0.0}, {"target": 1.5}, {"target": float("nan")}, {"max_moves": -1},
                                    {"max_moves": 1.5}, {"target": True}])
def test_bad_settings_raise(kwargs):
    """Out-of-range target or max_moves raise ValueError naming the setting."""
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        MovementAwarePolicy(**kwargs)


def test_registered_and_configurable():
    """The policy is registered as movement_aware; the class call uses the defaults, an instance its own."""
    assert get_policy("movement_aware") is MovementAwarePolicy
    assert MovementAwarePolicy.target == 0.99 and MovementAwarePolicy.max_moves is None
    from eplb_fsm.config import EplbConfig

    policy = MovementAwarePolicy.from_config(EplbConfig(movement_balancedness_target=0.9))
    assert policy.target == 0.9
    load, call, old = _small()
    load2 = load.flip(1)
    lenient = policy.rebalance_experts(load2, *call, old)[0]
    strict = MovementAwarePolicy(target=1.0).rebalance_experts(load2, *call, old)[0]
    ranks = call[3]
    assert placement_balancedness(strict, load2, ranks) >= placement_balancedness(lenient, load2, ranks) - 1e-12


def test_plan_reports_what_it_did():
    """plan_movement's diagnostics agree with the placement it returns."""
    load, call, old = _small()
    plan = plan_movement(load.flip(1), *call, old)
    assert (plan.moved == moved_mask(old.numpy(), plan.phy2log, call[3]).sum(1)).all()
    assert (plan.default_moved == moved_mask(old.numpy(), plan.default_phy2log, call[3]).sum(1)).all()
    assert not (plan.kept & (plan.repaired | plan.fallback)).any()
    assert (plan.default_phy2log == DefaultEplbPolicy.rebalance_experts(load.flip(1), *call)[0].numpy()).all()


# --------------------------------------------------------------------------- helpers


@settings(max_examples=40)
@given(cases())
def test_relabel_and_align_keep_quality(case):
    """Renumbering ranks and aligning rows never change balancedness or a rank's contents."""
    load, call, old = case
    replicas, groups, nodes, ranks = call
    hier = nodes > 1 and groups % nodes == 0
    new = DefaultEplbPolicy.rebalance_experts(load, *call)[0].numpy()
    member = rank_membership(old.numpy(), ranks, load.shape[1])
    relabeled = relabel_ranks(new, member, ranks, nodes if hier else 1)
    aligned = align_rows(old.numpy(), relabeled, ranks)
    for x in (relabeled, aligned):
        same = pytest.approx(placement_balancedness(new, load, ranks), abs=1e-12)
        assert placement_balancedness(x, load, ranks) == same
        assert (np.sort(x, 1) == np.sort(new, 1)).all()
    s = replicas // ranks
    same_rank = np.sort(aligned.reshape(-1, s), 1) == np.sort(relabeled.reshape(-1, s), 1)
    assert same_rank.all()
    # aligning rows never changes how many slots move, and never moves a kept expert's row
    old_np = old.numpy()
    assert moved_mask(old_np, aligned, ranks).sum() == moved_mask(old_np, relabeled, ranks).sum()
    assert (aligned == old_np).sum() >= (relabeled == old_np).sum()


# --------------------------------------------------------------------------- a scenario


@pytest.mark.parametrize("sigma_index,sigma", [(0, 0.05), (1, 0.1)])
def test_small_scenario_meets_issue_targets(sigma_index, sigma):
    """On the v2lite bench scenario, sigma <= 0.1: balancedness >= 0.99x the default's, moves <= 10% of its moves."""
    scenarios = load_scenarios()
    names = list(scenarios["shapes"])
    name = "v2lite_ep8"
    index = names.index(name)
    shape = scenarios["shapes"][name]
    call = (shape["replicas"], shape["groups"], shape["nodes"], shape["ranks"])
    base = scenario_load(name, scenarios, rng=index)
    old = DefaultEplbPolicy.rebalance_experts(torch.from_numpy(base), *call)[0]
    load = torch.from_numpy(drift(base, sigma, np.random.default_rng([0, index, sigma_index])))
    mine = MovementAwarePolicy.rebalance_experts(load, *call, old)[0]
    default = DefaultEplbPolicy.rebalance_experts(load, *call)[0]
    ranks = shape["ranks"]
    assert placement_balancedness(mine, load, ranks) >= 0.99 * placement_balancedness(default, load, ranks)
    moved_mine = moved_mask(old.numpy(), mine.numpy(), ranks).sum()
    moved_default = moved_mask(old.numpy(), default.numpy(), ranks).sum()
    assert moved_mine <= 0.10 * moved_default


# --------------------------------------------------------------------------- move limit and diagnostics


def test_move_limit_fills_an_empty_slot_with_an_expert_of_its_rank():
    """Under max_moves=0 an empty slot takes an expert its rank already holds, so nothing moves."""
    load = np.arange(1, 9, dtype=np.float64)[None]
    old = np.array([[3, 2, -1, 7, 5, 4, 7, 5, 1, 6, 6, 0]])
    phy2log = MovementAwarePolicy(max_moves=0).rebalance_experts(load, 12, 1, 1, 4, old_phy2log=old)[0].numpy()
    assert phy2log.min() >= 0 and set(phy2log[0, :3].tolist()) <= {2, 3}
    assert moved_mask(old, phy2log, 4).sum() == 0


@settings(max_examples=40)
@given(cases(), st.integers(0, 2))
def test_move_limit_holds_with_empty_slots(case, limit):
    """With empty slots on ranks that keep other experts, every layer still moves at most max_moves slots."""
    load, call, old = case
    holey = old.numpy().copy()
    slots_per_rank = call[0] // call[3]
    for layer in range(holey.shape[0]):  # empty duplicate replicas, never a rank's last expert
        for slot in range(holey.shape[1]):
            rank_slots = holey[layer, slot - slot % slots_per_rank:][:slots_per_rank]
            if (holey[layer] == holey[layer, slot]).sum() > 1 and (rank_slots >= 0).sum() > 1:
                holey[layer, slot] = -1
    out = MovementAwarePolicy(max_moves=limit).rebalance_experts(load, *call, holey)
    _check_valid(*out, call, load.shape[1])
    assert (moved_mask(holey, out[0].numpy(), call[3]).sum(1) <= limit).all()


def test_forced_layer_moves_past_the_limit_to_stay_valid():
    """A hierarchical layer whose old placement spreads a group over nodes is re-planned even under max_moves=0."""
    load = np.random.default_rng(0).random((1, 8)) * 10
    old = np.array([[0, 1, 2, 4, 3, 5, 6, 7]])  # groups {0..3} and {4..7} both on both nodes
    phy2log = MovementAwarePolicy(max_moves=0).rebalance_experts(load, 8, 2, 2, 2, old_phy2log=old)[0].numpy()
    assert _groups_on_one_node(phy2log, 8, 2, 2)
    assert moved_mask(old, phy2log, 2).sum() > 0


def test_moved_without_diagnostics_is_unknown_not_the_defaults():
    """With diagnostics=False, moved is -1 or the plan's true moves, never the default's (no shared array)."""
    rng = np.random.default_rng(3)
    base = rng.random((6, 64)) * 100
    old = DefaultEplbPolicy.rebalance_experts(base, 72, 1, 1, 8)[0].numpy()
    load = base * np.exp(rng.normal(0, 0.6, base.shape))
    plan = plan_movement(load, 72, 1, 1, 8, old, target=1.0, diagnostics=False)
    true_moves = moved_mask(old, plan.phy2log, 8).sum(1)
    assert ((plan.moved == -1) | (plan.moved == true_moves)).all()
    assert (plan.default_moved >= 0).any() and not np.shares_memory(plan.moved, plan.default_moved)


def test_max_moves_past_int64_is_refused_up_front():
    """max_moves above 2**63 - 1 (the int64 move counts) raises ValueError naming it, on the policy and the plan."""
    load, call, old = _small()
    assert MovementAwarePolicy(max_moves=2**63 - 1).rebalance_experts(load, *call, old)[0].shape == old.shape
    with pytest.raises(ValueError, match=r"max_moves must be None or an integer in \[0, 2\*\*63 - 1\]"):
        MovementAwarePolicy(max_moves=2**63)
    with pytest.raises(ValueError, match="max_moves"):
        plan_movement(load, *call, old, max_moves=10**20)


def test_numpy_real_target_is_taken_as_a_float():
    """A numpy float32 / float64 target is accepted and held as a Python float, as EplbConfig takes it."""
    policy = MovementAwarePolicy(target=np.float32(0.95))
    assert type(policy.target) is float and policy.target == float(np.float32(0.95))
    load, call, old = _small()
    assert plan_movement(load, *call, old, target=np.float64(0.9)).phy2log.shape == old.shape


@pytest.mark.parametrize("native", ["1", "0"])
@pytest.mark.parametrize("limit", [1, 8, 30])
def test_move_limit_repairs_the_layers_too_far_off_to_fall_back(monkeypatch, native, limit):
    """Under max_moves, a layer far worse than the default whose re-plan moves past the limit is searched within it,
    not left as it was (a red team: every layer kept the initial placement for any limit from 1 to 49)."""
    monkeypatch.setenv("EPLB_FSM_NATIVE", native)
    load = torch.rand(4, 64, generator=torch.Generator().manual_seed(0)) ** 4
    old = torch.as_tensor(np.tile(np.arange(72) % 64, (4, 1)))
    plan = plan_movement(load, 72, 1, 1, 8, old, max_moves=limit)
    assert (plan.default_moved > limit).all()   # no layer could take the default's placement within the limit
    moved = moved_mask(old.numpy(), plan.phy2log, 8).sum(1)
    assert ((moved >= 1) & (moved <= limit)).all(), moved
    before = placement_balancedness(old, load, 8)
    assert placement_balancedness(torch.as_tensor(plan.phy2log), load, 8) > before
    if limit > 1:   # more room, a better placement
        fewer = plan_movement(load, 72, 1, 1, 8, old, max_moves=limit // 2).phy2log
        assert placement_balancedness(torch.as_tensor(plan.phy2log), load, 8) > \
            placement_balancedness(torch.as_tensor(fewer), load, 8)
