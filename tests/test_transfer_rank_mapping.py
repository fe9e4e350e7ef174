"""Rank mappings for elastic EP: validation, map expansion, scale-down/up through the executor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eplb_fsm.transfer import (
    InProcessCommunicator,
    TransferBuffer,
    expand_maps,
    expand_phy2log,
    rearrange_expert_weights_inplace,
    validate_rank_mapping,
)


def test_scale_down_runs_in_old_group():
    """4 -> 2 with ranks 1 and 3 leaving: old group, new ranks placed at their old ranks."""
    info = validate_rank_mapping({0: 0, 1: -1, 2: 1, 3: -1}, 4)
    assert (info.kind, info.runs_in, info.old_world, info.new_world) == ("scale_down", "old", 4, 2)
    assert info.group_of_new == (0, 2)


def test_scale_up_runs_in_new_group():
    """2 -> 4: new group, old ranks placed at their new ranks, joining ranks empty."""
    info = validate_rank_mapping({0: 0, 1: 3}, 4)
    assert (info.kind, info.runs_in, info.old_world, info.new_world) == ("scale_up", "new", 2, 4)
    assert info.group_of_old == (0, 3)


def test_permutation_is_same_size():
    """A same-size mapping without -1 is a permutation run in the (old) group."""
    info = validate_rank_mapping({0: 1, 1: 0}, 2)
    assert info.kind == "permute" and info.group_of_new == (1, 0)


@pytest.mark.parametrize(
    "mapping,group,match",
    [
        ([(0, 0)], 1, "must be a dict"),
        ({}, 1, "must not be empty"),
        ({0: 0, 2: 1}, 2, "keys must be the old ranks 0..1"),
        ({0: 0, 1: 0}, 2, "two old ranks map to the same new rank"),
        ({0: 0, 1: -2}, 2, "new rank >= 0 or -1"),
        ({0: 0, 1: 1, 2: 2}, 2, "has 3 old ranks but the group has 2"),
        ({0: -1, 1: -1}, 2, "every rank leaves"),
        ({0: 0, 1: 2, 2: -1}, 3, "kept ranks must map onto new ranks 0..1"),
        ({0: 0, 1: -1}, 4, "scale-up runs in the new group"),
        ({0: 0, 1: 4}, 4, r"new ranks must be in \[0, 4\)"),
        ({0: True, 1: 0}, 2, "must be an int"),
        ({0: 0}, 0, "group_size: must be a positive int"),
    ],
)
def test_bad_mappings(mapping, group, match):
    """Mappings that do not fit the group raise ValueError naming rank_mapping and the rule."""
    with pytest.raises(ValueError, match=match):
        validate_rank_mapping(mapping, group)


def test_expand_scale_down_new_map():
    """Scale-down: the new map gets -1 slots for leaving ranks, in old-group index space."""
    old = np.array([[0, 1, 2, 3, 0, 1, 2, 3]])  # 4 old ranks x 2 slots
    new = np.array([[3, 2, 1, 0]])  # 2 new ranks x 2 slots
    o, n, info = expand_maps(old, new, {0: 1, 1: -1, 2: 0, 3: -1}, 4)
    assert np.array_equal(o, old)
    assert n.tolist() == [[1, 0, -1, -1, 3, 2, -1, -1]]


def test_expand_scale_up_old_map():
    """Scale-up: the old map gets -1 slots for joining ranks, in new-group index space."""
    old = np.array([0, 1, 2, 3])  # 2 old ranks x 2 slots
    new = np.array([3, 2, 1, 0, 0, 1, 2, 3])  # 4 new ranks
    o, n, _ = expand_maps(old, new, {0: 2, 1: 0}, 4)
    assert o.tolist() == [2, 3, -1, -1, 0, 1, -1, -1]
    assert np.array_equal(n, new)
    assert expand_phy2log(old, (1, -1), 2).tolist() == [-1, -1, 0, 1]


@pytest.mark.parametrize(
    "group_of_rank,group_size,match",
    [
        ([1, 1], 2, r"^group_of_rank: the group ranks other than -1 must be distinct"),
        ([0, 5], 2, r"^group_of_rank: entry 1 must be an int in \[-1, group_size=2\)"),
        ([0, 2], 2, r"^group_of_rank: entry 1 must be an int in \[-1, group_size=2\)"),
        ([0, -2], 2, r"^group_of_rank: entry 1 must be an int in \[-1, group_size=2\)"),
        ([0, 1.0], 2, r"^group_of_rank: entry 1 must be an int"),
        ([0, True], 2, r"^group_of_rank: entry 1 must be an int"),
        ([], 2, r"^group_of_rank: must be a non-empty list"),
        ([0, -1], 0, r"^group_size: must be a positive int"),
        ([-1, -1], -1, r"^group_size: must be a positive int"),
        ([0, 1], 2.0, r"^group_size: must be a positive int"),
    ],
)
def test_expand_phy2log_refuses_a_bad_placement_by_name(group_of_rank, group_size, match):
    """Duplicate or out-of-range group ranks and a non-positive group size are ValueErrors naming the field."""
    with pytest.raises(ValueError, match=match):
        expand_phy2log(np.array([0, 1, 2, 3]), group_of_rank, group_size)


def test_expand_phy2log_takes_a_numpy_placement():
    """A 1-D numpy array of group ranks places slots like the same list."""
    old = np.array([[0, 1, 2, 3]])
    assert expand_phy2log(old, np.array([2, 0]), 3).tolist() == expand_phy2log(old, [2, 0], 3).tolist()


@pytest.mark.parametrize(
    "old,new,mapping,group,match",
    [
        (np.zeros((1, 6), int), np.zeros((1, 2), int), {0: 0, 1: -1, 2: -1, 3: -1}, 4, "divide by the 4 old ranks"),
        (np.zeros((1, 8), int), np.zeros((1, 3), int), {0: 0, 1: 1, 2: -1, 3: -1}, 4, "must span the 2 new ranks"),
        (np.zeros((2, 4), int), np.zeros((1, 8), int), {0: 0, 1: 1}, 4, "same layers"),
        (np.zeros((1, 4)), np.zeros((1, 8), int), {0: 0, 1: 1}, 4, "old_phy2log: must be an integer"),
        (torch.zeros(1, 4, dtype=torch.int64, device="meta"), np.zeros((1, 8), int), {0: 0, 1: 1}, 4,
         "old_phy2log must hold data"),
        (np.full((1, 4), 9), np.zeros((1, 8), int), {0: 0, 1: 1}, 4, r"old_phy2log: expert ids"),
    ],
)
def test_expand_rejects_bad_maps(old, new, mapping, group, match):
    """Maps that do not fit the mapping's rank counts raise ValueError naming the map."""
    with pytest.raises(ValueError, match=match):
        expand_maps(old, new, mapping, group)


def _world(old: np.ndarray, g: int, empty_value: float = -99.0):
    """Per rank, one layer, one float64 tensor whose row holds the expert id (empty: -99)."""
    s = old.shape[1] // g
    return [
        [[torch.tensor([float(e) if e >= 0 else empty_value for e in old[k, r * s : (r + 1) * s]], dtype=torch.float64)]
         for k in range(old.shape[0])]
        for r in range(g)
    ]


def test_scale_down_4_to_2_in_process():
    """4 -> 2 in the old group: kept ranks end with the new map's experts; leaving ranks only send."""
    old = np.array([[0, 1, 2, 3, 0, 1, 2, 3]])  # 4 ranks x 2 slots, 4 experts twice
    new = np.array([[0, 3, 1, 2]])  # 2 new ranks x 2 slots
    mapping = {0: -1, 1: 0, 2: 1, 3: -1}
    weights = _world(old, 4)
    comm = InProcessCommunicator(4)
    rearrange_expert_weights_inplace(old, new, weights, communicator=comm, rank_mapping=mapping,
                                     buffer=TransferBuffer())
    assert weights[1][0][0].tolist() == [0.0, 3.0]  # new rank 0 = old rank 1: 0 from leaving rank 0
    assert weights[2][0][0].tolist() == [1.0, 2.0]  # new rank 1 = old rank 2: 2 from rank 1
    assert weights[0][0][0].tolist() == [0.0, 1.0]  # leaving ranks are not written
    assert comm.messages == {(0, 1): 1, (1, 2): 1}


def test_scale_up_2_to_4_in_process():
    """2 -> 4 in the new group: joining ranks (old slots empty) receive their experts."""
    old = np.array([[0, 1, 2, 3]])  # 2 old ranks x 2 slots
    new = np.array([[0, 1, 2, 3, 1, 3, 0, 2]])  # 4 new ranks
    mapping = {0: 0, 1: 1}
    weights = _world(np.array([[0, 1, 2, 3, -1, -1, -1, -1]]), 4)
    comm = InProcessCommunicator(4)
    rearrange_expert_weights_inplace(old, new, weights, communicator=comm, rank_mapping=mapping,
                                     buffer=TransferBuffer())
    assert [weights[r][0][0].tolist() for r in range(4)] == [[0, 1], [2, 3], [1, 3], [0, 2]]
    assert comm.messages[(0, 2)] == 1 and comm.messages[(1, 2)] == 1 and comm.total_messages == 4
