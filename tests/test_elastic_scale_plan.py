"""elastic/scale_plan.py: make_scale_plan refuses a rank mapping that does not name exactly the old ranks.

The rest of the pure plan (slot columns, resized windows, lost experts) is covered in
tests/test_fsm_scaling.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from eplb_fsm.elastic import make_scale_plan


@pytest.mark.parametrize("old, new, mapping", [
    (2, 4, {0: 0, 1: 1, 2: 2}),        # an old rank 2 that does not exist
    (1, 2, {0: 0, 1: 1}),              # a same-size permute, not a scale-up with a joiner
    (3, 4, {0: 0, 1: 1}),              # old rank 2 missing
    (3, 2, {0: 0, 1: 1}),              # scale-down, old rank 2 missing
    (4, 2, {0: 0, 1: 1, 2: -1}),       # scale-down, old rank 3 missing
])
def test_mapping_keys_must_be_exactly_the_old_ranks(old, new, mapping):
    """An extra or a missing old rank is a ValueError naming rank_mapping, never a plan or a KeyError."""
    with pytest.raises(ValueError, match=r"rank_mapping must have exactly the old ranks 0\.\."):
        make_scale_plan(old, new, mapping)


@pytest.mark.parametrize("mapping", [[0, -1], "ab", 5, [(0, 0), (1, -1)]])
def test_a_mapping_that_is_not_a_dict_is_refused_naming_the_field(mapping):
    """A list, string or int rank_mapping gives a ValueError naming rank_mapping, not dict()'s own error."""
    with pytest.raises(ValueError, match="rank_mapping must be a dict"):
        make_scale_plan(2, 1, mapping)


def test_mapping_keys_and_values_must_be_integers():
    """A float or bool key or value is refused naming rank_mapping; numpy integers are taken as ints."""
    with pytest.raises(ValueError, match="rank_mapping value must be an integer"):
        make_scale_plan(2, 1, {0: 0, 1: -1.0})
    with pytest.raises(ValueError, match="rank_mapping key must be an integer"):
        make_scale_plan(2, 1, {False: 0, 1: -1})
    sp = make_scale_plan(2, 1, {np.int64(0): np.int64(0), np.int64(1): np.int64(-1)})
    assert sp.rank_mapping == {0: 0, 1: -1} and all(type(k) is int for k in sp.rank_mapping)


def test_generation_takes_numpy_integers_like_the_world_sizes():
    """generation=np.int64(3) is accepted (as the int 3) like np.int64 world sizes; a bool is not."""
    sp = make_scale_plan(np.int64(2), np.int64(1), generation=np.int64(3))
    assert sp.generation == 3 and type(sp.generation) is int
    with pytest.raises(ValueError, match="generation must be an integer"):
        make_scale_plan(2, 1, generation=True)
