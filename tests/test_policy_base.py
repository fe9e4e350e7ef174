"""policy/base.py: the shared argument checks every policy runs before it computes anything."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eplb_fsm.policy.base import build_log2phy, check_rebalance_args, checked_float32
from eplb_fsm.policy.bounds import rank_loads
from eplb_fsm.policy.default import DefaultEplbPolicy
from eplb_fsm.policy.movement import MovementAwarePolicy, moved_mask, rank_membership
from eplb_fsm.policy.movement.targets import align_rows
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


# slot 3 holds "expert 2**64 - 1": a plain astype(np.int64) would read it as -1, an empty slot
_WRAPS = np.array([[0, 1, 1, 2**64 - 1]], dtype=np.uint64)
_FULL = np.array([[0, 1, 1, 0]], dtype=np.int64)


@pytest.mark.parametrize("call, name", [
    (lambda: rank_loads(_WRAPS, np.array([[4.0, 2.0]]), 2), "phy2log"),
    (lambda: build_log2phy(_WRAPS, 2, 3), "phy2log"),
    (lambda: moved_mask(_FULL, _WRAPS, 2), "new_phy2log"),
    (lambda: moved_mask(_WRAPS, _FULL, 2), "old_phy2log"),
    (lambda: rank_membership(_WRAPS, 2, 2), "phy2log"),
    (lambda: align_rows(_FULL, _WRAPS, 2), "new_phy2log"),
])
def test_a_uint64_entry_past_int64_is_refused_not_read_as_an_empty_slot(call, name):
    """A uint64 2**64 - 1 in a placement raises ValueError naming the entry, as maps does, instead of becoming -1."""
    with pytest.raises(ValueError, match=rf"^{name}\[0, 3\] = 18446744073709551615 is not an expert index"):
        call()


@pytest.mark.parametrize("native", ["1", "0"])
@pytest.mark.parametrize("policy", [DefaultEplbPolicy, MovementAwarePolicy])
@pytest.mark.parametrize("shape, replicas, match", [
    ((1, 1), 2**31, r"num_replicas must be below 2\*\*31"),
    ((1, 1), 2**62, r"num_replicas must be below 2\*\*31"),
    ((1, 2**14), 2**15, r"num_replicas \(32768\) is too large for 1 layers of 16384 experts: log2phy"),
    ((2**10, 2), 2**18, r"num_replicas \(262144\) is too large .* more than 2\*\*28"),
], ids=["p_2_31", "p_2_62", "wide_log2phy", "deep_log2phy"])
def test_num_replicas_too_large_is_refused_before_any_allocation(monkeypatch, native, policy, shape, replicas, match):
    """P >= 2**31, or a log2phy past 2**28 entries, raises ValueError naming num_replicas on both paths."""
    monkeypatch.setenv("EPLB_FSM_NATIVE", native)
    with pytest.raises(ValueError, match=match):
        policy.rebalance_experts(np.ones(shape, dtype=np.float32), replicas, 1, 1, 1)


def test_num_replicas_at_the_log2phy_limit_is_accepted():
    """A log2phy of exactly 2**28 entries is within the rule (checked on the arguments alone)."""
    weight32, replicas, *_ = check_rebalance_args(np.ones((2**8, 1), np.float32), 2**20, 1, 1, 1)
    assert replicas == 2**20 and tuple(weight32.shape) == (2**8, 1)
