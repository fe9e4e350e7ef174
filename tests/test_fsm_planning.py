"""plan_placements: the policy's placement priced, and aligned to the old rows when asked."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eplb_fsm.fsm.model_entry import build_model_entry
from eplb_fsm.fsm.planning import plan_placements
from eplb_fsm.policy import get_policy
from eplb_fsm.sim.model import ToyMoE


class ReverseRanks:
    """A policy that keeps every rank's experts but reverses their order inside the rank."""

    ranks = 2

    @classmethod
    def rebalance_experts(cls, load, num_physical, num_groups, num_nodes, num_ranks, old_phy2log=None):
        rows = old_phy2log.numpy().reshape(old_phy2log.shape[0], num_ranks, -1)[:, :, ::-1]
        return torch.from_numpy(rows.reshape(old_phy2log.shape[0], -1).copy()), None, None


def _entry(layers: int, experts: int, redundant: int, ranks: int, phy2log=None):
    model = ToyMoE(num_layers=layers, num_experts=experts, num_redundant=redundant, hidden=4, top_k=2,
                   rank=0, world_size=ranks)
    return build_model_entry(model, "main", 0, 0, ranks, redundant, 4, torch.device("cpu"), phy2log=phy2log)


def _plan(policy, entry, load, ranks, align):
    return plan_placements(policy, [entry], [load], num_nodes=1, world_size=ranks, step=0, forced=False,
                           align_slots=align)


def test_a_reordering_inside_ranks_is_no_change_once_aligned():
    """A policy that only reorders each rank's rows changes every layer as given and none once aligned."""
    entry = _entry(3, 6, 2, 2)
    load = torch.ones(3, 6, dtype=torch.float64)
    raw, aligned = (_plan(ReverseRanks, entry, load, 2, align) for align in (False, True))
    assert all(raw.changed) and raw.moves == 0
    assert not any(aligned.changed) and aligned.moves == 0
    assert np.array_equal(aligned.new_phy2log[0], entry.maps.phy2log)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), ranks=st.sampled_from([2, 4]), redundant=st.sampled_from([0, 4, 8]))
def test_aligned_plans_hold_the_same_rank_sets_and_copy_no_more_rows(seed, ranks, redundant):
    """Aligned: every rank holds what the policy gave it, balance and moves agree, kept experts keep their row."""
    rng = np.random.default_rng(seed)
    layers, experts = 4, 16
    slots = (experts + redundant) // ranks
    old = np.stack([rng.permutation(np.arange(experts + redundant) % experts) for _ in range(layers)])
    entry = _entry(layers, experts, redundant, ranks, phy2log=old)
    load = torch.from_numpy(rng.integers(0, 1000, size=(layers, experts)).astype(np.float64))
    policy = get_policy("default")
    raw, aligned = (_plan(policy, entry, load, ranks, align) for align in (False, True))
    a, r = aligned.new_phy2log[0], raw.new_phy2log[0]
    per_rank = (layers, ranks, slots)
    assert np.array_equal(np.sort(a.reshape(per_rank), axis=2), np.sort(r.reshape(per_rank), axis=2))
    assert (aligned.moves, aligned.moved_bytes) == (raw.moves, raw.moved_bytes)
    assert aligned.balancedness_after == pytest.approx(raw.balancedness_after, rel=1e-12)
    assert (a != old).sum() <= (r != old).sum()
    # an expert still on its rank sits in (one of) its old rows there
    for layer in range(layers):
        for g in range(ranks):
            old_rows, new_rows = old[layer, g * slots:(g + 1) * slots], a[layer, g * slots:(g + 1) * slots]
            for expert in set(old_rows.tolist()) & set(new_rows.tolist()):
                kept = min((old_rows == expert).sum(), (new_rows == expert).sum())
                assert ((old_rows == expert) & (new_rows == expert)).sum() == kept



class DoubleOnRankZero:
    """A policy that gives rank 0 two slots of expert 5, which it did not hold, in every layer."""

    @classmethod
    def rebalance_experts(cls, load, num_physical, num_groups, num_nodes, num_ranks, old_phy2log=None):
        return torch.tensor([[5, 5, 2, 3, 4, 0, 1, 0]] * load.shape[0]), None, None


def test_moved_bytes_counts_one_row_per_expert_a_rank_gains_however_many_slots():
    """Rank 0 gaining expert 5 in two slots receives one row: moves count 2 a layer, moved_bytes 1 row a layer."""
    entry = _entry(2, 6, 2, 2)   # 8 slots on 2 ranks: rank 0 holds experts 0-3, rank 1 holds 4, 5, 0, 1
    plan = _plan(DoubleOnRankZero, entry, torch.ones(2, 6, dtype=torch.float64), 2, align=False)
    assert plan.moves == 2 * 2
    assert plan.moved_bytes == 2 * entry.slot_bytes[0]
