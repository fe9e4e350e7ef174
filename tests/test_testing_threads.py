"""The thread harness: G ranks in one process with a summing all-reduce and point-to-point messages."""

from __future__ import annotations

import pytest
import torch

from eplb_fsm.testing.threads import ThreadWorld, run_threads


def test_all_reduce_sums_over_every_rank():
    """Each rank contributes rank + 1; every rank ends with the sum, and the per-rank count advances."""

    def body(rank, group):
        t = torch.full((2, 3), float(rank + 1))
        group.all_reduce(t, timeout_s=10.0)
        group.all_reduce(t, timeout_s=10.0)
        return t, group.world_size

    results = run_threads(3, body)
    for t, world_size in results:
        assert world_size == 3
        assert torch.equal(t, torch.full((2, 3), 18.0))  # (1 + 2 + 3) summed twice over 3 ranks


def test_point_to_point_messages_arrive_at_their_peer():
    """A ring exchange: every rank receives the tensor its left neighbour sent."""

    def body(rank, group):
        comm = group.transfer_communicator(timeout_s=10.0)
        out = torch.zeros(4)
        comm.add_send(torch.full((4,), float(rank)), rank, (rank + 1) % 3)
        comm.add_recv(out, (rank - 1) % 3, rank)
        comm.execute()
        return out

    for rank, out in enumerate(run_threads(3, body)):
        assert torch.equal(out, torch.full((4,), float((rank - 1) % 3)))


def test_missing_message_times_out_naming_the_peer():
    """A receive nobody sends to raises TimeoutError naming the silent peer."""

    def body(rank, group):
        comm = group.transfer_communicator(timeout_s=0.2)
        if rank == 0:
            comm.add_recv(torch.zeros(1), 1, 0)
        comm.execute()

    with pytest.raises(TimeoutError, match="no message from rank 1"):
        run_threads(2, body)


def test_failure_on_one_rank_reaches_the_caller_and_frees_the_others():
    """A rank's error aborts the barrier, so the others do not wait forever; the lowest rank's error is raised."""

    def body(rank, group):
        if rank == 0:
            raise RuntimeError("rank 0 broke")
        group.all_reduce(torch.zeros(1), timeout_s=30.0)

    with pytest.raises(RuntimeError, match="rank 0 broke"):
        run_threads(2, body, timeout=30.0)


def test_injected_all_reduce_failure_and_bad_world_size():
    """fail_all_reduce raises TimeoutError; a world of 0 ranks is refused naming world_size."""
    group = ThreadWorld(1).group(0)
    group.fail_all_reduce = True
    with pytest.raises(TimeoutError):
        group.all_reduce(torch.zeros(1), timeout_s=1.0)
    with pytest.raises(ValueError, match="world_size"):
        ThreadWorld(0)
