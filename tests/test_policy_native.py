"""The C row loops of the default policy (policy/native.py, policy/cnative.c) against the numpy ones."""

from __future__ import annotations

import os
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eplb_fsm.policy import native
from eplb_fsm.policy.default import DefaultEplbPolicy, group_loads, rebalance_hierarchical, replicate_experts
from eplb_fsm.policy.packing import pack_visited, row_offsets
from eplb_fsm.policy.reference import reference_rebalance_experts

needs_kernel = pytest.mark.skipif(not native.built(), reason="the C extension is not built (no compiler at install)")


def _numpy_place_rows(w: np.ndarray, num_slots: int, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """What place_rows computes, from the numpy helpers: replicate, pack, lay replicas out by slot."""
    rows, items = w.shape
    phy2item, _, count = replicate_experts(w, num_slots)
    per_replica = w / count.astype(np.float32)   # each item's final load per replica, float32
    load = per_replica.reshape(-1)[phy2item + row_offsets(rows, items)]
    visit, pack, arrival = pack_visited(load.reshape(rows, num_slots), num_packs)
    slot = pack * (num_slots // num_packs) + arrival + row_offsets(rows, num_slots)
    slot_item = np.empty(rows * num_slots, dtype=np.int64)
    slot_item[slot.reshape(-1)] = phy2item.reshape(-1)[visit]
    return slot_item.reshape(rows, num_slots), count


@st.composite
def rows_to_place(draw):
    """(w (R, n) float32 with ties, zeros, -0.0, tiny and huge values, slots, packs)."""
    rows = draw(st.integers(0, 6))
    items = draw(st.integers(1, 12))
    packs = draw(st.integers(1, 12))   # above 8 the kernel keeps its packs in a heap
    per_pack = draw(st.integers(1, 5))
    slots = packs * per_pack
    if slots < items:
        slots = packs * -(-items // packs)
    values = st.sampled_from([0.0, -0.0, 1.0, 2.0, 3.0, 0.5, 1e-30, 1e30, 7.0])
    w = np.array(draw(st.lists(st.lists(values, min_size=items, max_size=items), min_size=rows, max_size=rows)),
                 dtype=np.float32).reshape(rows, items)
    return w, slots, packs


@needs_kernel
@settings(max_examples=300, deadline=None)
@given(rows_to_place())
def test_place_rows_equals_the_numpy_replication_and_packing(problem):
    """On rows with ties, zeros, -0.0, tiny and huge loads, C and numpy place every replica alike."""
    w, slots, packs = problem
    slot_item, count = native.place_rows(w, slots, packs)
    expect_items, expect_count = _numpy_place_rows(w, slots, packs)
    assert np.array_equal(count, expect_count)
    assert np.array_equal(slot_item, expect_items)


@needs_kernel
def test_one_replica_per_pack_keeps_replica_i_in_pack_i():
    """slots == packs: replica i goes to pack i whatever the loads, as the numpy path and the reference do."""
    w = np.array([[1.0, 5.0, 3.0]], dtype=np.float32)
    slot_item, count = native.place_rows(w, 4, 4)
    assert slot_item.tolist() == [[0, 1, 2, 1]] and count.tolist() == [[1, 2, 1]]


@needs_kernel
def test_place_rows_refuses_sizes_that_do_not_fit():
    """Packs that do not divide the slots, or fewer slots than items, raise ValueError naming the rule."""
    w = np.ones((2, 4), dtype=np.float32)
    with pytest.raises(ValueError, match="packs dividing slots"):
        native.place_rows(w, 6, 4)
    with pytest.raises(ValueError, match="items <= slots"):
        native.place_rows(w, 3, 1)


@needs_kernel
@pytest.mark.parametrize("phy2log, experts, width, rule", [
    ([[0, 2, 0]], 3, 2, "every expert needs at least one slot"),
    ([[0, 1, 3]], 3, 2, r"every slot must hold an expert in \[0, experts\)"),
    ([[0, 0, 0, 1]], 2, 2, "more slots than max_replicas"),
])
def test_slots_of_experts_refuses_placements_it_cannot_map(phy2log, experts, width, rule):
    """A slot without an expert, an expert without a slot, or too many replicas raise ValueError naming it."""
    with pytest.raises(ValueError, match=rule):
        native.slots_of_experts(np.array(phy2log, dtype=np.int64), experts, width)


@pytest.mark.parametrize("shape", [(6, 32, 40, 4, 2, 8), (5, 16, 24, 1, 1, 4), (4, 24, 24, 6, 3, 6),
                                   (3, 8, 16, 2, 2, 16), (4, 48, 64, 1, 1, 32), (3, 40, 60, 1, 1, 12)])
def test_the_policy_is_the_same_with_and_without_the_kernel(shape, monkeypatch):
    """EPLB_FSM_NATIVE=0 (numpy) and the C path give the reference's placement, hierarchical and global."""
    layers, experts, replicas, groups, nodes, ranks = shape
    rng = np.random.default_rng(sum(shape))
    weight = torch.from_numpy(rng.integers(0, 6, size=(layers, experts)))   # small integers: many ties
    monkeypatch.setenv("EPLB_FSM_NATIVE", "1")
    fast = DefaultEplbPolicy.rebalance_experts(weight, replicas, groups, nodes, ranks)
    monkeypatch.setenv("EPLB_FSM_NATIVE", "0")
    assert not native.available()
    plain = DefaultEplbPolicy.rebalance_experts(weight, replicas, groups, nodes, ranks)
    ref = reference_rebalance_experts(weight, replicas, groups, nodes, ranks)
    for a, b, c in zip(fast, plain, ref):
        assert torch.equal(a, b) and torch.equal(a, torch.as_tensor(c))


@st.composite
def layers_to_place(draw):
    """(w (L, N) float32 with ties, zeros and -0.0, P, groups, nodes, ranks) obeying check_rebalance_args."""
    nodes = draw(st.integers(1, 4))
    groups = nodes * draw(st.integers(1, 4))
    experts = groups * draw(st.integers(1, 4))
    ranks = nodes * draw(st.integers(1, 11))   # up to 44 ranks: > 8 per node takes the winner tree
    replicas = ranks * max(1, -(-experts // ranks)) + ranks * draw(st.integers(0, 2))
    layers = draw(st.integers(0, 4))
    values = st.sampled_from([0.0, -0.0, 1.0, 2.0, 3.0, 0.5, 1e-30, 1e30])
    w = np.array(draw(st.lists(values, min_size=layers * experts, max_size=layers * experts)),
                 dtype=np.float32).reshape(layers, experts)
    return w, replicas, groups, nodes, ranks


@needs_kernel
@settings(max_examples=300, deadline=None)
@given(layers_to_place())
def test_place_layers_equals_the_numpy_pipeline(problem):
    """Groups onto nodes, then replicas onto ranks: the one C call places every layer as numpy does."""
    w, replicas, groups, nodes, ranks = problem
    group_load = group_loads(w, groups) if groups > 1 else None
    phy2log, count = native.place_layers(w, group_load, replicas, groups, nodes, ranks)
    with mock.patch.dict(os.environ, {"EPLB_FSM_NATIVE": "0"}):
        expect_phy2log, expect_count = rebalance_hierarchical(w, replicas, groups, nodes, ranks)
    assert np.array_equal(count, expect_count)
    assert np.array_equal(phy2log, expect_phy2log)


@needs_kernel
def test_place_layers_refuses_shapes_that_do_not_divide():
    """Groups that do not divide the experts, or a group-load buffer of the wrong size, raise ValueError."""
    w = np.ones((2, 6), dtype=np.float32)
    with pytest.raises(ValueError, match="groups | experts"):
        native.place_layers(w, np.ones((2, 4), dtype=np.float32), 8, 4, 2, 4)
    with pytest.raises(ValueError, match="buffer sizes do not match"):
        native.place_layers(w, np.ones((2, 2), dtype=np.float32), 8, 3, 1, 4)
