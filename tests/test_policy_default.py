"""Tests for eplb_fsm.policy.default: the helpers, hand-computed plans and bad input.

Agreement with the per-item reference on random problems, benchmark shapes and traces is
in test_policy_default_reference.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eplb_fsm.policy.base import build_log2phy, checked_float32
from eplb_fsm.policy import native
from eplb_fsm.policy.default import (
    DefaultEplbPolicy,
    balanced_packing,
    descending_order,
    inverse_permutation,
    replicate_experts,
    group_loads,
    slots_of_experts,
)
from eplb_fsm.policy.reference import (
    reference_balanced_packing,
    reference_rebalance_experts,
    reference_replicate_experts,
)


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


# --------------------------------------------------------------------------- hand-computed cases


@pytest.mark.parametrize(
    "weights, packs, pack_index, rank_in_pack",
    [
        # visit 4,3,2,1: 4->p0, 3->p1, 2->p1 (3 < 4), 1->p0 (p1 full)
        ([4, 3, 2, 1], 2, [0, 1, 1, 0], [0, 0, 1, 1]),
        # equal weights: visited 0,1,2,3; equal totals go to the lowest pack
        ([1, 1, 1, 1], 2, [0, 1, 0, 1], [0, 0, 1, 1]),
        # visit 1,3 (5) then 0,2 (2) then 4,5 (1): 1->p0, 3->p1, 0->p2, 2->p2, 4->p0 (tie 5/5), 5->p1
        ([2, 5, 2, 5, 1, 1], 3, [2, 0, 2, 1, 0, 1], [0, 0, 1, 0, 1, 1]),
        # all zero: every pack stays at 0, so the lowest non-full pack wins each time
        ([0, 0, 0, 0], 2, [0, 0, 1, 1], [0, 1, 0, 1]),
        # one item per pack: identity
        ([3, 1, 2], 3, [0, 1, 2], [0, 0, 0]),
        # one pack: arrival order is the descending order
        ([1, 3, 2], 1, [0, 0, 0], [2, 0, 1]),
    ],
)
def test_balanced_packing_hand_cases(weights, packs, pack_index, rank_in_pack):
    """Balanced packing matches hand-worked results, including pack and item ties."""
    w = np.array([weights], dtype=np.float32)
    got_pack, got_rank = balanced_packing(w, packs)
    assert got_pack.tolist() == [pack_index]
    assert got_rank.tolist() == [rank_in_pack]
    ref_pack, ref_rank = reference_balanced_packing([np.float32(x) for x in weights], packs)
    assert (ref_pack, ref_rank) == (pack_index, rank_in_pack)


def test_balanced_packing_rows_are_independent():
    """Each row of a batch packs exactly as it would alone."""
    rows = np.array([[4, 3, 2, 1], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=np.float32)
    pack, rank = balanced_packing(rows, 2)
    for i, row in enumerate(rows):
        alone = balanced_packing(row[None], 2)
        assert pack[i].tolist() == alone[0][0].tolist() and rank[i].tolist() == alone[1][0].tolist()


def test_balanced_packing_accumulates_in_float32():
    """Pack totals are float32 running sums: 2**24 + 1 rounds back to 2**24 and changes a choice."""
    # 2**24 -> p0; 2**24-1 -> p1; 1 -> p1 (now 2**24); 1 -> p0 (tie; float32 total stays 2**24);
    # 1 -> p0 in float32 (tie again) but p1 in float64 (2**24+1 > 2**24); 0 -> the other pack.
    values = [2.0**24, 2.0**24 - 1, 1.0, 1.0, 1.0, 0.0]
    pack32, _ = balanced_packing(np.array([values], dtype=np.float32), 2)
    assert pack32.tolist() == [[0, 1, 1, 0, 0, 1]]
    assert reference_balanced_packing([np.float32(x) for x in values], 2)[0] == [0, 1, 1, 0, 0, 1]
    pack64, _ = balanced_packing(np.array([values], dtype=np.float64), 2)
    assert pack64.tolist() == [[0, 1, 1, 0, 1, 0]]
    # the policy casts float64 loads to float32 first
    phy2log, _, _ = DefaultEplbPolicy.rebalance_experts(torch.tensor([values], dtype=torch.float64), 6, 1, 1, 2)
    assert phy2log.tolist() == [[0, 3, 4, 1, 2, 5]]


@pytest.mark.parametrize(
    "weights, slots, phy2log, rank, count",
    [
        # 6,3,2 -> extra slot to e0 (6), then tie 3/3 between e0 and e1 -> e0
        ([6, 3, 2], 5, [0, 1, 2, 0, 0], [0, 0, 0, 1, 2], [3, 1, 1]),
        # tie 4/4 between e1 and e2 -> e1; then e2 (4 > 2)
        ([1, 4, 4], 5, [0, 1, 2, 1, 2], [0, 0, 0, 1, 1], [1, 2, 2]),
        # no extra slot: identity
        ([1, 2], 2, [0, 1], [0, 0], [1, 1]),
        # all zero: ties everywhere go to expert 0
        ([0, 0, 0], 5, [0, 1, 2, 0, 0], [0, 0, 0, 1, 2], [3, 1, 1]),
    ],
)
def test_replicate_experts_hand_cases(weights, slots, phy2log, rank, count):
    """Replication matches hand-worked results, including ties to the lowest expert."""
    got = replicate_experts(np.array([weights], dtype=np.float32), slots)
    assert [g[0].tolist() for g in got] == [phy2log, rank, count]
    ref = reference_replicate_experts([np.float32(x) for x in weights], slots)
    assert [list(r) for r in ref] == [phy2log, rank, count]


def test_hierarchical_hand_case():
    """A worked hierarchical example: groups onto nodes, replicas within nodes, ranks within nodes."""
    # groups (2 experts each): g0=10, g1=2, g2=8, g3=4 -> node0 {g0, g1}, node1 {g2, g3}.
    # node0 [5,5,1,1] -> extra slots to e0 then e1; ranks get [e0,e0,e2] and [e1,e1,e3].
    # node1 [8,0,2,2] -> extra slots to e4 twice; ranks get [e4,e4,e5] and [e4,e6,e7].
    weight = torch.tensor([[5, 5, 1, 1, 8, 0, 2, 2]])
    phy2log, log2phy, count = DefaultEplbPolicy.rebalance_experts(weight, 12, 4, 2, 4)
    assert phy2log.tolist() == [[0, 0, 2, 1, 1, 3, 4, 4, 5, 4, 6, 7]]
    assert count.tolist() == [[2, 2, 1, 1, 3, 1, 1, 1]]
    assert log2phy.shape == (1, 8, 5)
    assert log2phy[0, 4].tolist() == [6, 7, 9, -1, -1]
    assert log2phy[0, 0].tolist() == [0, 1, -1, -1, -1]
    assert _same((phy2log, log2phy, count), reference_rebalance_experts(weight, 12, 4, 2, 4))


def test_global_fallback_when_groups_not_divisible_by_nodes():
    """num_groups % num_nodes != 0 plans exactly like groups = nodes = 1."""
    weight = torch.from_numpy(np.random.default_rng(3).integers(0, 100, (5, 12)))
    fallback = DefaultEplbPolicy.rebalance_experts(weight, 16, 3, 2, 4)
    flat = DefaultEplbPolicy.rebalance_experts(weight, 16, 1, 1, 4)
    assert _same(fallback, flat)


def test_descending_order_matches_stable_argsort():
    """The int-key sort equals a stable descending argsort, with ties, zeros and -0.0."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 4, (20, 50)).astype(np.float32)
    x[0, :5] = -0.0
    x[1] = rng.random(50).astype(np.float32) * 1e30
    expected = np.argsort(-(x + np.float32(0)), axis=1, kind="stable")
    assert (descending_order(x) == expected).all()
    x64 = x.astype(np.float64)
    assert (descending_order(x64) == expected).all()


def test_inverse_permutation():
    """inverse_permutation undoes a batch of permutations."""
    perm = np.argsort(np.random.default_rng(1).random((4, 9)), axis=1)
    inv = inverse_permutation(perm)
    assert (np.take_along_axis(perm, inv, axis=1) == np.arange(9)).all()


def test_build_log2phy_with_empty_slots():
    """build_log2phy lists slots ascending, skips -1 slots and rejects too many replicas."""
    log2phy, count = build_log2phy(np.array([[2, -1, 0, 2, -1, 2]]), 3, 3)
    assert log2phy.tolist() == [[[2, -1, -1], [-1, -1, -1], [0, 3, 5]]]
    assert count.tolist() == [[1, 0, 3]]
    with pytest.raises(ValueError, match="max_replicas"):
        build_log2phy(np.array([[0, 0, 0]]), 1, 2)
    with pytest.raises(ValueError, match="entries"):
        build_log2phy(np.array([[0, 3]]), 3, 2)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: balanced_packing(np.ones((2, 5), np.float32), 2), "num_packs"),
        (lambda: balanced_packing(np.ones(4, np.float32), 2), "2-D"),
        (lambda: balanced_packing(np.array([[1.0, np.nan]]), 1), "NaN"),
        (lambda: replicate_experts(np.ones((2, 5), np.float32), 4), "num_slots"),
    ],
)
def test_helper_bad_input(call, match):
    """The helpers reject shapes they cannot pack with a ValueError."""
    with pytest.raises(ValueError, match=match):
        call()


# --------------------------------------------------------------------------- bad input table


GOOD = torch.ones(2, 8)


@pytest.mark.parametrize(
    "args, match",
    [
        ((torch.ones(8), 8, 1, 1, 2), "weight must be 2-D"),
        ((torch.ones(2, 2, 2), 8, 1, 1, 2), "weight must be 2-D"),
        ((torch.ones(0, 8), 8, 1, 1, 2), "at least one layer"),
        ((torch.tensor([[1.0, -1.0]]), 2, 1, 1, 1), "non-negative"),
        ((torch.tensor([[1.0, float("nan")]]), 2, 1, 1, 1), "NaN"),
        ((torch.tensor([[1.0, float("inf")]]), 2, 1, 1, 1), "finite"),
        ((torch.tensor([[1e39, 1.0]], dtype=torch.float64), 2, 1, 1, 1), "float32"),
        ((torch.ones(2, 2, dtype=torch.bool), 2, 1, 1, 1), "real numbers"),
        ((torch.ones(2, 8, device="meta"), 8, 1, 1, 2), "weight must hold data"),
        ((GOOD, 6, 1, 1, 2), "num_replicas must be >= the number of experts"),
        ((GOOD, 10, 1, 1, 4), "divisible by num_ranks"),
        ((GOOD, 8, 1, 1, 0), "num_ranks must be >= 1"),
        ((GOOD, 8, 0, 1, 2), "num_groups must be >= 1"),
        ((GOOD, 8, 1, 0, 2), "num_nodes must be >= 1"),
        ((GOOD, 8, 3, 1, 2), "num_groups .* must divide"),
        ((GOOD, 12, 4, 4, 6), "num_ranks .* divisible by num_nodes"),
        ((GOOD, 8.5, 1, 1, 2), "num_replicas must be an integer"),
        ((GOOD, True, 1, 1, 2), "num_replicas must be an integer"),
        ((GOOD, 8, 1, 1, "2"), "num_ranks must be an integer"),
    ],
)
def test_bad_input_raises_value_error_naming_the_argument(args, match):
    """Every invalid argument raises ValueError naming the argument and the rule."""
    with pytest.raises(ValueError, match=match):
        DefaultEplbPolicy.rebalance_experts(*args)
    with pytest.raises(ValueError, match=match):
        reference_rebalance_experts(*args)


@pytest.mark.parametrize(
    "old, match",
    [
        (torch.zeros(3, 8, dtype=torch.int64), "old_phy2log must be 2-D with 2 rows"),
        (torch.zeros(2, 8), "old_phy2log must hold integers"),
        (torch.full((2, 8), 9), "old_phy2log entries"),
    ],
)
def test_bad_old_phy2log(old, match):
    """A malformed old_phy2log is rejected even though the default policy ignores it."""
    with pytest.raises(ValueError, match=match):
        DefaultEplbPolicy.rebalance_experts(GOOD, 8, 1, 1, 2, old_phy2log=old)


def test_old_phy2log_is_ignored():
    """A valid old_phy2log (any width, -1 allowed) does not change the default plan."""
    weight = torch.arange(16.0).reshape(2, 8)
    old = torch.tensor([[-1, 0, 1, 2, 3, 4, 5, 6, 7, 7], [7, 6, 5, 4, 3, 2, 1, 0, -1, -1]])
    assert _same(
        DefaultEplbPolicy.rebalance_experts(weight, 12, 1, 1, 4, old_phy2log=old),
        DefaultEplbPolicy.rebalance_experts(weight, 12, 1, 1, 4),
    )


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float64])
def test_any_numeric_dtype_is_cast_to_float32(dtype):
    """Loads of any real dtype plan exactly like their float32 cast; outputs are int64 CPU."""
    weight = torch.from_numpy(np.random.default_rng(5).integers(0, 200, (3, 16))).to(dtype)
    got = DefaultEplbPolicy.rebalance_experts(weight, 20, 4, 2, 4)
    assert _same(got, DefaultEplbPolicy.rebalance_experts(weight.float(), 20, 4, 2, 4))
    assert all(t.dtype == torch.int64 and t.device.type == "cpu" for t in got)


def test_numpy_input_accepted():
    """A numpy load is accepted and gives the same plan as the tensor."""
    w = np.random.default_rng(6).random((4, 8))
    assert _same(
        DefaultEplbPolicy.rebalance_experts(w, 12, 2, 2, 4),
        DefaultEplbPolicy.rebalance_experts(torch.from_numpy(w), 12, 2, 2, 4),
    )


# --------------------------------------------------------------------------- perf-path helpers


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.integers(0, 6), st.data())
def test_slots_of_experts_matches_build_log2phy(layers, experts, extra, data):
    """The default policy's log2phy for full placements, C kernel and numpy alike, equals the general build_log2phy."""
    slots = experts + extra
    rows = [data.draw(st.permutations(list(range(experts)) + data.draw(
        st.lists(st.integers(0, experts - 1), min_size=extra, max_size=extra)))) for _ in range(layers)]
    phy2log = np.array(rows, dtype=np.int64).reshape(layers, slots)
    expected, count = build_log2phy(phy2log, experts, extra + 1)
    for kernel in ("1", "0"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("EPLB_FSM_NATIVE", kernel)
            assert np.array_equal(slots_of_experts(phy2log, count, extra + 1), expected)


@pytest.mark.parametrize("make", [
    lambda w: w.to(torch.bfloat16),
    lambda w: w.numpy(),
    lambda w: w.numpy().tolist(),
    lambda w: w.to(torch.int32),
])
def test_weight_input_kinds_give_the_same_plan(make):
    """bfloat16, numpy, nested-list and integer loads are checked and planned like the float tensor."""
    weight = torch.tensor([[5.0, 1.0, 3.0, 2.0, 8.0, 1.0, 0.0, 4.0]] * 3)
    assert _same(DefaultEplbPolicy.rebalance_experts(make(weight), 12, 4, 2, 4),
                 DefaultEplbPolicy.rebalance_experts(weight, 12, 4, 2, 4))


def test_group_loads_in_blocks_equal_one_torch_sum():
    """Group sums computed in blocks below torch's grain size equal torch's single float32 sum bit for bit."""
    rng = np.random.default_rng(3)
    weight = (rng.random((300, 256)) * 1e6).astype(np.float32)  # 76,800 elements: several blocks
    expected = torch.from_numpy(weight).reshape(300, 8, 32).sum(-1).numpy()
    assert np.array_equal(group_loads(weight, 8), expected)


def test_slots_of_experts_rejects_an_expert_without_a_slot():
    """slots_of_experts refuses a placement where some expert holds no slot (its fast path needs one each)."""
    phy2log = np.array([[0, 0, 2]], dtype=np.int64)  # expert 1 missing
    with pytest.raises(ValueError, match="at least one slot"):
        slots_of_experts(phy2log, np.array([[2, 0, 1]], dtype=np.int64), 2)


@pytest.mark.parametrize("weight, match", [
    (np.array([[3, -1]], dtype=np.int64), "non-negative"),
    (np.array([[3, -1]], dtype=np.int8), "non-negative"),
    (np.array([[1.0, -0.5]], dtype=np.float64), "non-negative"),
    (np.array([[1.0, np.nan]], dtype=np.float32), "NaN"),
    (np.array([[1.0, -np.inf]], dtype=np.float32), "infinite"),
    (np.array([[3e38, 3e38]], dtype=np.float32), "float32"),
])
def test_checked_float32_names_each_bad_load(weight, match):
    """checked_float32's fast check sends every bad integer or float load to the error that names it."""
    with pytest.raises(ValueError, match=match):
        checked_float32(weight)


@pytest.mark.parametrize("dtype", [np.uint64, np.int16, np.float16, np.float64])
def test_checked_float32_accepts_integers_and_floats_as_float32(dtype):
    """Unsigned, signed and float loads (with a -0.0 for floats) come back as the contiguous float32 cast."""
    weight = np.array([[7, 0, 2**15 - 1], [1, 5, 3]], dtype=dtype)[:, ::-1]  # not contiguous
    if weight.dtype.kind == "f":
        weight[0, 1] = -0.0
    out = checked_float32(weight)
    assert out.dtype == np.float32 and out.flags.c_contiguous and out.flags.writeable
    assert np.array_equal(out, weight.astype(np.float32))


@pytest.mark.parametrize("call, match", [
    (lambda: balanced_packing(np.ones((2, 4), np.float32), 2.0), "num_packs must be an integer, got 2.0"),
    (lambda: balanced_packing(np.ones((2, 4), np.float32), True), "num_packs must be an integer, got True"),
    (lambda: balanced_packing(np.ones((2, 4), np.float32), np.int64(0)), "num_packs must be >= 1"),
    (lambda: replicate_experts(np.ones((2, 4), np.float32), 5.0), "num_slots must be an integer, got 5.0"),
    (lambda: replicate_experts(np.ones((2, 1), np.float32), True), "num_slots must be an integer, got True"),
])
def test_helper_counts_must_be_integers(call, match):
    """balanced_packing and replicate_experts refuse a float or bool count with ValueError naming it."""
    with pytest.raises(ValueError, match=match):
        call()


_BAD_PLACEMENTS = {
    "three slots, K=2": (np.array([[0, 0, 0, 1]]), 2, "more slots than max_replicas"),
    "an empty slot": (np.array([[0, -1, 1, 1]]), 3, "every slot must hold an expert"),
    "an id >= N": (np.array([[0, 1, 2, 1]]), 3, "every slot must hold an expert"),
    "a missing expert": (np.array([[0, 0, 0, 0]]), 4, "at least one slot"),
    "too many, then out of range": (np.array([[0, 0, 0, 5]]), 2, "more slots than max_replicas"),
    "out of range, then too many": (np.array([[5, 0, 0, 0]]), 2, "every slot must hold an expert"),
    "layer 0 misses, layer 1 out of range": (np.array([[0, 0, 0, 0], [0, 1, 9, 1]]), 4, "at least one slot"),
}


@pytest.mark.parametrize("kernel", ["1", "0"])
@pytest.mark.parametrize("case", list(_BAD_PLACEMENTS))
def test_slots_of_experts_names_the_same_rule_on_both_paths(monkeypatch, kernel, case):
    """A bad placement (too many replicas, -1, id >= N, missing expert) raises the same ValueError in C and numpy."""
    if kernel == "1" and not native.built():
        pytest.skip("the C kernel is not built")
    monkeypatch.setenv("EPLB_FSM_NATIVE", kernel)
    phy2log, max_replicas, match = _BAD_PLACEMENTS[case]
    with pytest.raises(ValueError, match=f"^slots_of_experts: .*{match}"):
        slots_of_experts(phy2log.astype(np.int64), np.ones((phy2log.shape[0], 2), np.int64), max_replicas)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 3), st.integers(1, 4), st.integers(1, 6), st.integers(1, 4), st.data())
def test_slots_of_experts_errors_agree_with_the_kernel(layers, experts, slots, max_replicas, data):
    """On random placements (ids in [-1, N], any counts) the numpy path gives C's log2phy or C's exact error."""
    if not native.built():
        pytest.skip("the C kernel is not built")
    values = data.draw(st.lists(st.integers(-1, experts), min_size=layers * slots, max_size=layers * slots))
    phy2log = np.array(values, dtype=np.int64).reshape(layers, slots)
    count = np.ones((layers, experts), np.int64)
    results = []
    for kernel in ("1", "0"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("EPLB_FSM_NATIVE", kernel)
            try:
                results.append(slots_of_experts(phy2log, count, max_replicas).tolist())
            except ValueError as exc:
                results.append(str(exc))
    assert results[0] == results[1]
