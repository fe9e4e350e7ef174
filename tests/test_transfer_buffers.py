"""transfer/buffers.py: the reusable buffer a transfer lands in."""

from __future__ import annotations

import numpy as np
import torch

from eplb_fsm.transfer import InProcessCommunicator, TransferBuffer, rearrange_expert_weights_inplace


def test_a_buffer_first_used_under_inference_mode_takes_writes_outside_it():
    """Buffer rows allocated under torch.inference_mode() are normal tensors: a later call outside it still moves."""
    old, new = np.array([[0, 1, 2, 3]]), np.array([[1, 0, 3, 2]])  # in-rank swaps: a staged copy into the buffer
    buf = TransferBuffer()
    with torch.inference_mode():
        w = [[[torch.arange(2.0)[:, None] + 2 * r]] for r in range(2)]
        rearrange_expert_weights_inplace(old, new, w, communicator=InProcessCommunicator(2), buffer=buf)
    w = [[[torch.arange(2.0)[:, None] + 2 * r]] for r in range(2)]
    rearrange_expert_weights_inplace(old, new, w, communicator=InProcessCommunicator(2), buffer=buf)
    assert buf.allocations == 2 and [w[r][0][0][:, 0].tolist() for r in range(2)] == [[1, 0], [3, 2]]
