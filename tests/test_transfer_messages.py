"""Rows as bytes and copy runs (transfer/messages.py): what every message and commit is made of."""

from __future__ import annotations

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
