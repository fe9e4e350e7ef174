"""policy/base.py: the shared argument checks every policy runs before it computes anything."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eplb_fsm.policy.base import checked_float32
from eplb_fsm.policy.default import DefaultEplbPolicy
from eplb_fsm.policy.movement import MovementAwarePolicy
from eplb_fsm.policy.reference import reference_rebalance_experts

WEIGHT = torch.arange(16, dtype=torch.float32).reshape(2, 8) + 1
OLD = np.tile(np.array([0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]), (2, 1))


@pytest.mark.parametrize("policy", [DefaultEplbPolicy, MovementAwarePolicy])
@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64, np.int32])
def test_an_unsigned_old_placement_is_read_like_a_signed_one(policy, dtype):
    """A placement stored as uint16/32/64 is valid input (torch has no min() for those): same result as int64."""
    expected = policy.rebalance_experts(WEIGHT, 12, 1, 1, 4, old_phy2log=torch.from_numpy(OLD))
    got = policy.rebalance_experts(WEIGHT, 12, 1, 1, 4, old_phy2log=OLD.astype(dtype))
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


@pytest.mark.parametrize("bad, match", [
    (np.array([[0, 1], [2, 3]], dtype=object), "old_phy2log must hold integers"),
    ([[0, 1, 2], [0, 1]], "old_phy2log must be a 2-D integer array or tensor"),
    (OLD.astype(np.float64), "old_phy2log must hold integers"),
    (OLD[:1], "old_phy2log must be 2-D with 2 rows"),
    (OLD + 8, r"old_phy2log entries must be in \[-1, 8\)"),
])
def test_a_malformed_old_placement_is_a_value_error_naming_it(bad, match):
    """Ragged, object, float, wrong-shaped or out-of-range old_phy2log: ValueError naming old_phy2log."""
    with pytest.raises(ValueError, match=match):
        DefaultEplbPolicy.rebalance_experts(WEIGHT, 12, 1, 1, 4, old_phy2log=bad)


def test_checked_float32_turns_negative_zero_into_zero_without_touching_the_input():
    """A -0.0 load comes back as +0.0 (no sign bit for the packing keys) and the caller's array keeps its -0.0."""
    weight = np.array([[1.0, -0.0, 2.0], [-0.0, -0.0, 3.0]], dtype=np.float32)
    out = checked_float32(weight)
    assert out.view(np.int32).min() >= 0 and np.array_equal(out, weight)
    assert np.signbit(weight).sum() == 3


def _negative_zero_load(layers: int, experts: int, loaded: int) -> np.ndarray:
    """All-ones loads but one layer with only its first ``loaded`` experts loaded and -0.0 elsewhere."""
    weight = np.ones((layers, experts), dtype=np.float32)
    weight[5, loaded:] = -0.0
    return weight


@pytest.mark.parametrize("weight, call", [
    (_negative_zero_load(200, 16, 3), (16, 1, 1, 4)),  # keyed packing
    (_negative_zero_load(20, 96, 31), (96, 1, 1, 32)),  # packing in rounds
    (_negative_zero_load(64, 32, 5), (64, 4, 2, 8)),  # hierarchical
])
def test_negative_zero_loads_plan_like_the_reference_without_the_kernel(monkeypatch, weight, call):
    """With the numpy path forced, -0.0 loads give the reference's plan and the movement policy a valid one."""
    monkeypatch.setenv("EPLB_FSM_NATIVE", "0")
    got = DefaultEplbPolicy.rebalance_experts(torch.from_numpy(weight), *call)
    expected = reference_rebalance_experts(torch.from_numpy(weight), *call)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    old = np.ascontiguousarray(expected[0].numpy()[:, ::-1])
    weight[0, 0] = 50.0  # layer 0 has to change
    phy2log, _, count = MovementAwarePolicy.rebalance_experts(weight, *call, old_phy2log=old)
    assert phy2log.min() >= 0 and phy2log.max() < weight.shape[1] and (count >= 1).all()
