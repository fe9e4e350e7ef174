"""Tests for eplb_fsm.maps."""

import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st


from eplb_fsm.maps import MAX_SECONDS, ExpertMaps, as_count, check_seconds, derive_log2phy, host_array, initial_phy2log


def test_initial_placement_layout():
    """Slot i < N holds expert i and redundant slot N+j holds expert j mod N."""
    p2l = initial_phy2log(2, 4, 10)
    assert p2l.tolist()[0] == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    assert p2l.dtype == np.int64 and p2l.shape == (2, 10)


def test_initial_maps_counts_and_slots():
    """The initial maps list each expert's slots ascending with matching counts."""
    m = ExpertMaps.initial(1, 3, 5)
    assert m.replica_count.tolist() == [[2, 2, 1]]
    assert m.log2phy[0].tolist() == [[0, 3, -1], [1, 4, -1], [2, -1, -1]]


def test_log2phy_is_ascending_whatever_the_slot_order():
    """log2phy rows are ascending even when the expert's slots appear out of order in phy2log."""
    m = ExpertMaps.from_phy2log([[2, 0, 2, 1, 2, 0]], 3)
    assert m.log2phy[0].tolist() == [[1, 5, -1, -1], [3, -1, -1, -1], [0, 2, 4, -1]]
    assert m.replica_count.tolist() == [[2, 1, 3]]


def test_empty_slots_allowed_only_when_asked():
    """Empty slots (-1) are accepted for elastic scale-up and rejected otherwise."""
    m = ExpertMaps.from_phy2log([[0, 1, -1, -1]], 2, allow_empty=True)
    assert m.replica_count.tolist() == [[1, 1]]
    with pytest.raises(ValueError, match=r"phy2log\[0, 2\] = -1 is outside"):
        ExpertMaps.from_phy2log([[0, 1, -1, -1]], 2)


@pytest.mark.parametrize(
    "phy2log, num_logical, message",
    [
        ([[0, 1, 5]], 3, r"phy2log\[0, 2\] = 5 is outside"),
        ([[0, 0, 0]], 2, "logical expert 1 without a replica in layer 0"),
        ([0, 1, 2], 3, "must be 2-D"),
        ([[0.0, 1.0]], 2, "must hold integers"),
        ([[0]], 2, "every expert needs a slot|no replica"),
    ],
)
def test_bad_maps_rejected(phy2log, num_logical, message):
    """Maps that break an invariant raise ValueError saying which one."""
    with pytest.raises(ValueError, match=message):
        ExpertMaps.from_phy2log(phy2log, num_logical)


@pytest.mark.parametrize(
    "args, message",
    [
        ((2, 16.5, 20), "num_logical must be an integer, got 16.5"),
        ((2, 16.0, 20), "num_logical must be an integer"),
        ((True, 4, 4), "num_layers must be an integer"),
        ((2, 4, "8"), "num_physical must be an integer"),
        ((0, 4, 4), "num_layers must be >= 1"),
        ((2, 4, 3), r"num_physical \(3\) must be >= num_logical \(4\)"),
    ],
)
def test_initial_placement_rejects_non_counts(args, message):
    """A size that is not a whole count >= 1 is refused by name, never truncated (16.5 is not 16)."""
    with pytest.raises(ValueError, match=message):
        initial_phy2log(*args)


def test_as_count_takes_numpy_integers_only():
    """numpy integers are counts; numpy bools and floats are not."""
    assert as_count(np.int32(5), "n") == 5 and type(as_count(np.int64(5), "n")) is int
    for bad in (np.bool_(True), np.float64(5.0)):
        with pytest.raises(ValueError, match="n must be an integer"):
            as_count(bad, "n")
    with pytest.raises(ValueError, match="n must be >= 0, got -1"):
        as_count(-1, "n", minimum=0)


def test_host_array_reads_tensors_of_any_dtype_but_not_meta():
    """host_array gives numpy for lists and tensors, float32 for dtypes numpy lacks, and refuses meta by name."""
    import torch

    assert host_array([[1, 2]], "x").tolist() == [[1, 2]]
    assert host_array(torch.tensor([[3, 4]]), "x").dtype == np.int64
    exact = torch.tensor([1.5, -2.25, 3.0e38], dtype=torch.float32).to(torch.bfloat16)
    back = host_array(exact, "x")
    assert back.dtype == np.float32 and back.tolist() == exact.float().tolist()
    with warnings.catch_warnings():  # torch calls complex32 experimental when one is made
        warnings.simplefilter("ignore", UserWarning)
        half = host_array(torch.tensor([1 + 2j], dtype=torch.complex32), "x")
    assert half.dtype == np.complex64 and half.tolist() == [1 + 2j]
    with pytest.raises(ValueError, match="load must hold data"):
        host_array(torch.zeros(2, device="meta"), "load")


def test_slots_of_rank_are_the_rank_s_consecutive_slots_and_nothing_outside():
    """slots_of_rank gives S consecutive slots per rank and refuses a rank outside [0, G) by name."""
    m = ExpertMaps.initial(1, 4, 6)
    assert [m.slots_of_rank(r, 3) for r in range(3)] == [slice(0, 2), slice(2, 4), slice(4, 6)]
    for rank, message in ((3, "rank must be < world_size"), (-1, "rank must be >= 0"),
                          (1.0, "rank must be an integer")):
        with pytest.raises(ValueError, match=message):
            m.slots_of_rank(rank, 3)
    with pytest.raises(ValueError, match="divisible by world_size"):
        m.slots_of_rank(0, 4)


def test_maps_refuse_a_meta_tensor_and_a_fractional_count():
    """from_phy2log names the argument when the placement has no data or a count is fractional."""
    import torch

    with pytest.raises(ValueError, match="phy2log must hold data"):
        ExpertMaps.from_phy2log(torch.zeros(1, 4, dtype=torch.int64, device="meta"), 2)
    with pytest.raises(ValueError, match="num_logical must be an integer"):
        ExpertMaps.from_phy2log([[0, 1, 0, 1]], 2.5)
    with pytest.raises(ValueError, match="max_replicas must be an integer"):
        ExpertMaps.from_phy2log([[0, 1, 0, 1]], 2, max_replicas=2.0)


def test_validate_catches_tampered_derived_maps():
    """validate() notices a replica_count or log2phy that disagrees with phy2log."""
    m = ExpertMaps.initial(2, 3, 4)
    m.replica_count[1, 2] = 2
    with pytest.raises(ValueError, match=r"replica_count\[1, 2\]"):
        m.validate()
    m = ExpertMaps.initial(2, 3, 4)
    m.log2phy[0, 0] = m.log2phy[0, 0][::-1].copy()
    with pytest.raises(ValueError, match=r"log2phy\[0, 0\].*ascending"):
        m.validate()


def test_replace_layer_changes_only_that_layer():
    """replace_layer updates the three maps of one layer and leaves the others alone."""
    m = ExpertMaps.initial(3, 4, 6)
    before = m.copy()
    m.replace_layer(1, [3, 3, 2, 1, 0, 3])
    assert m.replica_count[1].tolist() == [1, 1, 1, 3]
    assert m.log2phy[1, 3, :3].tolist() == [0, 1, 5]
    for layer in (0, 2):
        assert np.array_equal(m.phy2log[layer], before.phy2log[layer])
    m.validate()


@pytest.mark.parametrize(
    "layer, row, message",
    [
        (3, [0, 1, 2, 3, 0, 1], "layer must be in"),
        (-1, [0, 1, 2, 3, 0, 1], "layer must be >= 0"),
        (1.0, [0, 1, 2, 3, 0, 1], "layer must be an integer"),
        (True, [0, 1, 2, 3, 0, 1], "layer must be an integer"),
        (0, [0, 1, 2, 3], "must have 6 slots"),
        (0, [0, 0, 0, 0, 0, 0], "without a replica"),
        (0, [0, 1, 2, 9, 0, 1], "outside"),
        (0, [-1] * 6, "empty slots not allowed here"),
        (0, [0, 1, 2, 3, -1, 1], "empty slots not allowed here"),
    ],
)
def test_replace_layer_rejects_bad_rows_without_change(layer, row, message):
    """A bad replacement row raises and leaves every map unchanged."""
    m = ExpertMaps.initial(3, 4, 6)
    before = m.copy()
    with pytest.raises(ValueError, match=message):
        m.replace_layer(layer, row)
    assert np.array_equal(m.phy2log, before.phy2log)
    assert np.array_equal(m.log2phy, before.log2phy)
    assert np.array_equal(m.replica_count, before.replica_count)


def test_maps_built_with_empty_slots_keep_that_rule():
    """Maps built with allow_empty take a row with empty slots (mid scale-up) and still validate; a copy too."""
    m = ExpertMaps.from_phy2log([[0, 1, 2, 3, -1, -1]] * 2, 4, allow_empty=True)
    m.replace_layer(1, [3, 2, 1, 0, 0, -1])
    m.validate()
    c = m.copy()
    c.replace_layer(0, [-1, 1, 2, 3, 0, -1])
    c.validate()
    assert c.allow_empty and c.phy2log[0].tolist() == [-1, 1, 2, 3, 0, -1]
    with pytest.raises(ValueError, match="outside"):
        c.validate(allow_empty=False)


def test_a_commit_that_empties_slots_makes_the_maps_mid_scale():
    """replace_layer(allow_empty=True) (the controller's commits in a scale) on strict maps: they validate after."""
    m = ExpertMaps.initial(2, 4, 6)
    m.replace_layer(0, [0, 1, 2, 3, -1, -1], allow_empty=True)
    assert m.allow_empty
    m.validate()


def test_slots_of_rank():
    """A rank owns S = P / G consecutive global slots, and P must divide by G."""
    m = ExpertMaps.initial(1, 4, 8)
    assert m.slots_of_rank(2, 4) == slice(4, 6)
    with pytest.raises(ValueError, match="divisible"):
        m.slots_of_rank(0, 3)


def test_as_torch_returns_int64_tensors():
    """as_torch gives int64 tensors equal to the numpy maps."""
    m = ExpertMaps.initial(1, 2, 3)
    p2l, l2p, cnt = m.as_torch()
    assert str(p2l.dtype) == "torch.int64" and p2l.tolist() == m.phy2log.tolist()
    assert l2p.shape == (1, 2, 2) and cnt.tolist() == [[2, 1]]


@st.composite
def placements(draw):
    layers = draw(st.integers(1, 3))
    n = draw(st.integers(1, 6))
    p = draw(st.integers(n, n + 6))
    rows = []
    for _ in range(layers):
        # every expert at least once, then arbitrary extra replicas, shuffled
        extra = draw(st.lists(st.integers(0, n - 1), min_size=p - n, max_size=p - n))
        row = list(range(n)) + extra
        perm = draw(st.permutations(range(p)))
        rows.append([row[i] for i in perm])
    return np.array(rows, dtype=np.int64), n


@given(placements())
def test_derived_maps_round_trip(case):
    """For any valid placement, log2phy/replica_count are consistent and name exactly phy2log's slots."""
    p2l, n = case
    m = ExpertMaps.from_phy2log(p2l, n)
    assert m.replica_count.sum(axis=1).tolist() == [p2l.shape[1]] * p2l.shape[0]
    for layer in range(p2l.shape[0]):
        for expert in range(n):
            slots = m.log2phy[layer, expert]
            listed = slots[slots >= 0]
            assert listed.tolist() == sorted(np.flatnonzero(p2l[layer] == expert).tolist())
            assert (slots[len(listed):] == -1).all()


@given(placements())
def test_derive_with_too_small_width_is_rejected(case):
    """Asking for fewer replica columns than the busiest expert needs is an error."""
    p2l, n = case
    _, counts = derive_log2phy(p2l, n)
    width = int(counts.max())
    if width > 1:
        with pytest.raises(ValueError, match="max_replicas"):
            derive_log2phy(p2l, n, width - 1)


def test_check_seconds_takes_any_real_finite_positive_number():
    """Python and numpy numbers pass as floats; a bool, inf, over MAX_SECONDS or a string is refused by name."""
    assert check_seconds(2, "x") == 2.0 and check_seconds(np.float32(0.5), "x") == 0.5
    assert check_seconds(np.int64(3), "x") == 3.0
    with pytest.raises(ValueError, match="^join_timeout must be"):
        check_seconds(np.bool_(True), "join_timeout")
    assert check_seconds(MAX_SECONDS, "x") == MAX_SECONDS
    for bad in (float("inf"), "1", 0, MAX_SECONDS * 1.01, 1e14):  # 1e14 s overflowed gloo's timedelta
        with pytest.raises(ValueError, match="^timeout_s must be a finite number > 0 and <= 1e"):
            check_seconds(bad, "timeout_s")


@pytest.mark.parametrize("row", [[[0, 1], [2, 3]], [[[0, 1, 2, 3]]]])
def test_replace_layer_refuses_anything_but_one_row(row):
    """A (2, 2) array or a (1, 1, P) nesting is not a row: refused naming phy2log_row, the maps unchanged."""
    maps = ExpertMaps.initial(2, 4, 4)
    before = maps.phy2log.copy()
    with pytest.raises(ValueError, match=r"phy2log_row must be one row \(P,\)"):
        maps.replace_layer(1, row)
    assert np.array_equal(maps.phy2log, before)


def test_uint64_entry_past_int64_is_refused_not_read_as_empty():
    """A uint64 entry of 2**64 - 1 is refused by name, not wrapped to -1 (an empty slot), nothing changed."""
    huge = np.array([[0, 1, 2, 2**64 - 1]], dtype=np.uint64)
    with pytest.raises(ValueError, match=r"phy2log\[0, 3\] = 18446744073709551615 is not an expert index"):
        ExpertMaps.from_phy2log(huge, 3, allow_empty=True)
    maps = ExpertMaps.from_phy2log(np.array([[0, 1, 2, 0]]), 3)
    with pytest.raises(ValueError, match=r"phy2log_row\[3\] = 18446744073709551615 is not an expert index"):
        maps.replace_layer(0, huge[0])
    assert maps.phy2log.tolist() == [[0, 1, 2, 0]]
    assert ExpertMaps.from_phy2log(huge[:, :3], 3).phy2log.tolist() == [[0, 1, 2]]


@pytest.mark.parametrize(
    "row, message",
    [
        ([0, 1, 2, 3, 9, 0], r"^phy2log_row\[4\] = 9 is outside \[0, 4\) \(empty slots not allowed here\) "
                             r"\(layer 2\)$"),
        ([0, 1, 2, 3, -5, 0], r"^phy2log_row\[4\] = -5 is outside \[0, 4\) \(empty slots not allowed here\) "
                              r"\(layer 2\)$"),
        ([0, 0, 0, 0, 0, 1], r"^phy2log_row leaves logical expert 2 without a replica in layer 2$"),
    ],
    ids=["above", "below", "missing"],
)
def test_replace_layer_errors_name_the_row_entry_and_the_real_layer(row, message):
    """A bad row for layer 2 is named phy2log_row[j] with layer 2, not phy2log[0, j] / layer 0; nothing changes."""
    maps = ExpertMaps.initial(3, 4, 6)
    before = maps.phy2log.copy()
    with pytest.raises(ValueError, match=message):
        maps.replace_layer(2, row)
    assert np.array_equal(maps.phy2log, before)


@pytest.mark.parametrize("huge", [10**400, -(10**400)], ids=["10**400", "-10**400"])
def test_check_seconds_refuses_an_integer_too_large_for_a_float_by_name(huge):
    """10**400 seconds is a ValueError naming the argument and the rule, not an OverflowError."""
    with pytest.raises(ValueError, match=r"^timeout_s must be a finite number > 0 and <= 1e\+06 \(seconds\), "
                                         r"got an integer of 1329 bits \(too large for a float\)$"):
        check_seconds(huge, "timeout_s")
