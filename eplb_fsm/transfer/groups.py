"""EP process groups built at run time from a shared TCP store (the plumbing of elastic EP).

``torch.distributed.init_process_group`` fixes its members once per process, so a rank
that starts later (a joiner) can never be part of the default group. Every EP group of an
elastic job is therefore built the same way: a gloo ``ProcessGroup`` object created from
a ``TCPStore`` the launcher (or rank 0) hosts, under a per-generation key prefix::

    <namespace>/g<generation>/ep            the EP group: all-reduces, forward passes
    <namespace>/g<generation>/transfer<n>   its n-th transfer group (weights, handover)
    <namespace>/g<generation>/handover      the state a joiner starts from (elastic.scaling)
    <namespace>/g<generation>/refused/<r>   why joiner r refused that state (elastic.handover)
    <namespace>/g<generation>/accepted/<r>  joiner r checked that state and builds the group next
    <namespace>/g<generation>/refused/any   the latest refusal by any process that read the handover
                                            (one started with a rank that is not a joiner's too)

Generation 0 is the job's first group; every scale request uses the next number, even
one that aborts, so no prefix is ever reused. Nothing here needs
``init_process_group``: the groups are plain objects the controller is handed
(``EplbController(config, group=StoreGroup(...))``). Every wait is bounded: building a
group (all members must connect within ``timeout_s``), each collective, each message.

- :class:`StoreInfo` / :func:`connect_store`: where the store is (picklable, for a new
  process) and a client connection to it.
- :class:`StoreGroup`: one generation's EP group on this rank: ``rank``, ``world_size``,
  ``all_reduce(tensor, timeout_s)`` (sum, in place), ``transfer_communicator(timeout_s)``
  (a fresh gloo group over the same ranks for point-to-point transfers) and
  ``successor(generation, rank, world_size, timeout_s)`` (the next generation's group).
- :class:`PgCommunicator`: the transfer ``Communicator`` over such a group.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch

from eplb_fsm.maps import check_seconds
from eplb_fsm.run_identity import backend_grace

__all__ = ["StoreInfo", "connect_store", "host_store", "StoreGroup", "PgCommunicator", "GroupBuildError",
           "group_trace_name", "check_namespace"]


class GroupBuildError(RuntimeError):
    """A group could not be built in time (a member never connected, or the store failed)."""


@dataclass(frozen=True)
class StoreInfo:
    """Where the job's TCP store listens (picklable: what a new process needs to reach it)."""

    host: str
    port: int
    namespace: str = "eplb"

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"store host must be a non-empty string, got {self.host!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 < self.port < 65536:
            raise ValueError(f"store port must be an int in [1, 65535], got {self.port!r}")
        check_namespace(self.namespace, "store namespace")  # the rule StoreGroup and the joiner apply


def check_namespace(namespace: Any, what: str = "namespace") -> str:
    """The rule for a group's store prefix (``StoreGroup`` and a joiner on a raw store share it, so a joiner
    reaches every serving group that could be built): a non-empty string; ValueError naming ``what`` else.
    Slashes are allowed (``job/eplb``): every key under it is ``<namespace>/g<generation>/...``, whatever it holds.
    """
    if not isinstance(namespace, str) or not namespace:
        raise ValueError(f"{what} must be a non-empty string (the EP group's store key prefix), got {namespace!r}")
    return namespace


def _delta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=float(seconds))


def _check_timeout(timeout_s: Any) -> float:
    return check_seconds(timeout_s, "timeout_s")  # inf too: it overflows the store's timedelta


def host_store(host: str = "127.0.0.1", port: int = 0, timeout_s: float = 60.0, namespace: str = "eplb"):
    """Start a TCP store master in this process: ``(store, StoreInfo)`` (``port=0``: any free port).

    Keep the store object alive as long as any group built on it is in use.
    """
    from torch.distributed import TCPStore

    store = TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=_delta(_check_timeout(timeout_s)))
    return store, StoreInfo(host, int(store.port), namespace)


def connect_store(info: StoreInfo, timeout_s: float = 60.0):
    """A client connection to the store ``info`` names (``timeout_s`` bounds connecting and every wait)."""
    from torch.distributed import TCPStore

    if not isinstance(info, StoreInfo):
        raise ValueError(f"store info must be a StoreInfo, got {type(info).__name__}")
    try:
        return TCPStore(info.host, info.port, is_master=False, timeout=_delta(_check_timeout(timeout_s)))
    except Exception as exc:
        raise GroupBuildError(f"cannot reach the store at {info.host}:{info.port}: {exc}") from exc


def group_trace_name(base: str, generation: int) -> str:
    """Trace name of a group of a generation: ``ep`` for generation 0, ``ep@<g>`` after."""
    return base if generation == 0 else f"{base}@{generation}"


def _gloo(store: Any, prefix: str, rank: int, world_size: int, timeout_s: float):
    from torch.distributed import PrefixStore, ProcessGroupGloo

    try:
        return ProcessGroupGloo(PrefixStore(prefix, store), rank, world_size, _delta(timeout_s))
    except Exception as exc:
        raise GroupBuildError(
            f"group {prefix!r} (rank {rank} of {world_size}) was not complete within {timeout_s:g} s: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def _forget_address(store: Any, prefix: str, rank: int) -> None:
    """Delete this rank's address from a failed build's rendezvous (gloo's key ``<device>/<rank>``, one
    device). The retry builds under the same prefix; a peer that read the stale address there would
    connect to a closed socket and fail that build too. Best effort: a key not there is no error."""
    try:
        store.delete_key(f"{prefix}/0/{rank}")
    except Exception:  # the store itself is gone: the retry fails on that, not on this
        pass


class StoreGroup:
    """This rank's member of one generation's EP group, a gloo group over a TCP store.

    Building it is collective: every one of the ``world_size`` members must construct
    theirs (same store, namespace, generation) within ``timeout_s``, else each raises
    :class:`GroupBuildError`. ``trace_name`` (``ep``, ``ep@1``, ...) is what the trace
    calls it; its transfer groups are ``ep_transfer`` / ``ep_transfer@1`` (the controller
    names them).
    """

    def __init__(self, store: Any, generation: int, rank: int, world_size: int, timeout_s: float = 60.0,
                 *, namespace: str = "eplb", info: StoreInfo | None = None) -> None:
        for name, value, low in (("generation", generation, 0), ("world_size", world_size, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
        self.timeout_s = _check_timeout(timeout_s)
        check_namespace(namespace)
        self.store = store
        self.info = info
        self.namespace = namespace
        self.generation = int(generation)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.prefix = f"{namespace}/g{generation}"
        self.trace_name = group_trace_name("ep", self.generation)
        self._transfers = 0
        self.pg = _gloo(store, f"{self.prefix}/ep", self.rank, self.world_size, self.timeout_s)

    @classmethod
    def connect(cls, info: StoreInfo, generation: int, rank: int, world_size: int,
                timeout_s: float = 60.0) -> "StoreGroup":
        """Connect to the store ``info`` names and build the group there."""
        store = connect_store(info, timeout_s)
        return cls(store, generation, rank, world_size, timeout_s, namespace=info.namespace, info=info)

    def successor(self, generation: int, rank: int, world_size: int, timeout_s: float | None = None) -> "StoreGroup":
        """The group of a later generation on the same store (collective over its members)."""
        if generation <= self.generation:
            raise ValueError(f"generation must be > {self.generation} (the current one), got {generation}")
        return StoreGroup(self.store, generation, rank, world_size,
                          self.timeout_s if timeout_s is None else timeout_s,
                          namespace=self.namespace, info=self.info)

    def key(self, name: str, generation: int | None = None) -> str:
        """A store key of a generation (default: this one), e.g. its ``handover``."""
        return f"{self.namespace}/g{self.generation if generation is None else generation}/{name}"

    # -- the controller's group protocol ---------------------------------
    def all_reduce(self, tensor: torch.Tensor, timeout_s: float) -> None:
        """Sum ``tensor`` (CPU) over the group in place; raise on error or after ``timeout_s``."""
        import torch.distributed as dist

        if self.pg is None:
            raise RuntimeError(f"group {self.trace_name} is closed")
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        opts.timeout = _delta(timeout_s)  # gloo's own bound on each of the algorithm's waits, not only on this one
        work = self.pg.allreduce([tensor], opts)
        # never give up before gloo does: a peer could read a sum this rank gave up on (run_identity.backend_grace)
        work.wait(_delta(timeout_s + backend_grace(tensor, timeout_s, self.world_size)))

    def transfer_communicator(self, timeout_s: float, build_timeout_s: float | None = None) -> "PgCommunicator":
        """A new gloo group over the same ranks for point-to-point transfers (collective).

        ``timeout_s`` bounds each message; ``build_timeout_s`` (default: the same) bounds
        connecting. Each call builds a fresh one (``transfer0``, ``transfer1``, ...): after
        a failed transfer the old one's pairs may be closed. The number counts only groups
        built: a rank whose build failed (a peer never came) must not pair its next try,
        ``transfer<n>``, with its peers' ``transfer<n+1>``.
        """
        n = self._transfers
        build = _check_timeout(timeout_s if build_timeout_s is None else build_timeout_s)
        prefix = f"{self.prefix}/transfer{n}"
        try:
            pg = _gloo(self.store, prefix, self.rank, self.world_size, build)
        except GroupBuildError:
            _forget_address(self.store, prefix, self.rank)
            raise
        self._transfers = n + 1
        return PgCommunicator(pg, self.rank, self.world_size, timeout_s, name=f"{self.trace_name}/transfer{n}")

    def abandon_transfer(self) -> None:
        """Give back the number of the last transfer group built here, which a peer failed to build (the
        caller learnt it in an agreement): the retry builds under the same number as every peer, and this
        rank's address leaves that rendezvous first (a peer must not read it there and connect to a group
        that is gone). Callers agree before every retry, so the address is gone before any peer retries."""
        if self._transfers > 0:
            self._transfers -= 1
            _forget_address(self.store, f"{self.prefix}/transfer{self._transfers}", self.rank)

    def close(self) -> None:
        """Drop the gloo group (this rank stops using it; the others are not told)."""
        self.pg = None

    def __repr__(self) -> str:
        return f"StoreGroup({self.trace_name}, rank {self.rank} of {self.world_size})"


class PgCommunicator:
    """The transfer ``Communicator`` (see ``eplb_fsm.transfer.communicator``) over a raw gloo group.

    Messages between a pair match in the order both sides queue them: each gets a tag
    equal to its position among the pair's messages of the batch.
    """

    multi_rank = False

    def __init__(self, pg: Any, rank: int, world_size: int, timeout_s: float, *, name: str = "ep_transfer") -> None:
        self.pg = pg
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.local_ranks = (self.rank,)
        self.timeout = _check_timeout(timeout_s)
        self.name = name
        # gloo reads a tensor's address as host memory: the executor refuses weights off the CPU
        self.backend = "gloo"
        self.host_memory_only = True
        self._ops: list[tuple[str, torch.Tensor, int]] = []
        self._works: list = []

    def add_send(self, tensor: torch.Tensor, src: int, dst: int) -> None:
        if src != self.rank:
            raise ValueError(f"src: this communicator is rank {self.rank}, cannot send as rank {src}")
        if not 0 <= dst < self.world_size or dst == self.rank:
            raise ValueError(f"dst: rank {dst} is not a peer in a group of {self.world_size}")
        self._ops.append(("send", tensor, dst))

    def add_recv(self, tensor: torch.Tensor, src: int, dst: int) -> None:
        if dst != self.rank:
            raise ValueError(f"dst: this communicator is rank {self.rank}, cannot receive as rank {dst}")
        if not 0 <= src < self.world_size or src == self.rank:
            raise ValueError(f"src: rank {src} is not a peer in a group of {self.world_size}")
        self._ops.append(("recv", tensor, src))

    def start(self) -> None:
        """Post every queued message without waiting."""
        ops, self._ops = self._ops, []
        counters: dict[tuple[str, int], int] = {}
        for kind, tensor, peer in ops:
            tag = counters.get((kind, peer), 0)
            counters[(kind, peer)] = tag + 1
            if kind == "send":
                self._works.append(self.pg.send([tensor], peer, tag))
            else:
                self._works.append(self.pg.recv([tensor], peer, tag))

    def wait(self) -> None:
        """Wait for every posted message, each wait bounded by the timeout."""
        works, self._works = self._works, []
        for work in works:
            work.wait(_delta(self.timeout))

    def execute(self) -> None:
        self.start()
        self.wait()

    def discard(self) -> None:
        self._ops = []
        self._works = []
