"""transfer/inputs.py: weights a group cannot move (off the CPU on gloo, off CUDA on NCCL, inference tensors
outside inference mode) are refused before anything moves."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from eplb_fsm.transfer import TransferBuffer, TransferError, rearrange_expert_weights_inplace, transfer_layer_to_buffer
from eplb_fsm.transfer.inputs import UnmovableWeightsError, check_devices

GLOO = SimpleNamespace(host_memory_only=True, backend="gloo")


def _layer(device: str, rows: int = 4) -> list[torch.Tensor]:
    return [torch.zeros(rows, 3, device=device), torch.zeros(rows, 2, dtype=torch.bfloat16, device=device)]


def test_off_cpu_weights_on_a_host_memory_group_name_the_tensor_device_and_rule():
    """A host-memory-only communicator refuses a tensor off the CPU, naming it, its device, the backend and the way
    out."""
    tensors = [torch.zeros(4, 3), torch.zeros(4, 2, device="meta")]
    with pytest.raises(UnmovableWeightsError, match=r"expert_weights\[0\]\[1\]: is on meta, and the transfer group "
                                                    r"\(gloo\) moves CPU tensors only") as info:
        check_devices(GLOO, "expert_weights[0]", tensors, 0)
    assert isinstance(info.value, ValueError) and info.value.committed_layers == 0 and info.value.layer == 0
    assert "Keep the expert weights on the CPU" in str(info.value)


def test_cpu_weights_and_other_communicators_pass():
    """CPU tensors pass on a host-memory-only communicator; any device passes on one without that rule."""
    check_devices(GLOO, "expert_weights[0]", _layer("cpu"), 0)
    check_devices(SimpleNamespace(), "expert_weights[0]", _layer("meta"), 0)
    check_devices(SimpleNamespace(host_memory_only=False), "expert_weights[0]", _layer("meta"), 0)


def test_the_executor_refuses_off_cpu_weights_on_gloo_before_posting(one_rank_group):
    """On a real gloo group, meta weights raise the device rule (0 committed layers), not a crash inside gloo."""
    old = np.array([[0, 1, 2, 3], [0, 1, 2, 3]])
    new = np.array([[3, 2, 1, 0], [1, 0, 3, 2]])
    weights = [_layer("meta"), _layer("meta")]
    with pytest.raises(TransferError,
                       match=r"expert_weights\[0\]\[0\]: is on meta.*\(gloo\) moves CPU tensors only") as info:
        rearrange_expert_weights_inplace(old, new, weights, buffer=TransferBuffer(), timeout=5.0)
    assert isinstance(info.value, ValueError) and info.value.committed_layers == 0
    with pytest.raises(ValueError, match=r"layer_weights\[0\]: is on meta"):
        transfer_layer_to_buffer(old[0], new[0], _layer("meta"), TransferBuffer(), timeout=5.0)


def test_cpu_weights_still_move_on_gloo(one_rank_group):
    """The same rearrangement with CPU weights on the gloo group moves every row to its new slot."""
    old = np.array([[0, 1, 2, 3]])
    new = np.array([[3, 2, 1, 0]])
    w = torch.arange(4.0).repeat_interleave(3).reshape(4, 3)
    rearrange_expert_weights_inplace(old, new, [[w]], buffer=TransferBuffer(), timeout=5.0)
    assert w[:, 0].tolist() == [3.0, 2.0, 1.0, 0.0]


def test_the_one_layer_entry_point_refuses_tensors_that_share_memory():
    """transfer_layer_to_buffer refuses a tensor listed twice, as the full entry point does (it moved rows twice)."""
    from eplb_fsm.transfer import InProcessCommunicator

    w = torch.arange(3.0)[:, None].repeat(1, 2)
    before = w.clone()
    with pytest.raises(UnmovableWeightsError,
                       match=r"layer_weights\[0\]\[0\] and layer_weights\[0\]\[1\]: share memory"):
        transfer_layer_to_buffer(np.array([0, 1, 2]), np.array([1, 2, 0]), [[w, w]], TransferBuffer(),
                                 communicator=InProcessCommunicator(1))
    assert torch.equal(w, before)


NCCL = SimpleNamespace(cuda_memory_only=True, backend="nccl")


def test_off_cuda_weights_on_an_nccl_group_name_the_tensor_device_and_rule():
    """A CUDA-memory-only (NCCL) communicator refuses CPU weights up front, naming the tensor, device and backend."""
    with pytest.raises(UnmovableWeightsError, match=r"expert_weights\[0\]\[0\]: is on cpu, and the transfer group "
                                                    r"\(nccl\) moves CUDA tensors only") as info:
        check_devices(NCCL, "expert_weights[0]", _layer("cpu"), 0)
    assert info.value.committed_layers == 0 and "transfer CPU weights over a gloo group" in str(info.value)
    check_devices(SimpleNamespace(cuda_memory_only=False), "expert_weights[0]", _layer("cpu"), 0)


def _inference_world():
    """Three layers of (2, 3) rows holding their expert id on 2 ranks, made under torch.inference_mode()."""
    old = np.array([[0, 1, 2, 3]] * 3)
    with torch.inference_mode():
        w = [[[torch.tensor([[float(e)] * 3 for e in old[k, 2 * r : 2 * r + 2]])] for k in range(3)] for r in range(2)]
    return old, w


def test_inference_tensors_are_refused_outside_inference_mode_and_move_inside_it():
    """Inference-mode weights raise UnmovableWeightsError (nothing moves) outside inference mode and move inside it."""
    from eplb_fsm.transfer import InProcessCommunicator

    old, w = _inference_world()
    new = np.array([[0, 1, 2, 3], [1, 0, 3, 2], [3, 2, 1, 0]])
    comm = InProcessCommunicator(2)
    with pytest.raises(UnmovableWeightsError, match=r"expert_weights\[0\]\[0\]\[0\]: is an inference tensor") as info:
        rearrange_expert_weights_inplace(old, new, w, communicator=comm, buffer=TransferBuffer())
    assert info.value.committed_layers == 0 and comm.total_messages == 0
    assert [[w[r][k][0][:, 0].tolist() for r in range(2)] for k in range(3)] == [[[0, 1], [2, 3]]] * 3
    with torch.inference_mode():
        rearrange_expert_weights_inplace(old, new, w, communicator=comm, buffer=TransferBuffer())
    assert [[w[r][k][0][:, 0].tolist() for r in range(2)] for k in range(3)] == [[n[:2], n[2:]] for n in new.tolist()]


def test_a_one_layer_commit_outside_inference_mode_is_refused_before_writing():
    """Transferred under inference mode, the commit outside it refuses the inference weights and writes nothing."""
    from eplb_fsm.transfer import InProcessCommunicator, commit_layer_from_buffer

    _, w = _inference_world()
    lw = [w[r][0] for r in range(2)]
    with torch.inference_mode():
        pending = transfer_layer_to_buffer([0, 1, 2, 3], [1, 0, 3, 2], lw, TransferBuffer(),
                                           communicator=InProcessCommunicator(2))
    with pytest.raises(UnmovableWeightsError, match=r"layer_weights\[0\]\[0\]: is an inference tensor"):
        commit_layer_from_buffer(pending, lw)
    assert not pending.committed and [lw[r][0][:, 0].tolist() for r in range(2)] == [[0, 1], [2, 3]]
    with torch.inference_mode():
        commit_layer_from_buffer(pending, lw)
    assert [lw[r][0][:, 0].tolist() for r in range(2)] == [[1, 0], [3, 2]]


@pytest.mark.parametrize("kind", ["conj", "neg"])
def test_lazy_conjugate_and_negative_views_are_refused_before_anything_moves(kind):
    """t.conj() and torch._neg_view(t) weights are UnmovableWeightsError naming the tensor, before any message."""
    from eplb_fsm.transfer import InProcessCommunicator

    def make(r: int) -> torch.Tensor:
        base = torch.arange(4.0).reshape(2, 2).to(torch.complex64) + 10 * r + 1j
        return base.conj() if kind == "conj" else torch._neg_view(base.real.contiguous())

    w = [[[make(r)]] for r in range(2)]
    before = [x[0][0].resolve_conj().resolve_neg().clone() for x in w]
    comm = InProcessCommunicator(2)
    with pytest.raises(UnmovableWeightsError, match=r"^expert_weights\[0\]\[0\]\[0\]: is a lazy .* view") as info:
        rearrange_expert_weights_inplace([[0, 1, 2, 3]], [[3, 2, 1, 0]], w, communicator=comm, buffer=TransferBuffer())
    assert info.value.committed_layers == 0 and comm.total_messages == 0
    assert all(torch.equal(w[r][0][0].resolve_conj().resolve_neg(), before[r]) for r in range(2))


def test_the_one_layer_entry_point_refuses_a_conjugate_view_before_touching_the_buffer():
    """A conjugate view is refused before the buffer's generation moves: a layer pending on it still commits."""
    from eplb_fsm.transfer import InProcessCommunicator, commit_layer_from_buffer

    comm, buf = InProcessCommunicator(2), TransferBuffer()
    good = [[torch.tensor([[1.0]])], [torch.tensor([[2.0]])]]
    pending = transfer_layer_to_buffer([0, 1], [1, 0], good, buf, communicator=comm)
    generation = buf.generation
    odd = [[torch.tensor([[1 + 1j]]).conj()], [torch.tensor([[2 + 2j]]).conj()]]
    with pytest.raises(UnmovableWeightsError, match=r"^layer_weights\[0\]\[0\]: is a lazy conjugate view"):
        transfer_layer_to_buffer([0, 1], [1, 0], odd, buf, layer=1, communicator=comm)
    assert buf.generation == generation
    commit_layer_from_buffer(pending, good)
    assert [t[0].item() for t in good] == [2.0, 1.0]
