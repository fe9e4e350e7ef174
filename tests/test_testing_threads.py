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


def test_the_first_real_error_is_raised_not_the_broken_barrier_it_caused():
    """Rank 1's ValueError reaches the caller even though rank 0, waiting in the barrier, failed first by index."""

    def body(rank, group):
        if rank == 1:
            raise ValueError("the real bug on rank 1")
        group.all_reduce(torch.zeros(1), timeout_s=30.0)

    with pytest.raises(ValueError, match="the real bug on rank 1"):
        run_threads(2, body, timeout=30.0)


def test_timeout_bounds_the_whole_run_and_frees_the_waiting_ranks():
    """A rank that never arrives: TimeoutError naming it, and the barrier broken so the waiters return."""
    import threading

    release = threading.Event()
    waiters: list = []

    def body(rank, group):
        if rank == 2:
            release.wait(30.0)
            return None
        try:
            group.all_reduce(torch.zeros(1), timeout_s=30.0)
        except threading.BrokenBarrierError:
            waiters.append(rank)

    with pytest.raises(TimeoutError, match=r"\[0, 1, 2\]|\[2\]"):
        run_threads(3, body, timeout=0.5)
    release.set()
    deadline = threading.Event()
    for _ in range(100):
        if sorted(waiters) == [0, 1]:
            break
        deadline.wait(0.1)
    assert sorted(waiters) == [0, 1]
    with pytest.raises(ValueError, match="timeout"):
        run_threads(1, body, timeout=-1)
    with pytest.raises(ValueError, match="world_size"):
        ThreadWorld(True)


@pytest.mark.parametrize("timeout", [float("inf"), float("nan"), 1e12, 0, True])
def test_a_timeout_that_is_not_a_finite_positive_number_is_refused_before_any_thread(timeout):
    """run_threads checks timeout up front (inf used to fail in join, after the bodies had run)."""
    ran = []
    with pytest.raises(ValueError, match="^timeout must be a finite number of seconds > 0"):
        run_threads(2, lambda rank, group: ran.append(rank), timeout=timeout)
    assert ran == []
