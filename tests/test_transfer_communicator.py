"""Communicators: in-process matching and counting; the torch.distributed one on a 1-rank group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from eplb_fsm.transfer import Communicator, InProcessCommunicator, MessageMismatchError, TorchDistCommunicator


def test_in_process_matches_in_queue_order():
    """Messages of one (src, dst) pair are delivered in the order both sides queued them."""
    comm = InProcessCommunicator(3)
    a, b = torch.tensor([1, 2]), torch.tensor([3, 4])
    ra, rb, rc = torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    comm.add_send(a, 0, 2)
    comm.add_send(b, 0, 2)
    comm.add_send(a, 1, 2)
    comm.add_recv(rc, 1, 2)
    comm.add_recv(ra, 0, 2)
    comm.add_recv(rb, 0, 2)
    comm.execute()
    assert ra.tolist() == [1, 2] and rb.tolist() == [3, 4] and rc.tolist() == [1, 2]
    assert comm.messages == {(0, 2): 2, (1, 2): 1} and comm.bytes[(0, 2)] == 32 and comm.executes == 1


def test_in_process_unmatched_raises_before_copying():
    """A send without its receive (a hang in a real group) raises and copies nothing."""
    comm = InProcessCommunicator(2)
    r = torch.zeros(1)
    comm.add_send(torch.ones(1), 0, 1)
    comm.add_send(torch.ones(1), 1, 0)
    comm.add_recv(r, 1, 0)
    with pytest.raises(MessageMismatchError, match="rank 0 queued 1 sends to rank 1"):
        comm.execute()
    assert r.item() == 0.0 and comm.total_messages == 0


def test_in_process_size_mismatch_raises():
    """A receive buffer of a different size or dtype than the message raises."""
    comm = InProcessCommunicator(2)
    comm.add_send(torch.ones(2), 0, 1)
    comm.add_recv(torch.zeros(3), 0, 1)
    with pytest.raises(MessageMismatchError, match="receive buffer"):
        comm.execute()


@pytest.mark.parametrize("src,dst,match", [(0, 0, "cannot message itself"), (0, 2, "dst: rank 2"), (-1, 0, "src: rank -1")])
def test_in_process_rejects_bad_ranks(src, dst, match):
    """Out-of-group and self messages are rejected when queued."""
    with pytest.raises(ValueError, match=match):
        InProcessCommunicator(2).add_send(torch.ones(1), src, dst)


def test_in_process_is_a_communicator():
    """InProcessCommunicator satisfies the Communicator protocol and plays every rank."""
    comm = InProcessCommunicator(4)
    assert isinstance(comm, Communicator)
    assert comm.multi_rank and comm.local_ranks == (0, 1, 2, 3)
    with pytest.raises(ValueError, match="world_size"):
        InProcessCommunicator(0)


def test_torch_dist_on_one_rank(one_rank_group):
    """On a 1-rank group the communicator is rank 0, executes an empty batch, refuses foreign ranks."""
    comm = TorchDistCommunicator(timeout=5.0)
    assert isinstance(comm, Communicator)
    assert (comm.rank, comm.world_size, comm.local_ranks, comm.multi_rank) == (0, 1, (0,), False)
    assert comm.backend == "gloo"
    comm.execute()  # nothing queued: a no-op
    with pytest.raises(ValueError, match="cannot send as rank 1"):
        comm.add_send(torch.ones(1), 1, 0)
    with pytest.raises(ValueError, match="cannot receive as rank 1"):
        comm.add_recv(torch.ones(1), 0, 1)
    with pytest.raises(ValueError, match="timeout"):
        TorchDistCommunicator(timeout=0)
    with pytest.raises(ValueError, match="cannot post as rank 1"):
        comm.add_ops(1, [(True, torch.ones(1), 0, 0)])


@pytest.mark.parametrize("timeout", [float("inf"), float("nan"), 1e300, True, "5"])
def test_torch_dist_refuses_a_timeout_that_would_fail_only_in_wait(one_rank_group, timeout):
    """An infinite, NaN, huge, bool or string timeout is refused by name at construction, not at the first wait."""
    with pytest.raises(ValueError, match="^timeout must be a finite number > 0"):
        TorchDistCommunicator(timeout=timeout)


def test_a_gloo_communicator_moves_host_memory_only(one_rank_group):
    """On gloo the communicator says it moves CPU tensors only; the in-process one does not."""
    assert TorchDistCommunicator(timeout=5.0).host_memory_only is True
    assert getattr(InProcessCommunicator(2), "host_memory_only", False) is False


def test_an_nccl_communicator_refuses_cpu_weights_before_posting(one_rank_group, monkeypatch):
    """A communicator whose group says NCCL moves CUDA memory only: CPU weights are refused before any start()."""
    from eplb_fsm.transfer import TransferBuffer, UnmovableWeightsError, rearrange_expert_weights_inplace

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")  # no NCCL run: only what the group says
    comm = TorchDistCommunicator(timeout=5.0)
    assert comm.cuda_memory_only is True and comm.host_memory_only is False
    starts = []
    comm.start = lambda: starts.append(1)
    w = torch.arange(4.0)[:, None].repeat(1, 3)
    with pytest.raises(UnmovableWeightsError, match=r"expert_weights\[0\]\[0\]: is on cpu.*\(nccl\) moves CUDA "
                                                    r"tensors only") as info:
        rearrange_expert_weights_inplace([[0, 1, 2, 3]], [[3, 2, 1, 0]], [[w]], communicator=comm,
                                         buffer=TransferBuffer())
    assert info.value.committed_layers == 0 and starts == [] and w[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_torch_dist_requires_initialized():
    """Without an initialized default group the communicator refuses to build."""
    if dist.is_initialized():
        pytest.skip("a default group exists in this process")
    with pytest.raises(ValueError, match="not initialized"):
        TorchDistCommunicator()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_stream_context_on_cuda(one_rank_group):
    """With a CUDA stream the copies run on it and finish() makes the caller's stream wait."""
    stream = torch.cuda.Stream()
    comm = TorchDistCommunicator(stream=stream)
    x = torch.ones(4, device="cuda")
    with comm.stream_context():
        assert torch.cuda.current_stream() == stream
        y = x * 2
    comm.finish()
    assert y.sum().item() == 8.0


def test_in_process_pairs_by_tag_across_starts():
    """Tagged messages pair by tag whatever the posting order; start() leaves the unpaired queued, wait() flags them."""
    comm = InProcessCommunicator(2)
    r0, r1 = torch.zeros(1), torch.zeros(1)
    comm.add_send(torch.tensor([5.0]), 0, 1, tag=0)
    comm.add_send(torch.tensor([7.0]), 0, 1, tag=1)
    comm.add_recv(r1, 0, 1, tag=1)  # the second message's receive first
    comm.start()
    assert r1.item() == 7.0 and r0.item() == 0.0 and comm.total_messages == 1
    comm.add_recv(r0, 0, 1, tag=0)  # the held receive, in a second phase
    comm.start()
    comm.wait()
    assert r0.item() == 5.0 and comm.total_messages == 2 and comm.executes == 1
    comm.add_send(torch.ones(1), 1, 0, tag=3)
    comm.start()  # nothing pairs yet: no error until the wave ends
    with pytest.raises(MessageMismatchError, match="rank 1 queued 1 sends to rank 0"):
        comm.wait()


def _tagged_pairs_rank(rank: int, world: int) -> list[list[float]]:
    """Rank 0 sends three tagged rows in one start(); rank 1 receives them over two start()s, out of order
    (the second start's receives queued with add_ops)."""
    comm = TorchDistCommunicator(timeout=30.0)
    rows = [torch.full((5,), float(10 * t + 1)) for t in range(3)]
    if rank == 0:
        for t, row in enumerate(rows):
            comm.add_send(row, 0, 1, tag=t)
        comm.start()
        comm.wait()
        return []
    got = [torch.zeros(5) for _ in range(3)]
    comm.add_recv(got[2], 0, 1, tag=2)
    comm.start()
    # the rest in one add_ops call: (is_send, tensor, peer, tag) each
    comm.add_ops(1, [(False, got[0], 0, 0), (False, got[1], 0, 1)])
    comm.start()
    comm.wait()
    return [g.tolist() for g in got]


@pytest.mark.multiprocess
def test_torch_dist_on_gloo_pairs_messages_by_tag_across_starts():
    """On 2 gloo ranks, receives posted in a later start() (via add_ops) and out of order still get the send with their tag."""
    from eplb_fsm.sim.launcher import run_ranks

    _, received = run_ranks(_tagged_pairs_rank, 2, timeout=60.0)
    assert received == [[1.0] * 5, [11.0] * 5, [21.0] * 5]
