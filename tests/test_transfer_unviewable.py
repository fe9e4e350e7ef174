"""Weights whose rows have no byte view or that torch cannot copy (quantized, sparse, MKL-DNN, nested, sub-byte
dtypes, meta) are refused by name and rule before the buffer is touched: a layer pending in it still commits."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from eplb_fsm.transfer import (InProcessCommunicator, TransferBuffer, UnmovableWeightsError, commit_layer_from_buffer,
                               rearrange_expert_weights_inplace, transfer_layer_to_buffer)
from eplb_fsm.transfer.inputs import check_movable

OLD, NEW = np.array([0, 1, 2, 3]), np.array([3, 2, 1, 0])


def _quiet(make):
    """``make`` with torch's prototype, beta and deprecation warnings (nested, sparse CSR, quantized) silenced."""
    def quiet(t: torch.Tensor) -> torch.Tensor:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return make(t)
    return quiet


KINDS = {
    "quantized": (_quiet(lambda t: torch.quantize_per_tensor(t, 0.5, 0, torch.qint8)),
                  r"is a quantized tensor \(torch\.qint8"),
    "sparse_coo": (lambda t: t.to_sparse(), r"is a torch\.sparse_coo tensor; rows travel as bytes"),
    "sparse_csr": (_quiet(lambda t: t.to_sparse_csr()), r"is a torch\.sparse_csr tensor; rows travel as bytes"),
    "nested": (_quiet(lambda t: torch.nested.nested_tensor(list(t))), r"is a nested tensor; rows travel as bytes"),
    "meta": (lambda t: t.to("meta"), r"is on the meta device, which holds no data"),
}
if torch.backends.mkldnn.is_available():
    KINDS["mkldnn"] = (lambda t: t.to_mkldnn(), r"is a torch\._mkldnn tensor; rows travel as bytes")
if hasattr(torch, "uint4"):
    KINDS["uint4"] = (lambda t: torch.empty(tuple(t.shape), dtype=torch.uint4),
                      r"has dtype torch\.uint4, which this torch cannot view as bytes or copy_ on cpu")


def _pending(buf: TransferBuffer):
    """A swap of both ranks' experts transferred into ``buf``, not committed: (pending, weights)."""
    w = [[torch.arange(8.0).reshape(2, 4) + 10 * r] for r in range(2)]
    return transfer_layer_to_buffer(OLD, NEW, w, buf, communicator=InProcessCommunicator(2)), w


def _assert_commits(pending, w) -> None:
    commit_layer_from_buffer(pending, w)
    assert [x[0][:, 0].tolist() for x in w] == [[14.0, 10.0], [4.0, 0.0]]  # experts 3, 2 | 1, 0 (rows [e % 2])


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_full_rearrangement_refuses_unviewable_weights_before_the_buffer(kind):
    """Each kind raises UnmovableWeightsError naming the tensor and rule; the buffer keeps its rows and generation."""
    make, rule = KINDS[kind]
    buf = TransferBuffer()
    pending, w = _pending(buf)
    allocations, generation = buf.allocations, buf.generation
    bad = [[[make(torch.arange(8.0).reshape(2, 4) + r)]] for r in range(2)]
    with pytest.raises(UnmovableWeightsError, match=r"^expert_weights\[0\]\[0\]\[0\]: " + rule) as info:
        rearrange_expert_weights_inplace(OLD[None], NEW[None], bad, communicator=InProcessCommunicator(2), buffer=buf)
    assert info.value.committed_layers == 0 and isinstance(info.value, ValueError)
    assert (buf.allocations, buf.generation) == (allocations, generation)
    _assert_commits(pending, w)


@pytest.mark.parametrize("kind", ["quantized", "meta"])
def test_the_one_layer_entry_point_refuses_them_and_the_earlier_layer_still_commits(kind):
    """transfer_layer_to_buffer refuses quantized or meta weights before reusing the buffer of a pending layer."""
    make, rule = KINDS[kind]
    buf = TransferBuffer()
    pending, w = _pending(buf)
    bad = [[make(torch.arange(8.0).reshape(2, 4))] for _ in range(2)]
    with pytest.raises(UnmovableWeightsError, match=r"^layer_weights\[0\]\[0\]: " + rule):
        transfer_layer_to_buffer(OLD, NEW, bad, buf, communicator=InProcessCommunicator(2))
    _assert_commits(pending, w)


def test_meta_weights_on_one_rank_are_refused_not_reported_as_moved():
    """One rank's meta weights, which once 'moved' without error and without moving anything, are refused."""
    w = [[[torch.empty(4, 3, device="meta")]]]  # the in-process communicator takes a list over its one rank
    with pytest.raises(UnmovableWeightsError, match=r"^expert_weights\[0\]\[0\]\[0\]: is on the meta device"):
        rearrange_expert_weights_inplace(OLD[None], NEW[None], w, communicator=InProcessCommunicator(1),
                                         buffer=TransferBuffer())


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128, torch.float8_e4m3fn,
          torch.float8_e5m2] + [getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_byte_viewable_dtype_still_passes_and_moves_bit_exact(dtype):
    """The dtype probe refuses none of the dtypes the executor moves; a swap of them stays bit-exact."""
    high = 2 if dtype == torch.bool else 256  # a bool byte other than 0 or 1 need not survive a copy
    raw = [torch.randint(0, high, (2, 4 * 16), dtype=torch.uint8) for _ in range(2)]
    w = [[[r.view(dtype)]] for r in raw]  # arbitrary bit patterns (NaNs included): compared as bytes
    check_movable("w", w[0][0][0])
    want = [raw[1].clone(), raw[0].clone()]
    rearrange_expert_weights_inplace([[0, 1, 2, 3]], [[2, 3, 0, 1]], w, communicator=InProcessCommunicator(2),
                                     buffer=TransferBuffer())
    assert all(torch.equal(x[0][0].view(torch.uint8), y) for x, y in zip(w, want))


def test_a_transient_oom_in_the_dtype_probe_is_raised_and_not_remembered(monkeypatch):
    """The probe's allocation meets an OOM once (a full GPU; raised here on CPU): it goes up as the OOM, and the next
    check of float8 weights probes again and accepts them (a cached "no" would refuse them for the process's life)."""
    from eplb_fsm.transfer import inputs

    inputs._byte_copyable.cache_clear()
    real_empty = torch.empty

    def oom_once(*args, **kwargs):
        monkeypatch.setattr(torch, "empty", real_empty)
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (raised by the test)")

    monkeypatch.setattr(torch, "empty", oom_once)
    weights = torch.zeros(4, 8, dtype=torch.float8_e4m3fn)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        inputs.check_movable("w", weights)
    inputs.check_movable("w", weights)   # probed again: accepted
    assert inputs._byte_copyable.cache_info().currsize == 1
