"""The engine of ``bench stall``: a protocol-following model with checkable rows, and a fixed step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eplb_fsm.bench.stall_engine import EngineStep, HeavyMoE, expert_value, skewed_load
from eplb_fsm.fsm.model_protocol import validate_model
from eplb_fsm.maps import ExpertMaps


def _model(rank: int = 1) -> HeavyMoE:
    return HeavyMoE(num_layers=2, num_experts=6, num_redundant=2, hidden=5, rank=rank, world_size=2)


def test_model_follows_the_moe_protocol():
    """validate_model accepts it for its world size: S = P / G rows per tensor."""
    shape = validate_model(_model(), world_size=2, config_redundant=2)
    assert shape["num_local_physical_experts"] == 4 and shape["num_physical_experts"] == 8


def test_model_refuses_slots_that_do_not_split_over_ranks():
    """P not divisible by G is an error naming both numbers."""
    with pytest.raises(ValueError, match=r"\(7\) must be divisible by the world size \(2\)"):
        HeavyMoE(num_layers=1, num_experts=6, num_redundant=1, hidden=4, rank=0, world_size=2)


def test_weights_match_their_placement_and_catch_one_wrong_row():
    """Loaded rows hold their expert's value; one changed entry or another placement is caught."""
    model = _model()
    placement = ExpertMaps.initial(2, 6, 8).phy2log
    model.load_weights(placement)
    assert model.weights_match(placement)
    # rank 1 holds slots 4..7: slot 4 is expert 4, so layer 0 tensor 1 row 0 holds expert_value(0, 4, 1)
    assert bool((model.expert_weights[0][1][0] == expert_value(0, 4, 1)).all())
    other = placement.copy()
    other[1, 5], other[1, 6] = other[1, 6], other[1, 5]
    assert not model.weights_match(other)
    model.expert_weights[1][0][3, 2] += 1.0
    assert not model.weights_match(placement)


def test_skewed_load_is_fixed_by_the_seed_and_skewed():
    """Same seed, same (L, N) load; the heaviest expert takes several times the mean."""
    a, b = skewed_load(3, 4, 16, 4096), skewed_load(3, 4, 16, 4096)
    assert a.shape == (4, 16) and a.dtype == np.int64 and np.array_equal(a, b)
    assert (a.max(axis=1) > 3 * a.mean(axis=1)).all()
    assert not np.array_equal(a, skewed_load(4, 4, 16, 4096))


def test_engine_step_records_every_token_on_the_replicas_of_its_expert():
    """A step adds each expert's tokens to its slots (split over replicas), and nothing elsewhere."""
    model = _model()
    maps = ExpertMaps.initial(2, 6, 8)   # experts 0 and 1 have two replicas (slots 6, 7)
    load_pass = torch.zeros(2, 8, dtype=torch.int64)
    model.set_eplb_state(load_pass, torch.from_numpy(maps.log2phy.copy()), torch.from_numpy(maps.replica_count.copy()))
    load = np.array([[7, 4, 1, 0, 2, 3], [1, 1, 1, 1, 1, 1]], dtype=np.int64)
    EngineStep(model, load, matmul=16)()   # no process group: no all-reduce
    got = load_pass.numpy()
    np.testing.assert_array_equal(got[0], [4, 2, 1, 0, 2, 3, 3, 2])
    np.testing.assert_array_equal(got[1], [1, 1, 1, 1, 1, 1, 0, 0])
    # per expert, the replicas' counts add up to its tokens
    for layer in range(2):
        per_expert = np.bincount(maps.phy2log[layer], weights=got[layer], minlength=6)
        np.testing.assert_array_equal(per_expert, load[layer])


def test_device_engine_waits_instead_of_computing_and_records_the_same_load():
    """engine='device': the step sleeps the matmul's measured median (CPU idle) and records the same load."""

    loads = []
    for engine in ("matmul", "device"):
        model = _model()
        maps = ExpertMaps.initial(2, 6, 8)
        load_pass = torch.zeros(2, 8, dtype=torch.int64)
        model.set_eplb_state(load_pass, torch.from_numpy(maps.log2phy.copy()),
                             torch.from_numpy(maps.replica_count.copy()))
        step = EngineStep(model, np.array([[7, 4, 1, 0, 2, 3], [1, 1, 1, 1, 1, 1]]), matmul=64, engine=engine)
        step()
        loads.append(load_pass.numpy().copy())
        if engine == "device":
            assert step.device_s > 0 and step.out.shape == (64, 64)
    np.testing.assert_array_equal(loads[0], loads[1])
    with pytest.raises(ValueError, match="engine must be one of matmul, device"):
        EngineStep(_model(), np.zeros((2, 6), dtype=np.int64), matmul=16, engine="gpu")


def test_device_engine_takes_a_given_wait_so_every_run_steps_alike():
    """device_s given: the device engine waits exactly that (no new measurement); a negative one is refused."""
    from eplb_fsm.bench.stall_engine import device_step_s

    assert device_step_s(32) > 0
    step = EngineStep(_model(), np.zeros((2, 6), dtype=np.int64), matmul=32, engine="device", device_s=0.0015)
    assert step.device_s == 0.0015
    with pytest.raises(ValueError, match="device_s must be >= 0"):
        EngineStep(_model(), np.zeros((2, 6), dtype=np.int64), matmul=32, engine="device", device_s=-1.0)
