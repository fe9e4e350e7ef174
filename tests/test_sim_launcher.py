"""The multi-process launcher: results by rank, failures and timeouts raised, no process left behind."""

from __future__ import annotations

import os
import socket
import time

import pytest

from eplb_fsm.sim.launcher import RankFailedError, RanksTimeoutError, find_free_port, run_ranks

pytestmark = pytest.mark.multiprocess


def _sum_ranks(rank: int, world: int, offset: int) -> tuple:
    import torch
    import torch.distributed as dist

    t = torch.tensor([rank + offset])
    dist.all_reduce(t)
    return rank, world, int(t), dist.get_backend(), os.getpid()


def _fail_on_rank_1(rank: int, world: int, pid_dir: str) -> int:
    import torch.distributed as dist

    _write_pid(pid_dir, rank)
    if rank == 1:
        raise KeyError("boom on rank 1")
    dist.barrier()  # rank 0 blocks here: the launcher must stop it
    return rank


def _sleep_on_rank_1(rank: int, world: int, pid_dir: str) -> int:
    _write_pid(pid_dir, rank)
    if rank == 1:
        time.sleep(120)
    return rank


def _exit_on_rank_0(rank: int, world: int) -> int:
    if rank == 0:
        os._exit(3)
    return rank


def _write_pid(pid_dir: str, rank: int) -> None:
    with open(os.path.join(pid_dir, f"{rank}.pid"), "w") as fh:
        fh.write(str(os.getpid()))


def _assert_gone(pid_dir: str) -> None:
    pids = [int(open(os.path.join(pid_dir, f)).read()) for f in os.listdir(pid_dir)]
    assert pids
    deadline = time.monotonic() + 5
    for pid in pids:
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < deadline, f"process {pid} still alive"
            time.sleep(0.05)


def test_returns_values_by_rank_after_a_collective():
    """Each rank joins one gloo group; values come back in rank order with the args applied."""
    out = run_ranks(_sum_ranks, 3, args=(10,), timeout=60)
    assert [o[:4] for o in out] == [(r, 3, 33, "gloo") for r in range(3)]
    assert len({o[4] for o in out}) == 3 and os.getpid() not in {o[4] for o in out}


def test_a_failing_rank_raises_and_stops_the_others(tmp_path):
    """A rank that raises surfaces as RankFailedError with its traceback; the blocked rank is killed."""
    t0 = time.monotonic()
    with pytest.raises(RankFailedError, match="boom on rank 1") as info:
        run_ranks(_fail_on_rank_1, 2, args=(str(tmp_path),), timeout=60)
    assert 1 in info.value.failures and "KeyError" in info.value.failures[1]
    assert time.monotonic() - t0 < 30
    _assert_gone(str(tmp_path))


def test_timeout_kills_stragglers(tmp_path):
    """A rank still running at the deadline is killed and RanksTimeoutError names it."""
    t0 = time.monotonic()
    with pytest.raises(RanksTimeoutError) as info:
        run_ranks(_sleep_on_rank_1, 2, args=(str(tmp_path),), timeout=3.0)
    assert 1 in info.value.pending
    assert time.monotonic() - t0 < 15
    _assert_gone(str(tmp_path))


def test_a_rank_that_dies_is_reported():
    """A rank that exits without reporting (os._exit) is a failure with its exit code."""
    with pytest.raises(RankFailedError, match="exited with code 3"):
        run_ranks(_exit_on_rank_0, 2, timeout=30)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(fn=None, world_size=2), "fn: must be callable"),
        (dict(fn=_sum_ranks, world_size=0), "world_size: must be a positive int"),
        (dict(fn=_sum_ranks, world_size=2, timeout=0), "timeout: must be > 0"),
    ],
)
def test_bad_arguments(kwargs, match):
    """Bad launcher arguments raise ValueError before anything starts."""
    with pytest.raises(ValueError, match=match):
        run_ranks(**kwargs)


def test_free_port_is_bindable():
    """find_free_port returns a port that can be bound right away."""
    port = find_free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
