"""Tests for eplb_fsm.fsm.model_protocol."""

import numpy as np
import pytest
import torch

from eplb_fsm.fsm.model_protocol import validate_model


class Shape:
    """A model carrying only the protocol's integer attributes (2 layers, 8 experts, 4 redundant, 2 ranks)."""

    def __init__(self, **changes):
        self.num_moe_layers, self.num_logical_experts, self.num_redundant_experts = 2, 8, 4
        self.num_physical_experts, self.num_local_physical_experts, self.num_expert_groups = 12, 6, 1
        self.expert_weights = [[torch.zeros(6, 2)] for _ in range(2)]
        self.__dict__.update(changes)

    def set_eplb_state(self, load_pass, log2phy, replica_count):
        pass


def test_numpy_integers_count_as_integers():
    """An attribute read from a numpy array (np.int64) is taken as the int it holds."""
    shape = validate_model(Shape(num_expert_groups=np.int64(2), num_moe_layers=np.int32(2)), world_size=2)
    assert shape["num_expert_groups"] == 2 and type(shape["num_expert_groups"]) is int


@pytest.mark.parametrize("value", [True, np.bool_(True), 2.0, "2"])
def test_a_bool_float_or_string_attribute_is_refused_naming_it(value):
    """A bool is not a count (True would pass as 1 group), nor is a float or string: refused naming the attribute."""
    with pytest.raises(ValueError, match="model.num_expert_groups must be an integer"):
        validate_model(Shape(num_expert_groups=value), world_size=2)
