"""Tests that the default policy equals the per-item reference: random problems, benchmark shapes, real traces."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eplb_fsm.policy.bounds import balancedness_bound, placement_balancedness
from eplb_fsm.policy.default import DefaultEplbPolicy, balanced_packing
from eplb_fsm.policy.reference import reference_balanced_packing, reference_rebalance_experts
from eplb_fsm.sim.loads import esft_load_windows, load_matrix, load_scenarios, scenario_load


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


# --------------------------------------------------------------------------- properties


@st.composite
def problems(draw):
    """A valid (weight, P, groups, nodes, G) with small shapes and tie-prone loads."""
    nodes = draw(st.sampled_from([1, 1, 2, 4]))
    groups = nodes * draw(st.integers(1, 3))
    if draw(st.booleans()) and nodes > 1:
        groups = draw(st.integers(1, 6))  # may fall back to the global mode
    group_size = draw(st.integers(1, 4))
    num_experts = groups * group_size
    ranks = nodes * draw(st.integers(1, 3)) if groups % nodes == 0 else draw(st.integers(1, 6))
    slots_per_rank = draw(st.integers(1, 4))
    while ranks * slots_per_rank < num_experts:
        slots_per_rank += 1
    num_replicas = ranks * slots_per_rank
    layers = draw(st.integers(1, 4))
    if draw(st.booleans()):
        values = draw(st.lists(st.integers(0, 5), min_size=layers * num_experts, max_size=layers * num_experts))
        weight = torch.tensor(values, dtype=torch.int64)
    else:
        size = layers * num_experts
        values = draw(st.lists(st.floats(0, 1e6, allow_nan=False, width=32), min_size=size, max_size=size))
        weight = torch.tensor(values, dtype=torch.float32)
    return weight.reshape(layers, num_experts), num_replicas, groups, nodes, ranks


def _check_invariants(weight, num_replicas, groups, nodes, ranks, out):
    phy2log, log2phy, count = (t.numpy() for t in out)
    num_layers, num_experts = weight.shape
    assert phy2log.shape == (num_layers, num_replicas)
    assert log2phy.shape == (num_layers, num_experts, num_replicas - num_experts + 1)
    assert count.shape == (num_layers, num_experts)
    assert (count >= 1).all(), "every expert has a replica"
    assert (count.sum(axis=1) == num_replicas).all(), "replica counts sum to P"
    assert ((phy2log >= 0) & (phy2log < num_experts)).all(), "every slot holds an expert"
    slots_per_rank = num_replicas // ranks
    for layer in range(num_layers):
        assert (np.bincount(phy2log[layer], minlength=num_experts) == count[layer]).all()
        for expert in range(num_experts):
            row = log2phy[layer, expert]
            slots = row[: count[layer, expert]]
            assert (row[count[layer, expert] :] == -1).all(), "log2phy is -1 padded"
            assert (np.diff(slots) > 0).all(), "log2phy slots ascend"
            assert (phy2log[layer, slots] == expert).all(), "log2phy agrees with phy2log"
        ranks_of = np.arange(num_replicas) // slots_per_rank
        assert (np.bincount(ranks_of, minlength=ranks) == slots_per_rank).all()
    if groups % nodes == 0 and nodes > 1:
        group_size = num_experts // groups
        slots_per_node = num_replicas // nodes
        node_of_slot = np.arange(num_replicas) // slots_per_node
        for layer in range(num_layers):
            for group in range(groups):
                in_group = (phy2log[layer] // group_size) == group
                assert len(set(node_of_slot[in_group])) == 1, "a group's replicas stay on one node"


@settings(max_examples=60, deadline=None)
@given(problems())
def test_policy_matches_reference_and_invariants(problem):
    """On random small problems (ties included) the fast policy equals the reference and keeps every invariant."""
    weight, num_replicas, groups, nodes, ranks = problem
    out = DefaultEplbPolicy.rebalance_experts(weight, num_replicas, groups, nodes, ranks)
    _check_invariants(weight, num_replicas, groups, nodes, ranks, out)
    assert _same(out, reference_rebalance_experts(weight, num_replicas, groups, nodes, ranks))
    assert placement_balancedness(out[0], weight, ranks) <= balancedness_bound(weight, num_replicas, ranks) + 1e-9


@settings(max_examples=40, deadline=None)
@given(st.tuples(st.integers(1, 5), st.integers(1, 4), st.integers(1, 4)), st.data())
def test_balanced_packing_matches_reference(shape, data):
    """Vectorised balanced packing equals the per-item reference row by row."""
    packs, per_pack, rows = shape
    values = data.draw(
        st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0, 7.25, 1e-3]), min_size=rows * packs * per_pack,
                 max_size=rows * packs * per_pack)
    )
    w = np.array(values, dtype=np.float32).reshape(rows, packs * per_pack)
    pack, rank = balanced_packing(w, packs)
    for r in range(rows):
        assert (pack[r].tolist(), rank[r].tolist()) == reference_balanced_packing(list(w[r]), packs)
        assert (np.bincount(pack[r], minlength=packs) == per_pack).all()


@pytest.mark.parametrize("seed", range(12))
def test_policy_matches_reference_fixed_seeds(seed):
    """Medium random problems with fixed seeds (global and hierarchical) equal the reference."""
    rng = np.random.default_rng(seed)
    nodes = [1, 2, 4][seed % 3]
    groups = nodes * int(rng.integers(1, 4))
    num_experts = groups * int(rng.integers(2, 9))
    ranks = nodes * int(rng.integers(1, 5))
    num_replicas = ranks * -(-(num_experts + int(rng.integers(0, 20))) // ranks)
    if seed % 2:
        weight = torch.from_numpy(rng.zipf(1.5, (16, num_experts)).astype(np.int64))
    else:
        weight = torch.from_numpy(rng.lognormal(0, 2, (16, num_experts)))
    out = DefaultEplbPolicy.rebalance_experts(weight, num_replicas, groups, nodes, ranks)
    assert _same(out, reference_rebalance_experts(weight, num_replicas, groups, nodes, ranks))


# --------------------------------------------------------------------------- benchmark shapes and traces


SCENARIOS = load_scenarios()


@pytest.mark.parametrize("name", list(SCENARIOS["shapes"]))
def test_scenario_shapes_match_reference(name):
    """Every scenarios.json shape with its zipf load gives the reference's placement exactly."""
    s = SCENARIOS["shapes"][name]
    weight = torch.from_numpy(scenario_load(name, SCENARIOS, rng=1))
    args = (s["replicas"], s["groups"], s["nodes"], s["ranks"])
    out = DefaultEplbPolicy.rebalance_experts(weight, *args)
    assert _same(out, reference_rebalance_experts(weight, *args))


@pytest.mark.parametrize("task", ["intent", "law", "summary", "translation"])
@pytest.mark.parametrize("config", [(72, 1, 1, 8), (64, 1, 1, 8), (80, 8, 2, 8), (96, 4, 4, 16)])
def test_esft_traces_match_reference(task, config):
    """Real ESFT routing loads (per-task aggregates) give the reference's placement exactly."""
    weight = torch.from_numpy(load_matrix(f"esft:{task}"))  # the traces bundled with the package
    out = DefaultEplbPolicy.rebalance_experts(weight, *config)
    assert _same(out, reference_rebalance_experts(weight, *config))


def test_esft_batch_windows_match_reference():
    """Per-batch ESFT windows (4 sequences each, stacked as layers) give the reference's placement."""
    windows = esft_load_windows("esft:intent", 4)
    weight = torch.from_numpy(windows.reshape(-1, windows.shape[-1]))
    for config in [(72, 1, 1, 8), (80, 8, 2, 8)]:
        assert _same(
            DefaultEplbPolicy.rebalance_experts(weight, *config), reference_rebalance_experts(weight, *config)
        )
