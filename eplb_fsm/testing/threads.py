"""G ranks played by threads of one process: the controller's group seam, without torch.distributed.

The controller accepts, besides a torch process group, any group object with
``rank``, ``world_size``, ``all_reduce(tensor, timeout_s)`` and
``transfer_communicator(timeout_s)`` (its documented seam for non-torch groups).
:class:`ThreadWorld` provides one per rank: a barrier-based sum all-reduce and
queue-based point-to-point messages, so the sync and async paths, faults and commits run
for real on 2-4 ranks in a fraction of a second. :func:`run_threads` runs one body per
rank and re-raises the first error. Every wait has a timeout.
"""

from __future__ import annotations

import queue
import threading
import time

import torch

from eplb_fsm.maps import MAX_SECONDS, as_count, check_seconds

__all__ = ["ThreadCommunicator", "ThreadGroup", "ThreadWorld", "run_threads"]


class ThreadWorld:
    """G in-process ranks: a barrier-based all-reduce and queue-based point-to-point messages."""

    def __init__(self, world_size: int) -> None:
        world_size = as_count(world_size, "world_size")
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size)
        self.slots: list = [None] * world_size          # each rank's all-reduce input
        self.queues: dict = {}                           # (generation, src, dst) -> messages
        self.lock = threading.Lock()
        self.all_reduces = [0] * world_size              # all-reduces finished, per rank

    def queue(self, key) -> queue.Queue:
        """The message queue of ``key`` = (generation, src, dst), created on first use."""
        with self.lock:
            if key not in self.queues:
                self.queues[key] = queue.Queue()
            return self.queues[key]

    def group(self, rank: int) -> "ThreadGroup":
        """Rank ``rank``'s group object."""
        return ThreadGroup(self, rank)


class ThreadGroup:
    """Rank ``rank``'s group: ``all_reduce`` sums a tensor over all ranks in place.

    ``fail_all_reduce = True`` makes the next all-reduces raise ``TimeoutError`` (a broken peer).
    """

    def __init__(self, world: ThreadWorld, rank: int) -> None:
        self.w = world
        self.rank = rank
        self.world_size = world.world_size
        self.generation = 0
        self.fail_all_reduce = False

    def all_reduce(self, tensor: torch.Tensor, timeout_s: float) -> None:
        """Sum ``tensor`` (any shape, the same on every rank) over all ranks, in place."""
        if self.fail_all_reduce:
            raise TimeoutError("injected all-reduce timeout")
        w = self.w
        w.slots[self.rank] = tensor.detach().clone()
        w.barrier.wait(timeout_s)
        total = w.slots[0].clone()
        for t in w.slots[1:]:
            total += t
        w.barrier.wait(timeout_s)
        tensor.copy_(total)
        w.all_reduces[self.rank] += 1

    def transfer_communicator(self, timeout_s: float) -> "ThreadCommunicator":
        """A fresh communicator; each has its own generation, so a stale message never matches."""
        self.generation += 1
        return ThreadCommunicator(self.w, self.rank, self.generation, timeout_s)


class ThreadCommunicator:
    """A transfer communicator: queued sends and receives, run by ``execute`` (timeout per receive)."""

    multi_rank = False
    name = "ep_transfer"

    def __init__(self, world: ThreadWorld, rank: int, generation: int, timeout_s: float) -> None:
        self.w, self.rank, self.gen, self.timeout = world, rank, generation, timeout_s
        self.world_size = world.world_size
        self.local_ranks = (rank,)
        self.ops: list = []

    def add_send(self, tensor, src, dst):
        """Queue ``tensor`` for rank ``dst`` (sent by ``execute``)."""
        self.ops.append(("send", tensor, dst))

    def add_recv(self, tensor, src, dst):
        """Queue a receive from rank ``src`` into ``tensor`` (filled by ``execute``)."""
        self.ops.append(("recv", tensor, src))

    def execute(self):
        """Send everything queued, then wait for every queued receive (``TimeoutError`` naming the peer)."""
        ops, self.ops = self.ops, []
        for kind, t, peer in ops:
            if kind == "send":
                self.w.queue((self.gen, self.rank, peer)).put(t.detach().clone())
        for kind, t, peer in ops:
            if kind == "recv":
                try:
                    t.copy_(self.w.queue((self.gen, peer, self.rank)).get(timeout=self.timeout))
                except queue.Empty:
                    raise TimeoutError(f"rank {self.rank}: no message from rank {peer}") from None

    def discard(self):
        """Drop the queued operations."""
        self.ops = []


def run_threads(world_size: int, body, timeout: float = 60.0) -> list:
    """Run body(rank, group) on ``world_size`` threads; return results by rank.

    ``timeout`` bounds the whole run; past it the barrier is broken (so ranks waiting in an
    all-reduce give up) and ``TimeoutError`` is raised. A rank's error is re-raised: the
    first that is not a ``BrokenBarrierError``, which only says another rank failed first.
    """
    # inf would pass a plain > 0 test and fail only in join, once the threads run
    try:
        timeout = check_seconds(timeout, "timeout")
    except ValueError:
        raise ValueError(f"timeout must be a finite number of seconds > 0 and <= {MAX_SECONDS:g}, "
                         f"got {timeout!r}") from None
    tw = ThreadWorld(world_size)
    results: list = [None] * world_size
    errors: list = [None] * world_size

    def target(rank):
        try:
            results[rank] = body(rank, tw.group(rank))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors[rank] = exc
            tw.barrier.abort()

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    late = [r for r, t in enumerate(threads) if t.is_alive()]
    if late:
        tw.barrier.abort()
        raise TimeoutError(f"rank thread(s) {late} did not finish within {timeout:g} s")
    failed = [exc for exc in errors if exc is not None]
    if failed:
        raise next((exc for exc in failed if not isinstance(exc, threading.BrokenBarrierError)), failed[0])
    return results
