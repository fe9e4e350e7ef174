"""policy/base.py: the shared argument checks every policy runs before it computes anything."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eplb_fsm.policy.default import DefaultEplbPolicy
from eplb_fsm.policy.movement import MovementAwarePolicy

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
