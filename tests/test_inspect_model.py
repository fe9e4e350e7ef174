"""The replay's model: the machine as an oracle, and the comparable forms of collectives and transitions."""

from __future__ import annotations

import pytest

from eplb_fsm.inspect.model import Collective, MachineOracle, Transition


@pytest.mark.parametrize("state, trigger, data", [
    ("planning", "plan_ready", {"moves": None, "worth": True}),
    ("transferring", "layer_done", {"layer": [0]}),
])
def test_wrong_typed_event_data_is_a_refusal_not_a_crash(state, trigger, data):
    """A datum of the wrong type (moves null, layer a list) is the machine refusing the event, with why."""
    out = MachineOracle().outcome(state, 0, 2, False, trigger, data)
    assert isinstance(out, str) and "event data of the wrong type" in out


def test_signature_of_a_damaged_collective_is_hashable_and_compares_by_value():
    """A list as op, layer or wave still gives a signature to count and compare; it differs from the clean one."""
    def coll(op, layer, wave):
        return Collective(op, "ep", 0, [16], "torch.float64", 9, "transferring", layer, 3, wave)

    damaged = coll(["all_reduce"], [1], {"w": 0})
    assert hash(damaged.signature()) == hash(coll(["all_reduce"], [1], {"w": 0}).signature())
    assert damaged.signature() != coll("all_reduce", 1, 0).signature()


def test_transition_key_with_a_list_as_source_is_hashable():
    """A transition whose source is a list keys like any other, and unlike the clean one."""
    damaged = Transition(9, "plan_ready", ["planning"], "transferring", [0], 4)
    assert hash(damaged.key()) and damaged.key() != Transition(9, "plan_ready", "planning", "transferring", 0, 4).key()


def test_the_memo_keeps_data_of_different_types_apart():
    """1, True and 1.0 hash alike: the memo still answers each by its own type (a refusal for the wrong ones)."""
    oracle = MachineOracle()
    assert isinstance(oracle.outcome("collecting", 0, 2, False, "step", {"due": 1}), str)
    assert oracle.outcome("collecting", 0, 2, False, "step", {"due": True}) == ("planning", 0, False)
    assert oracle.outcome("transferring", 0, 2, False, "layer_done", {"layer": 0}) == ("transferring", 1, False)
    for wrong in (0.0, False):
        assert "wrong type" in oracle.outcome("transferring", 0, 2, False, "layer_done", {"layer": wrong})
