"""Tests for eplb_fsm.stats."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from eplb_fsm.stats import (
    LoadWindow,
    RemapPlan,
    aggregate_logical,
    balancedness,
    checked_loads64,
    load_fault,
    rank_loads_physical,
)


def _feed(window, passes, dummy=()):
    for i, p in enumerate(passes):
        window.load_pass.add_(torch.as_tensor(p))
        window.record_pass(is_dummy=i in dummy)


def test_record_pass_moves_load_into_window_and_clears_pass():
    """A counted pass lands in the window and load_pass is zeroed for the next pass."""
    w = LoadWindow(1, 3, 4)
    _feed(w, [[[1, 2, 3]]])
    assert w.physical_load().tolist() == [[1, 2, 3]]
    assert w.load_pass.sum().item() == 0 and w.filled == 1


def test_dummy_passes_do_not_count_but_are_cleared():
    """A dummy pass never enters the window, yet its counts don't leak into the next pass."""
    w = LoadWindow(1, 2, 4)
    _feed(w, [[[5, 5]], [[100, 100]], [[1, 0]]], dummy={1})
    assert w.physical_load().tolist() == [[6, 5]]
    assert w.filled == 2


def test_ring_buffer_keeps_last_w_passes_in_order():
    """Past W passes the oldest are overwritten, and passes_oldest_first keeps arrival order."""
    w = LoadWindow(1, 1, 3)
    _feed(w, [[[v]] for v in (1, 2, 3, 4, 5)])
    assert w.passes_oldest_first()[:, 0, 0].tolist() == [3, 4, 5]
    assert w.physical_load().tolist() == [[12]]


def test_reset_forgets_everything():
    """reset() empties the window and the pending pass."""
    w = LoadWindow(2, 2, 2)
    _feed(w, [np.ones((2, 2), dtype=np.int64)])
    w.load_pass.fill_(3)
    w.reset()
    assert w.physical_load().sum().item() == 0 and w.load_pass.sum().item() == 0 and w.filled == 0


def test_estimators():
    """window_sum sums, decayed_sum weighs by decay**age, subwindow_max scales the largest part."""
    w = LoadWindow(1, 1, 4)
    _feed(w, [[[v]] for v in (1, 2, 3, 10)])
    assert w.estimate("window_sum").item() == 16
    assert w.estimate("decayed_sum", decay=0.5).item() == pytest.approx(10 + 3 * 0.5 + 2 * 0.25 + 1 * 0.125)
    assert w.estimate("subwindow_max", subwindows=2).item() == 26  # max(1+2, 3+10) * 2
    with pytest.raises(ValueError, match="estimator must be one of"):
        w.estimate("median")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"estimator": "decayed_sum", "decay": 0.0}, "decay must be a number in"),
        ({"estimator": "decayed_sum", "decay": 1.5}, "decay must be a number in"),
        ({"estimator": "decayed_sum", "decay": float("nan")}, "decay must be a number in"),
        ({"estimator": "subwindow_max", "subwindows": 0}, "subwindows must be >= 1"),
        ({"estimator": "subwindow_max", "subwindows": 2.5}, "subwindows must be an integer"),
    ],
)
def test_estimate_refuses_bad_settings_by_name(kwargs, message):
    """A decay outside (0, 1] or a subwindow count that is not a count >= 1 is refused before any work."""
    w = LoadWindow(1, 1, 4)
    _feed(w, [[[v]] for v in (1, 2)])
    with pytest.raises(ValueError, match=message):
        w.estimate(**kwargs)


def test_subwindow_max_scales_parts_of_unequal_length_to_the_window():
    """With parts of 3, 3, 2 and 2 passes, a steady slot estimates its plain sum and a burst its part's mean."""
    steady = LoadWindow(1, 1, 10)
    _feed(steady, [[[1]]] * 10)
    assert steady.estimate("subwindow_max").item() == pytest.approx(10.0)
    scores = []
    for start in (0, 8):  # a 2-pass burst in the oldest (3-pass) part, then as the newest (2-pass) part
        w = LoadWindow(1, 1, 10)
        _feed(w, [[[6 if start <= i < start + 2 else 0]] for i in range(10)])
        scores.append(w.estimate("subwindow_max").item())
    assert scores[0] == pytest.approx(12 * 10 / 3) and scores[1] == pytest.approx(12 * 10 / 2)


def test_estimates_stay_on_the_windows_device():
    """Every estimator answers on the window's own device (here meta), also for an empty or one-pass window."""
    w = LoadWindow(2, 3, 4, device="meta")
    for filled in (0, 1, 4):
        w.filled = filled  # a meta tensor holds no passes to record; only the shapes and devices are checked
        for name in ("window_sum", "decayed_sum", "subwindow_max"):
            out = w.estimate(name)
            assert out.device.type == "meta" and tuple(out.shape) == (2, 3)


def test_remap_layer_carries_an_open_pass_and_leaves_a_recorded_one():
    """While pass_open, load_pass's counts of the layer move to the new placement (expert totals kept); after
    record_pass the (zeroed) pass is left alone."""
    old, new = np.array([0, 1, 2, 3, 1, 1]), np.array([0, 2, 1, 3, 3, 2])
    w = LoadWindow(2, 6, 3)
    w.load_pass.copy_(torch.tensor([[5, 4, 3, 2, 6, 1], [1, 1, 1, 1, 1, 1]]))
    w.pass_open = True
    w.remap_layer(0, old, new, 4)
    layer0 = aggregate_logical(w.load_pass[:1], torch.as_tensor(new[None]), 4)
    assert layer0.tolist() == [[5, 11, 3, 2]] and w.load_pass[1].tolist() == [1] * 6
    w.record_pass()
    assert not w.pass_open
    plan = RemapPlan.of(new, old, 4)
    assert w.remapped_pass(0, plan, 4) is None


def test_estimate_of_empty_window_is_zero():
    """Before any counted pass the estimate is all zeros, not an error."""
    assert LoadWindow(2, 3, 5).estimate("subwindow_max").sum().item() == 0


@pytest.mark.parametrize(
    "phy2log, num_logical, message",
    [
        (torch.tensor([[0.0, 1.0, 0.5, 1.0]]), 2, "phy2log must hold integers"),
        (torch.tensor([[0, 1, 5, 1]]), 2, r"entries must be in \[-1, 2\)"),
        (torch.tensor([[0, 1, -2, 1]]), 2, r"entries must be in \[-1, 2\)"),
        (torch.tensor([[0, 1, 0, 1]]), 0, "num_logical must be >= 1"),
    ],
)
def test_aggregate_logical_refuses_maps_it_would_misread(phy2log, num_logical, message):
    """A float map (cast would truncate), an expert id outside [-1, N) or N < 1 is a ValueError, not a silent sum."""
    with pytest.raises(ValueError, match=message):
        aggregate_logical(torch.ones(1, 4), phy2log, num_logical)


def test_aggregate_logical_sums_replicas_and_skips_empty_slots():
    """Per-slot loads scatter to their experts; empty slots (-1) add nothing."""
    physical = torch.tensor([[5, 1, 2, 7]])
    assert aggregate_logical(physical, torch.tensor([[0, 1, 0, -1]]), 2).tolist() == [[7, 1]]
    with pytest.raises(ValueError, match="does not match"):
        aggregate_logical(physical, torch.tensor([[0, 1]]), 2)


@pytest.mark.parametrize(
    "physical, phy2log, message",
    [
        (torch.ones(1, 4), np.array([[0, 1, 2**64 - 1, 1]], dtype=np.uint64), r"phy2log\[0, 2\]"),
        (np.ones((1, 4)), torch.tensor([[0, 1, 0, 1]]), "physical must be a torch.Tensor"),
        ([[1, 1, 1, 1]], torch.tensor([[0, 1, 0, 1]]), "physical must be a torch.Tensor"),
        (torch.ones(4), torch.tensor([0, 1, 0, 1]), r"2-D \(L, P\) tensor of real numbers"),
        (torch.ones(1, 4, dtype=torch.bool), torch.tensor([[0, 1, 0, 1]]), "dtype torch.bool"),
        (torch.empty(1, 4, device="meta"), torch.tensor([[0, 1, 0, 1]]), "got a meta tensor"),
        (torch.ones(1, 4), torch.empty(1, 4, dtype=torch.int64, device="meta"), "phy2log must hold data"),
        (torch.full((1, 4), 100, dtype=torch.int8), torch.tensor([[0, 1, 0, 1]]), "overflow its dtype torch.int8"),
    ],
)
def test_aggregate_logical_refuses_input_it_would_misread(physical, phy2log, message):
    """A wrapping uint64 map, a load that is no 2-D tensor of numbers, meta tensors, an int8 sum past 127: refused."""
    with pytest.raises(ValueError, match=message):
        aggregate_logical(physical, phy2log, 2)


def test_aggregate_logical_keeps_a_narrow_integer_dtype_when_the_sums_fit():
    """int8 loads whose expert sums fit come back as int8, summed exactly."""
    out = aggregate_logical(torch.tensor([[60, 1, 60, 3]], dtype=torch.int8), torch.tensor([[0, 1, 0, 1]]), 2)
    assert out.dtype == torch.int8 and out.tolist() == [[120, 4]]


@pytest.mark.parametrize(
    "layer, old_row, new_row, message",
    [
        (0, np.arange(5) % 4, np.arange(6) % 4, "one length, got 5 and 6"),
        (0, np.arange(5) % 4, np.arange(5) % 4, "new_row must have 6 slots"),
        (-1, np.arange(6) % 4, np.arange(6) % 4, "layer must be >= 0"),
        (2, np.arange(6) % 4, np.arange(6) % 4, r"layer must be in \[0, 2\)"),
        (0, np.arange(6) % 4, [0, 1, 2, 3, 4, 0], r"new_row\[4\] = 4 is outside \[-1, 4\)"),
        (0, np.arange(6) % 4, [[0, 1, 2, 3, 0, 1]], r"new_row must be one row \(P,\)"),
        (0, np.arange(6) % 4, [0.0, 1, 2, 3, 0, 1], "new_row"),
    ],
)
def test_remap_layer_refuses_bad_arguments_and_changes_nothing(layer, old_row, new_row, message):
    """Rows of another length, a layer outside [0, L), an expert id >= N: a ValueError naming it; no count moves."""
    w = LoadWindow(2, 6, 4)
    w.load_pass += 3
    w.record_pass()
    before = w.window.clone()
    with pytest.raises(ValueError, match=message):
        w.remap_layer(layer, old_row, new_row, 4)
    assert torch.equal(w.window, before)


@pytest.mark.parametrize("flag", ["yes", None, 1, 0.0])
def test_record_pass_refuses_a_dummy_flag_that_is_no_bool(flag):
    """record_pass("yes") or (None) is a ValueError, as controller.step's is, not a pass dropped or kept by truth."""
    w = LoadWindow(1, 3, 4)
    w.load_pass += 1
    with pytest.raises(ValueError, match="is_dummy must be a bool"):
        w.record_pass(flag)
    assert w.filled == 0 and w.load_pass.tolist() == [[1, 1, 1]]
    w.record_pass(np.bool_(False))
    assert w.filled == 1


def test_rank_loads_and_balancedness_reduce_over_ranks():
    """Balancedness is sum over layers of mean/max taken across ranks, not across layers."""
    physical = torch.tensor([[4, 4, 0, 0], [1, 1, 1, 1]])
    ranks = rank_loads_physical(physical, 2)
    assert ranks.tolist() == [[8, 0], [2, 2]]
    # layer 0: mean 4, max 8; layer 1: mean 2, max 2  -> (4 + 2) / (8 + 2)
    assert balancedness(ranks) == pytest.approx(0.6)
    assert balancedness(torch.zeros(3, 2)) == 1.0
    with pytest.raises(ValueError, match="divisible"):
        rank_loads_physical(physical, 3)


def test_balancedness_takes_one_layer_or_many_as_numpy_torch_or_lists():
    """(G,) is one layer; (L, G) sums means and maxima over layers; the input kind does not matter."""
    assert balancedness([3.0, 1.0]) == pytest.approx(2 / 3)  # mean 2 / max 3
    loads = np.array([[8.0, 0.0], [2.0, 2.0]])
    assert balancedness(loads) == balancedness(torch.from_numpy(loads)) == balancedness(loads.tolist())
    assert balancedness(np.zeros(4)) == 1.0
    # two models on the same ranks: their layers concatenated
    assert balancedness(np.concatenate([loads[:1], loads[1:]])) == pytest.approx(0.6)


@pytest.mark.parametrize("bad", [np.zeros((2, 2, 2)), np.zeros((3, 0)), 5.0])
def test_balancedness_rejects_other_shapes(bad):
    """Anything but (G,) or (L, G) with G >= 1 is a ValueError naming rank_loads."""
    with pytest.raises(ValueError, match="rank_loads"):
        balancedness(bad)


def test_placement_and_rank_load_balancedness_agree():
    """policy.bounds scores a placement through stats.balancedness: same value on its rank loads."""
    from eplb_fsm.policy.bounds import placement_balancedness, rank_loads

    rng = np.random.default_rng(0)
    phy2log = np.array([rng.permutation(8) for _ in range(3)])
    weight = rng.random((3, 8))
    assert placement_balancedness(phy2log, weight, 4) == balancedness(rank_loads(phy2log, weight, 4))


@pytest.mark.parametrize("name", ["num_layers", "num_physical", "window_size"])
def test_bad_shapes_rejected(name):
    """A zero dimension is rejected with the parameter's name."""
    kwargs = {"num_layers": 1, "num_physical": 1, "window_size": 1, name: 0}
    with pytest.raises(ValueError, match=name):
        LoadWindow(**kwargs)


@pytest.mark.parametrize("name", ["num_layers", "num_physical", "window_size"])
@pytest.mark.parametrize("value", [2.5, 2.0, "2", True])
def test_non_integer_shapes_rejected(name, value):
    """A size that is not an integer is refused by name before any tensor is made."""
    kwargs = {"num_layers": 1, "num_physical": 1, "window_size": 1, name: value}
    with pytest.raises(ValueError, match=f"{name} must be an integer"):
        LoadWindow(**kwargs)


@given(
    st.integers(1, 5),
    st.lists(st.integers(0, 3), min_size=6, max_size=6),
    st.lists(st.integers(0, 3), min_size=6, max_size=6),
    st.integers(0, 2**31 - 1),
)
def test_remap_layer_preserves_expert_totals(passes, old_extra, new_extra, seed):
    """Re-expressing a layer's window in a new placement keeps every expert's total per pass."""
    n = 4
    old = np.array(list(range(n)) + old_extra[:2], dtype=np.int64)
    new = np.array(list(range(n)) + new_extra[:2], dtype=np.int64)
    rng = np.random.default_rng(seed)
    new = rng.permutation(new)
    w = LoadWindow(2, 6, 5)
    for _ in range(passes):
        w.load_pass.copy_(torch.as_tensor(rng.integers(0, 50, size=(2, 6))))
        w.record_pass()
    other_layer = w.window[:, 1].clone()
    before = aggregate_logical(w.window[:, 0], torch.as_tensor(np.tile(old, (5, 1))), n)
    w.remap_layer(0, old, new, n)
    after = aggregate_logical(w.window[:, 0], torch.as_tensor(np.tile(new, (5, 1))), n)
    assert torch.equal(before, after)
    assert torch.equal(w.window[:, 1], other_layer)
    assert (w.window >= 0).all()


def test_remap_plan_built_ahead_gives_what_remap_layer_writes_and_changes_nothing():
    """RemapPlan.of(old, new).apply(counts) returns remap_layer's result and leaves its input as it was."""
    from eplb_fsm.stats import LoadWindow, RemapPlan

    rng = np.random.default_rng(3)
    old_row = np.array([0, 1, 2, 3, 0, 1], dtype=np.int64)
    new_row = np.array([3, 3, 2, 1, 0, -1], dtype=np.int64)
    win = LoadWindow(num_layers=2, num_physical=6, window_size=3)
    win.window[:] = torch.as_tensor(rng.integers(0, 50, size=(3, 2, 6)))
    counts = win.window[:, 1, :].clone()
    got = RemapPlan.of(old_row, new_row, 4).apply(win.window[:, 1, :], 4)
    assert torch.equal(win.window[:, 1, :], counts)
    win.remap_layer(1, old_row, new_row, 4)
    assert torch.equal(got, win.window[:, 1, :])
    # every expert keeps its total
    before = torch.zeros((3, 4), dtype=torch.int64).index_add_(1, torch.as_tensor(old_row), counts)
    after = torch.zeros((3, 4), dtype=torch.int64).index_add_(1, torch.as_tensor(new_row.clip(0)), got)
    assert torch.equal(before, after)


def _remap_by_definition(counts: np.ndarray, old: np.ndarray, new: np.ndarray, n: int) -> np.ndarray:
    """The remap spelled out: each expert's pass count over its old slots, split over its new
    slots (count // replicas each, the remainder to the first), 0 in an empty slot."""
    logical = np.zeros((counts.shape[0], n), dtype=np.int64)
    for slot, expert in enumerate(old):
        if expert >= 0:
            logical[:, expert] += counts[:, slot]
    out = np.zeros_like(counts)
    for expert in range(n):
        slots = np.flatnonzero(new == expert)
        if slots.size == 0:
            if logical[:, expert].any():
                raise ValueError("dropped")
            continue
        out[:, slots] = (logical[:, expert] // slots.size)[:, None]
        out[:, slots[0]] += logical[:, expert] % slots.size
    return out


@given(st.integers(1, 6), st.integers(1, 7), st.integers(0, 5), st.integers(0, 2**31 - 1), st.booleans())
def test_remap_plan_matches_its_definition_bit_for_bit(passes, n, spare, seed, negative):
    """Over random rows with empty slots, replicas and absent experts, apply gives the definition's counts exactly."""
    from eplb_fsm.stats import RemapPlan

    rng = np.random.default_rng(seed)
    p = n + spare

    def row(empty_ok: bool) -> np.ndarray:
        r = np.concatenate([rng.permutation(n), rng.integers(-1 if empty_ok else 0, n, spare)])
        if empty_ok and rng.random() < 0.3:
            r[rng.integers(0, p)] = -1        # may leave an expert with no slot
        return rng.permutation(r)

    old, new = row(True), row(True)
    low = -(2**40) if negative else 0
    window = torch.as_tensor(rng.integers(low, 2**40, size=(passes, 3, p)))
    counts = window[:, 1, :]                  # a strided layer of a (W, L, P) window, as the controller's
    before = counts.clone()
    plan = RemapPlan.of(old, new, n)
    try:
        want = _remap_by_definition(counts.numpy().copy(), old, new, n)
    except ValueError:
        with pytest.raises(ValueError, match="drops an expert"):
            plan.apply(counts, n)
        return
    got = plan.apply(counts, n)
    assert got.shape == (passes, p) and got.dtype == torch.int64
    assert np.array_equal(got.numpy(), want)
    assert torch.equal(counts, before)


@pytest.mark.parametrize("bad", [[np.nan, 1.0], [1.0, np.inf], [[1.0, 2.0], [-1.0, 3.0]]])
def test_balancedness_refuses_nan_infinite_and_negative_loads(bad):
    """A NaN, infinite or negative rank load is a ValueError naming rank_loads (NaN scored a perfect 1.0 before)."""
    with pytest.raises(ValueError, match="rank_loads must hold finite loads >= 0"):
        balancedness(bad)


@pytest.mark.parametrize("loads, reason", [([1.0, 0.0], None), ([], None), ([np.nan, -1.0], "NaN in the load"),
                                           ([1.0, -np.inf], "infinite load"), ([np.inf], "infinite load"),
                                           ([[2.0], [-3.0]], "negative load (min -3.0)")])
def test_load_fault_names_the_first_rule_broken(loads, reason):
    """load_fault: None for finite loads >= 0 (numpy or torch), else NaN, then infinite, then negative."""
    assert load_fault(np.array(loads)) == reason
    assert load_fault(torch.tensor(loads, dtype=torch.float64)) == reason


@pytest.mark.parametrize("loads, scaled", [([[1e308, 1e308]], 1.0), ([[1e308, 0.0], [1e308, 0.0]], 0.5),
                                            ([1e308, 1e308, 1e308], 1.0)])
def test_balancedness_refuses_loads_whose_total_overflows_float64(loads, scaled):
    """Finite rank loads that sum past float64 raise ValueError naming rank_loads (inf or 0.0 came back before)."""
    with pytest.raises(ValueError, match=r"^rank_loads: .* must sum to a finite float64"):
        balancedness(loads)
    assert balancedness(np.array(loads) / 1e10) == scaled  # the same loads scaled down are scored as before


@pytest.mark.parametrize("loads", [["1", "2"], [True, False], np.array([1 + 0j, 2]), np.array([None, 1.0])])
def test_balancedness_refuses_strings_bools_and_complex_loads(loads):
    """Only real numbers are loads: strings, bools, complex or object arrays are a ValueError naming rank_loads."""
    with pytest.raises(ValueError, match=r"^rank_loads must hold real numbers \(not bools\), got dtype"):
        balancedness(loads)


def test_checked_loads64_gives_float64_of_any_real_dtype_and_names_the_argument():
    """Integer, float32 and torch loads come back as float64 copies; a bad one names the given argument."""
    assert checked_loads64(np.array([[1, 2]], np.int32), "x").dtype == np.float64
    assert checked_loads64(torch.tensor([0.5], dtype=torch.bfloat16), "x").tolist() == [0.5]
    with pytest.raises(ValueError, match="^weight must hold finite loads >= 0, got negative load"):
        checked_loads64([-1.0], "weight")


def test_estimate_takes_a_numpy_float_decay_as_the_config_does():
    """np.float32(0.9), which EplbConfig.load_decay accepts, weighs passes as float(np.float32(0.9)) does."""
    w = LoadWindow(1, 2, 4)
    _feed(w, [[[1, 2]], [[3, 4]], [[5, 6]]])
    got = w.estimate("decayed_sum", np.float32(0.9))
    assert torch.equal(got, w.estimate("decayed_sum", float(np.float32(0.9))))
    assert torch.equal(w.estimate("decayed_sum", np.float64(1.0)), w.estimate("window_sum"))


@pytest.mark.parametrize("decay", [10**400, np.float32(1.5), True, "0.9", float("nan")])
def test_estimate_refuses_a_decay_outside_the_rule_by_name(decay):
    """A bool, a string, NaN, 10**400 (OverflowError in float()) or a value past 1 is a ValueError naming decay."""
    w = LoadWindow(1, 1, 2)
    with pytest.raises(ValueError, match=r"^decay must be a number in \(0, 1\]"):
        w.estimate("decayed_sum", decay)


@pytest.mark.parametrize("world_size", [2.0, True, "2", None])
def test_rank_loads_physical_refuses_a_world_size_that_is_no_integer(world_size):
    """2.0 (a torch TypeError before) and True (read as 1 before) are a ValueError naming world_size."""
    with pytest.raises(ValueError, match="^world_size must be an integer"):
        rank_loads_physical(torch.ones(1, 4), world_size)
    assert rank_loads_physical(torch.ones(1, 4), np.int64(2)).tolist() == [[2.0, 2.0]]
