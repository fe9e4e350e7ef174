"""Rows as bytes and copy runs (transfer/messages.py): what every message and commit is made of."""

from __future__ import annotations

import pytest
import torch

from eplb_fsm.transfer.messages import copy_runs, row_views


def test_row_views_are_byte_views_of_each_row():
    """row_views gives, per rank and tensor, row i as flat uint8 bytes aliasing that row."""
    weights = {3: [torch.zeros(3, 2, dtype=torch.float32), torch.zeros(3, dtype=torch.bfloat16)]}
    views = row_views(weights, for_recv=True)
    assert list(views) == [3] and [len(v) for v in views[3]] == [3, 3]
    row = views[3][0][1]
    assert row.dtype == torch.uint8 and row.numel() == 8
    row.copy_(torch.tensor([4.0, 5.0]).view(torch.uint8))
    views[3][1][2].copy_(torch.tensor([6.0], dtype=torch.bfloat16).view(torch.uint8))
    assert weights[3][0].tolist() == [[0, 0], [4, 5], [0, 0]] and weights[3][1].tolist() == [0, 0, 6]


def test_row_views_of_a_non_contiguous_tensor_copy_for_sends():
    """A transposed (non-contiguous) tensor's rows are still readable as bytes for sending."""
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3).t()  # (3, 2), rows interleave in memory
    views = row_views({0: [t]}, for_recv=False)
    assert torch.equal(views[0][0][2].view(torch.float32), t[2])


def test_copy_runs_copies_runs_of_rows_per_tensor():
    """copy_runs((dst, src, n), ...) copies n consecutive rows of every tensor pair."""
    src = [torch.arange(12.0).reshape(6, 2), torch.arange(6)]
    dst = [torch.zeros(6, 2), torch.zeros(6, dtype=torch.int64)]
    copy_runs(dst, src, ((0, 3, 2), (5, 0, 1)))
    assert dst[1].tolist() == [3, 4, 0, 0, 0, 0]
    assert dst[0][5].tolist() == [0.0, 1.0] and dst[0][1].tolist() == [8.0, 9.0] and dst[0][2:5].abs().sum() == 0


def test_rows_of_a_tensor_with_no_elements_are_empty_bytes_whatever_its_strides():
    """A (S, 0) tensor with a non-unit last stride (torch.empty(0, S).t()) gives S empty uint8 rows, not a crash."""
    t = torch.empty(0, 3).t()  # (3, 0), strides (1, 3)
    for for_recv in (False, True):
        rows = row_views({0: [t]}, for_recv)[0][0]
        assert [(r.dtype, r.numel()) for r in (rows[0], rows[1], rows[2])] == [(torch.uint8, 0)] * 3


def test_zero_element_weights_with_non_unit_strides_move_across_ranks():
    """Weights with a (S, 0) strided tensor beside a real one rearrange exactly, in-rank and across ranks."""
    from eplb_fsm.transfer import InProcessCommunicator, TransferBuffer, rearrange_expert_weights_inplace

    old, new = [[0, 1, 2, 3], [0, 1, 2, 3]], [[1, 0, 3, 2], [2, 3, 0, 1]]  # layer 0 in-rank, layer 1 across
    w = [[[torch.tensor([[2.0 * r], [2.0 * r + 1]]), torch.empty(0, 2).t()] for _ in range(2)] for r in range(2)]
    rearrange_expert_weights_inplace(old, new, w, communicator=InProcessCommunicator(2), buffer=TransferBuffer())
    for k in range(2):
        assert [w[r][k][0].flatten().tolist() for r in range(2)] == [new[k][:2], new[k][2:]]


def test_a_held_commit_that_raises_is_not_a_failure_of_the_wave():
    """HeldReceives' commit raising inside run_layer propagates as itself (no TransferError); held receives stay out."""
    from eplb_fsm.transfer import InProcessCommunicator, TransferError
    from eplb_fsm.transfer.messages import HeldReceives, run_layer
    from eplb_fsm.transfer.schedule import prepare_maps

    prep = prepare_maps([0, 1, 2, 3], [2, 3, 0, 1], 2, None, 1, (0, 1), False)[2].layer(0)
    weights = {r: [torch.arange(2.0)[:, None] + 2 * r] for r in range(2)}
    buffers = {r: [torch.full((2, 1), -1.0)] for r in range(2)}

    def commit():
        raise RuntimeError("injected commit failure")

    hold = HeldReceives({0: {1}, 1: {1}}, commit)
    comm = InProcessCommunicator(2)
    with pytest.raises(RuntimeError, match="injected commit failure") as info:
        run_layer(prep, weights, buffers, comm, [], hold=hold)
    assert not isinstance(info.value, TransferError) and hold.done
    assert [buffers[r][0][1].item() for r in range(2)] == [-1.0, -1.0]  # the held rows were never received into


def test_rows_of_a_one_row_vector_with_a_non_unit_stride_are_its_bytes():
    """A (1,) tensor of stride 8 (column 0 of a (1, 8) matrix, which torch calls contiguous) gives its row's bytes."""
    m = torch.arange(8, dtype=torch.float64).reshape(1, 8) + 3
    t = m[:, 0]
    assert t.is_contiguous() and t.stride() == (8,)
    for for_recv in (False, True):
        row = row_views({0: [t]}, for_recv)[0][0][0]
        assert row.dtype == torch.uint8 and torch.equal(row, torch.tensor([3.0], dtype=torch.float64).view(torch.uint8))


def test_one_row_weights_with_a_non_unit_stride_move_bit_exact():
    """S = 1 vectors cut from wider matrices (stride 8) swap across ranks bit-exact, full and one-layer entry points."""
    from eplb_fsm.transfer import (
        InProcessCommunicator,
        TransferBuffer,
        commit_layer_from_buffer,
        rearrange_expert_weights_inplace,
        transfer_layer_to_buffer,
    )

    def bits(col: int) -> list[torch.Tensor]:  # (1, 1) slices have a unit last stride: viewable as bytes
        return [m[:, col : col + 1].view(torch.uint8).clone() for m in mats]

    mats = [torch.randn(1, 8, dtype=torch.float64) for _ in range(2)]
    want = bits(0)[::-1]
    w = [[[m[:, 0]]] for m in mats]  # 2 ranks, 1 layer, one (1,) tensor of stride 8
    rearrange_expert_weights_inplace([[0, 1]], [[1, 0]], w, communicator=InProcessCommunicator(2),
                                     buffer=TransferBuffer())
    assert all(torch.equal(got, w_) for got, w_ in zip(bits(0), want))
    want = bits(1)[::-1]
    layer = [[m[:, 1]] for m in mats]
    pending = transfer_layer_to_buffer([0, 1], [1, 0], layer, TransferBuffer(), communicator=InProcessCommunicator(2))
    commit_layer_from_buffer(pending, layer)
    assert all(torch.equal(got, w_) for got, w_ in zip(bits(1), want))
