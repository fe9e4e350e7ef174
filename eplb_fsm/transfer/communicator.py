"""How transfer messages travel: a small protocol and two implementations.

A :class:`Communicator` queues sends and receives, then runs them together with
``execute()``. Messages between the same (src, dst) pair and tag match in the order they
were queued on each side. The executor calls ``execute()`` (or ``start()``, then
``wait()``) once per wave on every rank; a communicator with ``supports_tags`` also
takes a ``tag`` per message and lets the executor ``start()`` a wave in two phases.

- :class:`TorchDistCommunicator`: one rank of a ``torch.distributed`` process group;
  ``execute`` posts the messages (with gloo each straight to the group's ``send``/``recv``,
  otherwise one ``dist.batch_isend_irecv``) and waits on every request, with a timeout.
  The backend is the one the group uses for the weights' device (:func:`backends_by_device`).
- :class:`InProcessCommunicator`: plays all G ranks of a group inside one process;
  ``execute`` matches the queued sends with the queued receives and copies. A mismatch
  (what would hang a real group) raises at once. It counts messages and bytes so tests
  can check that nothing moved that the plan did not need.
"""

from __future__ import annotations

import contextlib
import datetime
from collections import Counter, defaultdict
from typing import ContextManager, Mapping, Protocol, Sequence, runtime_checkable

import torch

from eplb_fsm.maps import check_seconds

__all__ = ["Communicator", "TorchDistCommunicator", "InProcessCommunicator", "backends_by_device",
           "torch_backend_defaults", "TransferError", "MessageMismatchError"]


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
    under), ``finish()`` (once at the end of each executor call: the full rearrangement,
    ``transfer_layer_to_buffer`` and ``commit_layer_from_buffer``), ``discard()`` (drop
    queued or started messages after a failure), ``use_device(device)`` (once per call,
    after the input checks, with the weights' device). ``supports_tags`` (attribute,
    default False): when true, ``add_send``/``add_recv`` take a ``tag`` keyword, messages
    pair by (src, dst, tag), and ``start()`` may run several times before ``wait()``; the
    executor then posts a layer's first wave in two phases (see ``execute.HeldReceives``).
    Weights a communicator cannot move are refused before anything moves: off the CPU
    when ``host_memory_only`` (attribute, default False; gloo), off CUDA when
    ``cuda_memory_only`` (NCCL), and with ``device_backends`` (``{device type: backend}``)
    on a device none serves, off the CPU where gloo serves it, off CUDA where NCCL does.
    """

    world_size: int
    local_ranks: tuple[int, ...]
    multi_rank: bool
    name: str

    def add_send(self, tensor: torch.Tensor, src: int, dst: int) -> None: ...

    def add_recv(self, tensor: torch.Tensor, src: int, dst: int) -> None: ...

    def execute(self) -> None: ...


def backends_by_device(backend: str, config: str | None = None, *, default_map: Mapping[str, str],
                       capability: Mapping[str, Sequence[str]], accelerator: str) -> dict[str, str]:
    """Which backend a group uses for each device type, e.g. ``{"cpu": "gloo", "cuda": "nccl"}``.

    ``backend``: what ``dist.get_backend(group)`` reports: one name (``"gloo"``), the per-device
    form (``"cpu:gloo,cuda:nccl"``) or ``"undefined"`` (no backend named). ``config``:
    ``dist.get_backend_config(group)`` if known (the per-device form torch built the group
    with); it settles ``"undefined"``, else that is ``default_map[accelerator]`` (torch's
    choice: NCCL on a CUDA machine, gloo on a CPU-only one). One name serves the devices
    ``capability[name]`` lists (cpu and cuda if none). Pure: :func:`torch_backend_defaults`
    gives this torch's ``default_map``, ``capability`` and ``accelerator``.
    """

    def parse(text: str) -> dict[str, str]:
        pairs = (pair.split(":") for pair in text.lower().split(","))
        return {p[0].strip(): p[1].strip() for p in pairs if len(p) == 2 and p[0].strip() and p[1].strip()}

    name = str(backend).strip().lower()
    if ":" in name:
        return parse(name)
    if name == "undefined":
        known = parse(str(config)) if config is not None else {}
        if known:
            return known
        default = default_map.get(accelerator)
        return {accelerator: str(default).lower()} if default else {}
    return {str(d): name for d in capability.get(name, ("cpu", "cuda"))}


def torch_backend_defaults() -> dict:
    """``default_map``, ``capability`` and ``accelerator`` for :func:`backends_by_device`, as this torch
    sets them (``dist.Backend``'s tables, the build's accelerator); fixed fallbacks where a name is missing."""
    import torch.distributed as dist

    tables = getattr(dist, "Backend", None)
    default_map = getattr(tables, "default_device_backend_map", None) or {"cpu": "gloo", "cuda": "nccl"}
    capability = getattr(tables, "backend_capability", None) or {"gloo": ["cpu", "cuda"], "nccl": ["cuda"]}
    current = getattr(getattr(torch, "accelerator", None), "current_accelerator", None)  # torch >= 2.6
    device = current() if current is not None else torch.device("cuda") if torch.cuda.is_available() else None
    return {"default_map": dict(default_map), "capability": dict(capability),
            "accelerator": device.type if device is not None else "cpu"}


def _backend_config(dist, group) -> str | None:
    """``dist.get_backend_config(group)``, or None where this torch lacks it or cannot say."""
    try:
        return str(dist.get_backend_config(group))
    except (RuntimeError, ValueError, TypeError, KeyError, AttributeError):  # backends_by_device's defaults then
        return None


class TorchDistCommunicator:
    """This rank's side of a ``torch.distributed`` group (``group=None``: the default group).

    ``timeout`` (seconds) bounds each wait on a request (gloo honours it; with NCCL it
    makes the wait block the CPU until completion or timeout). ``stream``: an optional
    CUDA stream the executor runs its copies and the batched requests on; ``finish()``
    then makes the caller's current stream wait for it. ``device_backends``: the backend
    per device type; the one for the weights' device (``use_device``; before it, the
    group's only backend) moves them. With NCCL the first ``start`` runs a barrier first,
    because NCCL requires every rank to take part in the first collective of a group and
    a wave may involve only some ranks; with gloo messages carry tags (``supports_tags``).
    """

    multi_rank = False

    def __init__(self, group: "torch.distributed.ProcessGroup | None" = None, *, timeout: float | None = None,
                 stream: "torch.cuda.Stream | None" = None, name: str = "world") -> None:
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
        # "undefined" or a per-device string says little by itself: what serves each device decides
        config = _backend_config(dist, self.group) if self.backend == "undefined" else None
        self.device_backends = backends_by_device(self.backend, config, **torch_backend_defaults())
        self.timeout = timeout
        self.stream = stream
        self.name = name
        self._ops: list = []
        self._works: list = []
        self._device: torch.device | None = None
        self._tags: bool | None = None
        self._warmed: set[str] = set()  # device types whose NCCL communicator a barrier set up
        self._global_ranks: tuple[int, ...] | None = None  # group rank -> global rank, at the first batch
        served = set(self.device_backends.values())
        # the backend moving the weights: the group's only one until use_device() names their device's
        self._serving: str | None = next(iter(served)) if len(served) == 1 else None
        # gloo's send and receive hand the tensor's address to its sockets as host memory,
        # whatever its device: on an all-gloo group weights on a GPU are refused before they are posted
        self.host_memory_only = served == {"gloo"}
        # NCCL moves GPU memory only: on an all-NCCL group weights off CUDA are refused likewise
        self.cuda_memory_only = served == {"nccl"}

    def use_device(self, device: "torch.device | str") -> None:
        """The weights' device (the executor's call, before anything moves): picks the backend that moves them."""
        self._device = torch.device(device)
        self._serving = self.device_backends.get(self._device.type)

    @property
    def supports_tags(self) -> bool:
        """True when gloo moves the weights: it pairs messages by (peer, tag), so the executor may post a
        wave in two phases. NCCL ignores tags and pairs by order: one batch per wave. Assignable (an A/B)."""
        return self._tags if self._tags is not None else self._serving == "gloo"

    @supports_tags.setter
    def supports_tags(self, value: bool) -> None:
        self._tags = bool(value)

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
        """Post the queued messages without waiting (see ``wait``).

        May be called several times before ``wait``: each call posts what was queued since
        the last one (the executor's two-phase posting; tags pair the messages). Where gloo
        serves the tensors' device they go straight to the group's ``send``/``recv`` (group
        ranks, same tags): gloo cannot coalesce, so ``batch_isend_irecv`` would post them one
        at a time anyway, after per-message Python checks. Otherwise: one ``batch_isend_irecv``.
        """
        ops, self._ops = self._ops, []
        kind = self._device.type if self._device is not None else "cuda"
        if self._serving == "nccl" and kind not in self._warmed:
            # every rank starts every wave, so this barrier is collective; on the weights'
            # device, so that a group using gloo for the CPU still sets NCCL up
            index = self._device.index if self._device is not None else None
            self._dist.barrier(group=self.group, **({"device_ids": [index]} if index is not None else {}))
            self._warmed.add(kind)
        if not ops:
            return
        backend = self._serving or self.device_backends.get(ops[0][1].device.type)   # no use_device(): the tensors'
        if backend == "gloo" and type(self.group) is self._dist.ProcessGroup:
            send, recv, works = self.group.send, self.group.recv, self._works
            for is_send, tensor, peer, tag in ops:
                works.append(send([tensor], peer, tag) if is_send else recv([tensor], peer, tag))
            return
        dist = self._dist
        if self._global_ranks is None:
            # P2POp takes a global rank as ``peer`` in every torch (``group_peer`` only from 2.6); once per group
            self._global_ranks = tuple(dist.get_global_rank(self.group, r) for r in range(self.world_size))
        glob = self._global_ranks
        p2p = [
            dist.P2POp(dist.isend if is_send else dist.irecv, tensor, glob[peer], group=self.group, tag=tag)
            for is_send, tensor, peer, tag in ops
        ]
        self._works.extend(dist.batch_isend_irecv(p2p) or ())

    def wait(self) -> None:
        """Wait for every started request (each wait bounded by ``timeout``)."""
        works, self._works = self._works, []
        timeout = None if self.timeout is None else datetime.timedelta(seconds=self.timeout)
        for work in works:
            work.wait() if timeout is None else work.wait(timeout)

    def execute(self) -> None:
        """Post the queued messages (``start``) and wait for all of them (``wait``)."""
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
