"""The executor's buffer (transfer/buffer.py): its parts, and rearrangements over a two-layer buffer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eplb_fsm.transfer import InProcessCommunicator, TransferBuffer, TransferError, rearrange_expert_weights_inplace
from test_transfer_execute import SPECS, check_world, expected_messages, make_world, placements


@pytest.mark.parametrize("layers", [0, 3, True, 2.0, "2"])
def test_layers_must_be_one_or_two(layers):
    """Any other number of layers is refused, naming the field."""
    with pytest.raises(ValueError, match="layers: must be 1 or 2"):
        TransferBuffer(layers=layers)


def test_parts_are_separate_and_reused():
    """Each part has its own tensors, allocated once per layout; a part beyond the buffer's is refused."""
    buf = TransferBuffer(layers=2)
    w = [torch.zeros(4, 3), torch.zeros(4, dtype=torch.int8)]
    a, b = buf.ensure(0, w, 0), buf.ensure(0, w, 1)
    assert a[0].data_ptr() != b[0].data_ptr() and buf.allocations == 2
    assert buf.ensure(0, w, 1) is b and buf.tensors(0, 1) is b and buf.allocations == 2
    assert buf.nbytes == 2 * (4 * 3 * 4 + 4)
    with pytest.raises(ValueError, match=r"part: must be in \[0, 2\)"):
        buf.ensure(0, w, 2)
    with pytest.raises(ValueError, match=r"part: must be in \[0, 1\)"):
        TransferBuffer().ensure(0, w, 1)


def test_profile_reserves_both_parts():
    """Profile mode with a two-layer buffer reserves two layers of rows per rank and moves nothing."""
    old = np.array([[0, 1, 2, 3], [3, 2, 1, 0]])
    weights, _ = make_world(old, 2)
    buf = TransferBuffer(layers=2)
    rearrange_expert_weights_inplace(old, old[::-1], weights, communicator=InProcessCommunicator(2), is_profile=True, buffer=buf)
    assert buf.allocations == 4
    assert buf.nbytes == 2 * sum(w.numel() * w.element_size() for rw in weights for w in rw[0])


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(placements(), st.booleans())
def test_random_rearrangements_bit_exact_over_two_layers(case, batching):
    """Random placements over a two-layer buffer: every slot ends with its expert's exact bytes; no message is extra."""
    old, new, g = case
    weights, tables = make_world(old, g)
    comm = InProcessCommunicator(g)
    rearrange_expert_weights_inplace(
        torch.from_numpy(old), torch.from_numpy(new), weights, communicator=comm,
        migration_batching=batching, buffer=TransferBuffer(layers=2),
    )
    check_world(weights, tables, old, new, g)
    assert comm.total_messages == expected_messages(old, new, g, len(SPECS))


class _Starts(InProcessCommunicator):
    """Counts start() calls and fails on the n-th one (a timeout stand-in), if asked."""

    def __init__(self, g, fail_at=-1):
        super().__init__(g)
        self.fail_at = fail_at
        self.starts = 0

    def start(self):
        self.starts += 1
        if self.starts - 1 == self.fail_at:
            raise RuntimeError("simulated timeout")
        super().start()


def test_two_layers_hold_no_receive():
    """Every row crosses ranks in every layer: one buffer posts layers after the first in two starts, two buffers in one."""
    old = np.array([[0, 1, 2, 3]] * 3)
    new = np.array([[2, 3, 0, 1]] * 3)
    for layers, starts in ((1, 1 + 2 * 2), (2, 3)):
        weights, tables = make_world(old, 2)
        comm = _Starts(2)
        rearrange_expert_weights_inplace(old, new, weights, communicator=comm, buffer=TransferBuffer(layers=layers))
        check_world(weights, tables, old, new, 2)
        assert comm.starts == starts


def test_failure_over_two_layers_keeps_committed_layers_new_and_the_rest_old():
    """A failing layer over a two-layer buffer raises TransferError: earlier layers are new, it and later ones old."""
    old = np.array([[0, 1, 2, 3]] * 3)
    new = np.array([[2, 3, 0, 1]] * 3)
    for fail_at in (1, 2):
        weights, tables = make_world(old, 2)
        with pytest.raises(TransferError) as info:
            rearrange_expert_weights_inplace(old, new, weights, communicator=_Starts(2, fail_at),
                                             buffer=TransferBuffer(layers=2))
        assert info.value.layer == fail_at and info.value.committed_layers == fail_at
        check_world(weights, tables, old, np.concatenate([new[:fail_at], old[fail_at:]]), 2)
