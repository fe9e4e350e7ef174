"""fsm/model_entry.py: what add_model refuses before building an entry (shared weights, weights its group cannot
move, a wrong phy2log)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from eplb_fsm.fsm.model_entry import build_model_entry, check_weights_distinct
from eplb_fsm.sim.model import ToyMoE


def _toy(layers=2, seed=0, world=1, rank=0):
    return ToyMoE(num_layers=layers, num_experts=8, num_redundant=4, hidden=4, top_k=2,
                  rank=rank, world_size=world, seed=seed)


def _entry(model, name, world=1, phy2log=None, others=()):
    return build_model_entry(model, name, index=len(others), layer_offset=0, world_size=world, num_redundant=4,
                             window_size=4, device=torch.device("cpu"), phy2log=phy2log, others=others)


def test_the_same_model_twice_is_refused_naming_both_and_the_tensor():
    """A model whose weights are another entry's (the same object) names both models, layer 0 and tensor 0."""
    model = _toy()
    main = _entry(model, "main")
    with pytest.raises(ValueError, match=r"model 'drafter' expert_weights\[0\]\[0\] shares memory with "
                                         r"model 'main' expert_weights\[0\]\[0\]"):
        _entry(model, "drafter", others=[main])


def test_a_drafter_holding_a_view_of_the_main_weights_is_refused():
    """A drafter whose layer-1 bias is a row slice of the main model's layer-0 bias is refused at that tensor."""
    main_model, drafter = _toy(), _toy(seed=5)
    drafter.expert_weights[1][1] = main_model.expert_weights[0][1][:]  # same storage, same rows
    main = _entry(main_model, "main")
    with pytest.raises(ValueError, match=r"model 'drafter' expert_weights\[1\]\[1\] shares memory with "
                                         r"model 'main' expert_weights\[0\]\[1\]"):
        _entry(drafter, "drafter", others=[main])


def test_a_tensor_listed_in_two_layers_of_one_model_is_refused():
    """Within one model, two layers naming the same tensor would move it twice: refused, naming both layers."""
    model = _toy(layers=3)
    model.expert_weights[2] = list(model.expert_weights[0])
    with pytest.raises(ValueError, match=r"model 'main' expert_weights\[0\]\[0\] shares memory with "
                                         r"model 'main' expert_weights\[2\]\[0\]"):
        check_weights_distinct(model, "main", [])


def test_distinct_models_and_disjoint_views_of_one_buffer_are_accepted():
    """Two models with their own tensors, or disjoint row ranges of one buffer, pass the check."""
    main = _entry(_toy(), "main")
    drafter = _toy(seed=5)
    big = torch.zeros(2 * 12, 4, dtype=torch.float64)  # both layers' biases carved from one buffer
    drafter.expert_weights[0][1] = big[:12]
    drafter.expert_weights[1][1] = big[12:]
    entry = _entry(drafter, "drafter", others=[main])
    assert entry.name == "drafter"


def test_an_unmovable_layout_is_refused_at_add_time():
    """A weight whose last dimension of size 1 has stride != 1 (torch calls it contiguous) is refused by name."""
    model = _toy()
    col = torch.zeros(1, 12, dtype=torch.float64).t()  # (12, 1), strides (1, 12)
    assert col.is_contiguous()
    model.expert_weights[1][1] = col
    with pytest.raises(ValueError, match=r"model 'main': expert_weights\[1\]\[1\].*last dimension of size 1"):
        _entry(model, "main")


@pytest.mark.parametrize("shape", [(2, 8), (2, 16), (1, 12), (3, 12)])
def test_a_phy2log_that_does_not_match_the_weight_rows_is_refused(shape):
    """phy2log must be (L, S × G): the error names the field, the rule and both shapes."""
    model = _toy(world=2, rank=1)  # S = 6 rows per rank, G = 2: P = 12
    phy2log = np.arange(shape[0] * shape[1]).reshape(shape) % 8
    with pytest.raises(ValueError, match=r"phy2log: must have shape \(num_moe_layers, S × G\) = "
                                         r"\(2, 6 × 2 = 12\).*got shape \(" + f"{shape[0]}, {shape[1]}" + r"\)"):
        _entry(model, "main", world=2, phy2log=phy2log)


def test_a_matching_phy2log_is_taken_as_the_placement():
    """A (L, S × G) phy2log becomes the entry's maps unchanged."""
    phy2log = np.tile(np.array([7, 6, 5, 4, 3, 2, 1, 0, 0, 1, 2, 3]), (2, 1))
    entry = _entry(_toy(world=2), "main", world=2, phy2log=phy2log)
    assert np.array_equal(entry.maps.phy2log, phy2log)


def test_weights_off_the_cpu_are_refused_when_the_transfer_group_is_gloo():
    """With a host-memory-only (gloo) communicator, a layer on another device is refused naming the model and tensor."""
    model = _toy()
    model.expert_weights[1] = [t.to("meta") for t in model.expert_weights[1]]
    gloo = SimpleNamespace(host_memory_only=True, backend="gloo")
    with pytest.raises(ValueError, match=r"model 'main': expert_weights\[1\]\[0\]: is on meta, and the transfer "
                                         r"group \(gloo\) moves CPU tensors only"):
        build_model_entry(model, "main", index=0, layer_offset=0, world_size=1, num_redundant=4, window_size=4,
                          device=torch.device("cpu"), communicator=gloo)
    entry = build_model_entry(_toy(), "main", index=0, layer_offset=0, world_size=1, num_redundant=4, window_size=4,
                              device=torch.device("cpu"), communicator=gloo)
    assert entry.num_layers == 2
