"""The executor on CUDA tensors: non-blocking copies, direct local copies and the commit stay bit-exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eplb_fsm.transfer import (
    InProcessCommunicator,
    TransferBuffer,
    commit_layer_from_buffer,
    rearrange_expert_weights_inplace,
    transfer_layer_to_buffer,
)
from test_transfer_execute import check_world, make_world

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _random_maps(rng: np.random.Generator, num_layers: int, g: int, s: int) -> tuple[np.ndarray, np.ndarray]:
    p = g * s
    n = p - g  # g redundant replicas

    def one() -> np.ndarray:
        m = np.concatenate([rng.permutation(n), rng.integers(0, n, p - n)])
        return m[rng.permutation(p)]

    return np.stack([one() for _ in range(num_layers)]), np.stack([one() for _ in range(num_layers)])


def _to_cuda(weights):
    return [[[t.cuda() for t in layer] for layer in rank] for rank in weights]


def _to_cpu(weights):
    return [[[t.cpu() for t in layer] for layer in rank] for rank in weights]


@pytest.mark.parametrize("seed", range(8))
def test_random_rearrangements_on_cuda_are_bit_exact(seed):
    """Random maps with replicas, in-rank cycles and remote rows: every CUDA slot ends bit-exact."""
    rng = np.random.default_rng(seed)
    g, s = 3, 6
    old, new = _random_maps(rng, 3, g, s)
    weights, tables = make_world(old, g)
    on_gpu = _to_cuda(weights)
    rearrange_expert_weights_inplace(old, new, on_gpu, communicator=InProcessCommunicator(g), buffer=TransferBuffer())
    torch.cuda.synchronize()
    check_world(_to_cpu(on_gpu), tables, old, new, g)


def test_one_layer_api_on_cuda_keeps_weights_until_commit():
    """On CUDA too, the one-layer transfer leaves the weights alone until the commit writes them."""
    rng = np.random.default_rng(7)
    g, s = 2, 8
    old, new = _random_maps(rng, 1, g, s)
    weights, tables = make_world(old, g)
    on_gpu = _to_cuda(weights)
    before = [[t.clone() for t in rank[0]] for rank in on_gpu]
    layer = [rank[0] for rank in on_gpu]
    pending = transfer_layer_to_buffer(old[0], new[0], layer, TransferBuffer(), communicator=InProcessCommunicator(g))
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for rank_a, rank_b in zip(layer, before) for a, b in zip(rank_a, rank_b))
    commit_layer_from_buffer(pending, layer)
    torch.cuda.synchronize()
    check_world(_to_cpu(on_gpu), tables, old, new, g)
