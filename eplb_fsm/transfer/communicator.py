"""How transfer messages travel: a small protocol and two implementations.

A :class:`Communicator` queues sends and receives, then runs them together with
``execute()``. Messages between the same (src, dst) pair and tag match in the order they
were queued on each side. The executor calls ``execute()`` (or ``start()``, then
``wait()``) once per wave on every rank; a communicator with ``supports_tags`` also
takes a ``tag`` per message and lets the executor ``start()`` a wave in two phases.

- :class:`TorchDistCommunicator`: one rank of a ``torch.distributed`` process group;
  ``execute`` issues one ``dist.batch_isend_irecv`` and waits on every request, with a
  timeout where the backend honours one (gloo on CPU, NCCL on CUDA).
- :class:`InProcessCommunicator`: plays all G ranks of a group inside one process;
  ``execute`` matches the queued sends with the queued receives and copies. A mismatch
  (what would hang a real group) raises at once. It counts messages and bytes so tests
  can check that nothing moved that the plan did not need.
"""

from __future__ import annotations

import contextlib
import datetime
from collections import Counter, defaultdict
from typing import ContextManager, Protocol, Sequence, runtime_checkable

import torch

from eplb_fsm.maps import check_seconds

__all__ = [
    "Communicator",
    "TorchDistCommunicator",
    "InProcessCommunicator",
    "TransferError",
    "MessageMismatchError",
]


class TransferError(RuntimeError):
    """A transfer failed (timeout, backend error, mismatched messages).

    ``layer`` is the layer whose transfer failed, ``wave`` the wave index in it;
    ``committed_layers`` (set by the executor) counts the layers already committed: those
    hold their new weights, the rest still hold their old ones.
    """

    def __init__(self, message: str, layer: int | None = None, wave: int | None = None, committed_layers: int = 0):
        super().__init__(message)
        self.layer = layer
        self.wave = wave
        self.committed_layers = committed_layers


class MessageMismatchError(RuntimeError):
    """Queued sends and receives do not pair up (a real process group would hang)."""


@runtime_checkable
class Communicator(Protocol):
    """Queue point-to-point messages, then run them as one batch.

    ``world_size``: ranks in the group the transfer runs in. ``local_ranks``: the ranks
    whose weights this process holds (one rank for a process group, all of them for the
    in-process communicator). ``multi_rank``: when True the executor expects weights as
    a list over ``local_ranks``. ``name``: the group name stamped on trace records.
    ``src``/``dst`` are ranks of that group.

    Optional hooks the executor uses when present: ``start()`` and ``wait()`` (``execute``
    split in two, so that local copies and the next layer's planning overlap the messages
    in flight), ``stream_context()`` (a context manager the copies and messages run
    under), ``finish()`` (called after a layer's commit) and ``discard()`` (drop queued or
    started messages after a failure). ``supports_tags`` (attribute, default False): when
    true, ``add_send``/``add_recv`` take a ``tag`` keyword, messages pair by (src, dst,
    tag), and ``start()`` may run several times before ``wait()``; the executor then
    posts a layer's first wave in two phases (see ``execute.HeldReceives``).
    ``host_memory_only`` (attribute, default False): when true, the communicator moves CPU
    tensors only (a gloo group), and weights on another device are refused before
    anything moves. ``cuda_memory_only`` (attribute, default False): likewise for CUDA
    tensors (an NCCL group): weights off CUDA are refused before anything moves.
    """

    world_size: int
    local_ranks: tuple[int, ...]
    multi_rank: bool
    name: str

    def add_send(self, tensor: torch.Tensor, src: int, dst: int) -> None: ...

    def add_recv(self, tensor: torch.Tensor, src: int, dst: int) -> None: ...

    def execute(self) -> None: ...


class TorchDistCommunicator:
    """This rank's side of a ``torch.distributed`` group (``group=None``: the default group).

    ``timeout`` (seconds) bounds each wait on a request (gloo honours it; with NCCL it
    makes the wait block the CPU until completion or timeout). ``stream``: an optional
    CUDA stream the executor runs its copies and the batched requests on; ``finish()``
    then makes the caller's current stream wait for it. With NCCL the first ``execute`` on
    a group runs a barrier first, because NCCL requires every rank to take part in the
    first collective of a group and a wave may involve only some ranks.
    """

    multi_rank = False

    def __init__(
        self,
        group: "torch.distributed.ProcessGroup | None" = None,
        *,
        timeout: float | None = None,
        stream: "torch.cuda.Stream | None" = None,
        name: str = "world",
    ) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("group: torch.distributed is not initialized (call init_process_group first)")
        if timeout is not None:  # inf or nan would fail only in wait(), after messages are out
            timeout = check_seconds(timeout, "timeout")
        self._dist = dist
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        if self.rank < 0:
            raise ValueError("group: this process is not a member of the given process group")
        self.world_size = dist.get_world_size(self.group)
        self.local_ranks = (self.rank,)
        self.backend = str(dist.get_backend(self.group)).lower()
        self.timeout = timeout
        self.stream = stream
        self.name = name
        self._ops: list = []
        self._works: list = []
        self._warmed = self.backend != "nccl"
        # add_send/add_recv honour ``tag`` and ``start`` may run several times before
        # ``wait`` (the executor's two-phase posting). gloo pairs messages by (peer, tag);
        # NCCL ignores tags and pairs by order, so it keeps one batch per wave.
        self.supports_tags = self.backend == "gloo"
        # gloo's send and receive hand the tensor's address to its sockets as host memory,
        # whatever its device: weights on a GPU must be refused before they are posted
        self.host_memory_only = self.backend == "gloo"
        # NCCL moves GPU memory only: weights off CUDA are refused before anything is posted
        self.cuda_memory_only = self.backend == "nccl"

    def add_send(self, tensor: torch.Tensor, src: int, dst: int, tag: int = 0) -> None:
        if src != self.rank:
            raise ValueError(f"src: this communicator is rank {self.rank}, cannot send as rank {src}")
        self._ops.append((True, tensor, dst, tag))

    def add_recv(self, tensor: torch.Tensor, src: int, dst: int, tag: int = 0) -> None:
        if dst != self.rank:
            raise ValueError(f"dst: this communicator is rank {self.rank}, cannot receive as rank {dst}")
        self._ops.append((False, tensor, src, tag))

    def add_ops(self, rank: int, ops: Sequence[tuple[bool, torch.Tensor, int, int]]) -> None:
        """Queue several messages of this rank at once: ``(is_send, tensor, peer, tag)`` each,
        the same as ``add_send(tensor, rank, peer, tag=tag)`` / ``add_recv(tensor, peer, rank, tag=tag)``."""
        if rank != self.rank:
            raise ValueError(f"rank: this communicator is rank {self.rank}, cannot post as rank {rank}")
        self._ops.extend(ops)

    def start(self) -> None:
        """Issue the queued messages as one batch without waiting (see ``wait``).

        May be called several times before ``wait``: each call issues what was queued
        since the last one (the executor's two-phase posting; tags pair the messages).
        gloo has no coalescing, so ``batch_isend_irecv`` would post one message at a
        time anyway; the messages go straight to the group's ``send``/``recv`` (group
        ranks, same tags), which skips that function's per-message Python checks.
        """
        ops, self._ops = self._ops, []
        if not self._warmed:
            # every rank starts every wave, so this barrier is collective
            self._dist.barrier(group=self.group)
            self._warmed = True
        if not ops:
            return
        if self.backend == "gloo" and type(self.group) is self._dist.ProcessGroup:
            send, recv, works = self.group.send, self.group.recv, self._works
            for is_send, tensor, peer, tag in ops:
                works.append(send([tensor], peer, tag) if is_send else recv([tensor], peer, tag))
            return
        dist = self._dist
        p2p = [
            dist.P2POp(dist.isend if is_send else dist.irecv, tensor, group=self.group, group_peer=peer, tag=tag)
            for is_send, tensor, peer, tag in ops
        ]
        self._works.extend(dist.batch_isend_irecv(p2p) or ())

    def wait(self) -> None:
        """Wait for every started request (each wait bounded by ``timeout``)."""
        works, self._works = self._works, []
        if self.timeout is None:
            for work in works:
                work.wait()
            return
        timeout = datetime.timedelta(seconds=self.timeout)
        for work in works:
            work.wait(timeout)

    def execute(self) -> None:
        """Issue the queued messages as one batch and wait for all of them."""
        self.start()
        self.wait()

    def stream_context(self) -> ContextManager:
        if self.stream is None:
            return contextlib.nullcontext()
        # the side stream must see everything queued before on the caller's stream
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        return torch.cuda.stream(self.stream)

    def finish(self) -> None:
        """Make the caller's current CUDA stream wait for the transfer stream (no-op on CPU)."""
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)

    def discard(self) -> None:
        """Forget queued and started messages (after a failure; the group may be unusable)."""
        self._ops = []
        self._works = []


class InProcessCommunicator:
    """All ranks of a group in one process: messages are matched and copied by ``execute``.

    Counters (cumulative until ``reset_counters``): ``messages[(src, dst)]`` and
    ``bytes[(src, dst)]`` delivered, ``executes`` (calls to ``execute`` or ``wait``: one per wave).
    """

    multi_rank = True
    supports_tags = True  # messages pair by (src, dst, tag), in queue order within one

    def __init__(self, world_size: int, *, name: str = "world") -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size: must be a positive int, got {world_size!r}")
        self.world_size = world_size
        self.local_ranks = tuple(range(world_size))
        self.name = name
        self._sends: dict[tuple[int, int], list[torch.Tensor]] = defaultdict(list)
        self._recvs: dict[tuple[int, int], list[torch.Tensor]] = defaultdict(list)
        self.messages: Counter = Counter()
        self.bytes: Counter = Counter()
        self.executes = 0

    def _check(self, src: int, dst: int) -> None:
        for name, r in (("src", src), ("dst", dst)):
            if not 0 <= r < self.world_size:
                raise ValueError(f"{name}: rank {r} is outside the group of {self.world_size}")
        if src == dst:
            raise ValueError(f"src: rank {src} cannot message itself")

    def add_send(self, tensor: torch.Tensor, src: int, dst: int, tag: int = 0) -> None:
        self._check(src, dst)
        self._sends[(src, dst, tag)].append(tensor)

    def add_recv(self, tensor: torch.Tensor, src: int, dst: int, tag: int = 0) -> None:
        self._check(src, dst)
        self._recvs[(src, dst, tag)].append(tensor)

    def _deliver(self, final: bool) -> None:
        """Copy every message whose (src, dst, tag) has as many receives as sends queued.

        ``final``: anything left unpaired raises :class:`MessageMismatchError` (a real
        group would hang), before any copy. Otherwise unpaired messages stay queued for a
        later ``start``/``wait`` (the other side posts them in a second phase).
        """
        sends, recvs = self._sends, self._recvs
        ready = []
        for key in sorted(set(sends) | set(recvs)):
            out, inn = sends.get(key, []), recvs.get(key, [])
            if len(out) != len(inn):
                if final:
                    raise MessageMismatchError(
                        f"rank {key[0]} queued {len(out)} sends to rank {key[1]}, which queued "
                        f"{len(inn)} receives from it (a process group would hang)"
                    )
                continue
            for i, (a, b) in enumerate(zip(out, inn)):
                if a.dtype != b.dtype or a.shape != b.shape:
                    raise MessageMismatchError(
                        f"message {i} from rank {key[0]} to rank {key[1]}: sent {a.dtype}{tuple(a.shape)}, "
                        f"receive buffer is {b.dtype}{tuple(b.shape)}"
                    )
            ready.append(key)
        for key in ready:
            for a, b in zip(sends.pop(key, []), recvs.pop(key, [])):
                b.copy_(a)
                self.messages[key[:2]] += 1
                self.bytes[key[:2]] += a.numel() * a.element_size()

    def execute(self) -> None:
        """Deliver every queued message; raise MessageMismatchError if they do not pair up."""
        self.executes += 1
        try:
            self._deliver(final=True)
        finally:
            self.discard()

    def start(self) -> None:
        """Deliver what already pairs up (there is nothing to overlap with in one process)."""
        self._deliver(final=False)

    def wait(self) -> None:
        """Deliver the rest; raise MessageMismatchError if anything is left unpaired."""
        self.executes += 1
        try:
            self._deliver(final=True)
        finally:
            self.discard()

    def stream_context(self) -> ContextManager:
        return contextlib.nullcontext()

    def finish(self) -> None:
        return None

    def discard(self) -> None:
        self._sends = defaultdict(list)
        self._recvs = defaultdict(list)

    def reset_counters(self) -> None:
        self.messages = Counter()
        self.bytes = Counter()
        self.executes = 0

    @property
    def total_messages(self) -> int:
        return int(sum(self.messages.values()))
