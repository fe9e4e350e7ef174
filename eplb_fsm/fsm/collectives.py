"""The controller's collectives: which EP group it talks on, its all-reduce, its transfer group.

Two kinds of group reach the controller: a ``torch.distributed`` process group (or ``None``: the default group if one
is initialized, else a single rank), or a *collective group* object with ``rank``, ``world_size``,
``all_reduce(tensor, timeout_s)`` and ``transfer_communicator(timeout_s)`` (an engine's own communication layer, the
elastic ``transfer.groups.StoreGroup``, in-process ranks in tests).

The controller owns one :class:`Collectives` (``controller.collectives``). Every agreement between ranks goes through
its :meth:`Collectives.all_reduce`: one float64 all-reduce (sum) of the named parts, concatenated, so a step that needs
several shared values still issues a single collective. A failure or timeout there raises :class:`GroupBroken`: the EP
group can no longer be trusted. Elastic EP moves the object to another group (:meth:`Collectives.switch`) or agrees
once on a group it has not moved to yet (:meth:`Collectives.on`); fault injection wraps the object.
"""

from __future__ import annotations

import datetime
from typing import Any, Callable

import torch

from eplb_fsm.fsm.subgroups import pad_registered_groups
from eplb_fsm.fsm.worker import run_niced
from eplb_fsm.run_identity import backend_grace, group_sum, start_sum
from eplb_fsm.transfer import InProcessCommunicator, TorchDistCommunicator

__all__ = ["GROUP_NAME", "TRANSFER_GROUP_NAME", "LOCAL_GROUP_NAME", "GroupBroken", "PostedReduce", "Collectives",
           "flags", "is_collective_group", "resolve_group"]

GROUP_NAME = "ep"                 # trace name of the EP group (the engine's)
TRANSFER_GROUP_NAME = "ep_transfer"  # trace name of the controller's own transfer group
LOCAL_GROUP_NAME = "local"        # trace name when there is no process group (world 1)


class GroupBroken(RuntimeError):
    """A collective on the EP group failed or timed out: the group is no longer trusted."""


def flags(*values: float) -> torch.Tensor:
    """A (len(values),) float64 CPU tensor: per-rank counts that an all-reduce sums into shared ones."""
    return torch.tensor([float(v) for v in values], dtype=torch.float64)


def is_collective_group(group: Any) -> bool:
    """True for a group object that brings its own all-reduce and transfer communicator."""
    return callable(getattr(group, "all_reduce", None)) and callable(getattr(group, "transfer_communicator", None))


def resolve_device(device: Any) -> torch.device:
    """``device`` (None: the CPU) as a ``torch.device``; ``ValueError`` naming ``device`` otherwise."""
    if device is None:
        return torch.device("cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device: {device!r} is not a torch device ({exc})") from None
    # refused here, before the trace header names it, rather than by the first tensor made on it
    if resolved.type == "meta":
        raise ValueError("device: 'meta' holds no data, and the load counters and maps need a real device")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} needs CUDA, and torch.cuda.is_available() is False here")
    return resolved


def resolve_group(group: Any) -> tuple[Any, int, int]:
    """``(group, rank, world)`` for what the engine passed (``None``: default group or a single rank)."""
    if group is not None and is_collective_group(group):
        rank, world = int(group.rank), int(group.world_size)
        if not 0 <= rank < world:
            raise ValueError(f"group: rank {rank} is outside a group of {world}")
        return group, rank, world
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch without distributed
        dist = None
    if group is None and dist is not None and dist.is_available() and dist.is_initialized():
        group = dist.group.WORLD
    if group is None:
        return None, 0, 1
    if dist is None or not isinstance(group, dist.ProcessGroup):
        raise ValueError("group must be a torch.distributed process group or an object with rank, world_size, "
                         "all_reduce(tensor, timeout_s) and transfer_communicator(timeout_s); "
                         f"got {type(group).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the given process group")
    return group, rank, dist.get_world_size(group)


class Collectives:
    """This rank's EP group: the all-reduce every agreement goes through, and the transfer group.

    ``group``: what :func:`resolve_group` returned (a torch group, a collective-group object or None); ``trace``: the
    rank's trace (collectives are recorded there); ``device``: the controller's device (an NCCL all-reduce runs there,
    else on the CPU); ``timeout_s``: the transfer group's timeout; ``generation``: the group's number (elastic).
    """

    def __init__(self, group: Any, rank: int, world_size: int, trace: Any, device: torch.device,
                 timeout_s: float, name: str, generation: int = 0, transfer_nice: int = 0) -> None:
        self.group = group
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.trace = trace
        self.device = device
        self.timeout_s = float(timeout_s)
        self.name = name                    # trace name of the EP group
        self.generation = int(generation)
        self.custom = group is not None and is_collective_group(group)
        self.transfer_group = None          # torch groups only: the process group transfers run on
        self.communicator: Any = None       # what weight transfers use (``transfer.Communicator``)
        self.transfer_generation = -1       # how many times the transfer group was re-created
        # async_worker_nice: the torch transfer group is built on a thread niced by this much, so the backend
        # threads that move the weights yield to the engine as the worker does
        self.transfer_nice = int(transfer_nice)
        self.comm_device = self._collective_device()
        # elastic EP: caps every all-reduce's timeout by the time left before the scale's deadline
        # (eplb_fsm.elastic.bounds); None outside a scale
        self.cap: Callable[[float], float] | None = None

    def _collective_device(self) -> torch.device:
        """Where the all-reduce buffer lives: the controller's device for NCCL, else the CPU."""
        if self.group is None or self.custom:
            return torch.device("cpu")
        import torch.distributed as dist

        backend = str(dist.get_backend(self.group)).lower()
        return self.device if backend == "nccl" else torch.device("cpu")

    def all_reduce(self, parts: dict[str, torch.Tensor], timeout_s: float, **fields: Any) -> dict[str, torch.Tensor]:
        """Sum ``parts`` over the EP group in ONE all-reduce (float64, concatenated).

        ``parts``: name -> tensor of any shape; returns name -> the summed tensor, same
        shape (float64, on the collective device). ``fields`` go into its trace records
        (e.g. ``layer`` for a layer's agreement). Raises :class:`GroupBroken` if the
        collective raises or does not finish in time.
        """
        return self.post(parts, timeout_s, blocking=True, **fields).wait()

    def post(self, parts: dict[str, torch.Tensor], timeout_s: float, *, blocking: bool = False,
             **fields: Any) -> "PostedReduce":
        """Issue the same all-reduce as :meth:`all_reduce` without waiting for it; read it with ``wait()``.

        On a torch group the sum runs in the backend (gloo's threads, NCCL's stream) while
        the caller goes on, e.g. into the engine's next forward; its ``collective_start``
        is written now with ``posted=True`` and its end when :meth:`PostedReduce.wait`
        returns, on a later step. A collective-group object (or no group) has no
        non-blocking all-reduce: the sum is done here and ``wait()`` hands it over. Issue
        raises :class:`GroupBroken` like :meth:`all_reduce`; so does ``wait()``.
        """
        if self.cap is not None:
            timeout_s = self.cap(timeout_s)
        names = list(parts)
        shapes = [parts[n].shape for n in names]
        flat = [parts[n].reshape(-1).to(device=self.comm_device, dtype=torch.float64) for n in names]
        sizes = [t.numel() for t in flat]
        buf = torch.cat(flat) if len(flat) > 1 else flat[0].clone()
        posted = PostedReduce(self, names, shapes, sizes, buf, timeout_s)
        native = self.group is not None and not self.custom
        if not native:
            blocking = True
        if not blocking:
            fields = dict(fields, posted=True)
        posted.opened = self.trace.open_collective("all_reduce", group=self.name, shape=tuple(buf.shape),
                                                   dtype=buf.dtype, parts=names, sizes=sizes, **fields)
        try:
            if self.custom:
                self.group.all_reduce(buf, timeout_s)
            elif native:
                posted.work = start_sum(self.group, buf, timeout_s)
                posted.grace = backend_grace(buf, timeout_s, self.world_size)
            if blocking:
                posted.finish()
        except Exception as exc:
            posted.fail(exc)
        except BaseException as exc:   # a KeyboardInterrupt: its record ends, the interrupt goes on
            posted.fail(exc)
            raise
        return posted

    def on(self, group: Any) -> "Collectives":
        """The same traced all-reduce on a collective-group object this rank has not moved to yet."""
        other = Collectives(group, int(group.rank), int(group.world_size), self.trace, self.device,
                            self.timeout_s, getattr(group, "trace_name", self.name),
                            int(getattr(group, "generation", self.generation)))
        other.cap = self.cap
        return other

    def switch(self, group: Any, communicator: Any, rank: int, world_size: int) -> None:
        """Move to another collective-group object (elastic EP) and its transfer communicator."""
        self.group = group
        self.custom = is_collective_group(group)
        self.comm_device = self._collective_device()
        self.rank, self.world_size = int(rank), int(world_size)
        self.generation = int(getattr(group, "generation", self.generation))
        self.name = getattr(group, "trace_name", self.name)
        self.transfer_generation = 0
        self.communicator = communicator
        self.name_communicator()

    def adopt(self, group: Any) -> None:
        """Take a group the engine rebuilt in place of a broken one (``recover(group=...)``): same rank and
        size; its trace name is the old one's with ``.<n>`` (``ep.1``), so its ``cseq`` starts from 0."""
        self.group = group
        self.custom = is_collective_group(group)
        self.comm_device = self._collective_device()
        base, dot, suffix = self.name.rpartition(".")
        base, count = (base, int(suffix)) if dot and suffix.isdigit() else (self.name, 0)
        self.name = f"{base}.{count + 1}"

    def save(self) -> tuple:
        """What :meth:`restore` needs to come back to this group (elastic EP rolls back a scale-up)."""
        return (self.group, self.custom, self.comm_device, self.rank, self.world_size, self.generation, self.name,
                self.transfer_generation, self.communicator)

    def restore(self, saved: tuple) -> None:
        (self.group, self.custom, self.comm_device, self.rank, self.world_size, self.generation, self.name,
         self.transfer_generation, self.communicator) = saved

    # ------------------------------------------------------------ transfer group
    @property
    def transfer_group_name(self) -> str:
        """Trace name of the current transfer group: ``ep_transfer``, then ``ep_transfer.<n>`` after resets."""
        if self.group is None:
            return LOCAL_GROUP_NAME
        gen = self.transfer_generation
        base = TRANSFER_GROUP_NAME if self.generation == 0 else f"{TRANSFER_GROUP_NAME}@{self.generation}"
        return base if gen <= 0 else f"{base}.{gen}"

    def new_transfer_group(self, wait_all: bool = True) -> None:
        """(Re)create the process group the weight transfers run on (collective over the EP ranks).

        Each new group gets a new trace name, so its collective sequence (``cseq``) starts from 0 on every rank
        whatever the old group saw. ``wait_all``: end with :meth:`wait_all_built`; a joiner of a scale-up passes False,
        since its build pairs with the serving ranks' in their handover, whose next all-reduce is that wait. Nothing
        changes when it raises: the generation counts groups every rank built, so a rank whose build failed names its
        retry as its peers name theirs.
        """
        old = self.transfer_generation
        self.transfer_generation = old + 1     # the name the new group is built under
        transfer_group = None
        communicator: Any = None
        try:
            error: Exception | None = None
            try:
                if self.group is None:
                    communicator = InProcessCommunicator(1, name=LOCAL_GROUP_NAME)
                elif self.custom:
                    communicator = self.group.transfer_communicator(self.timeout_s)
                    self.name_communicator(communicator)
                else:
                    transfer_group = self._new_torch_group()
                    # no stream of its own: in async mode the worker already runs each job on its stream
                    communicator = TorchDistCommunicator(transfer_group, timeout=self.timeout_s,
                                                         name=self.transfer_group_name)
            except Exception as exc:
                if not (wait_all and self.group is not None):
                    raise
                error = exc   # still joins the agreement below: its peers must learn it, not time out
            if wait_all and self.group is not None:
                failed = self.wait_all_built(error is not None)
                if error is not None:
                    raise error
                if failed:   # built here, not on a peer (gloo can return on some ranks only): nobody keeps it
                    from eplb_fsm.transfer.groups import GroupBuildError

                    raise GroupBuildError(f"transfer group {self.transfer_group_name} was not built on {failed} "
                                          "other rank(s)")
        except BaseException:
            self.transfer_generation = old
            if transfer_group is not None:
                # torch names a locally synchronized group after how many groups exist: one a peer
                # could not build would shift every later name on this rank only
                import torch.distributed as dist

                dist.destroy_process_group(transfer_group)
            if self.custom and communicator is not None:
                # the group numbered a build that its peers did not all make: give the number back, so
                # the retry pairs with theirs (a StoreGroup's prefix counts groups built)
                abandon = getattr(self.group, "abandon_transfer", None)
                if callable(abandon):
                    abandon()
            raise
        if transfer_group is not None:
            self.transfer_group = transfer_group
        self.communicator = communicator   # a StoreGroup's old gloo group goes with its last reference

    def _new_torch_group(self) -> Any:
        """A new process group over the EP ranks. Over every rank of the default group it is named from torch's group
        counter, the same on every rank whatever other groups each process built; over a subset it is locally
        synchronized, named after how many groups the process holds, which the members first make equal
        (:func:`~eplb_fsm.fsm.subgroups.pad_registered_groups`). Never destroyed, when replaced or at close
        (each keeps gloo's threads and sockets until the process ends): that count would shrink, and a later
        locally synchronized group (the engine's own too) would take the name of a live one."""
        import torch.distributed as dist

        ranks = dist.get_process_group_ranks(self.group)
        local = len(ranks) < dist.get_world_size()
        if local:
            pad_registered_groups(group_sum(self.group, False, self.timeout_s, self.comm_device), self.rank,
                                  self.world_size)
        # NCCL binds its communicator to the building thread's device: an NCCL group is built here, unniced
        nice = 0 if self.comm_device.type == "cuda" else self.transfer_nice
        timeout = datetime.timedelta(seconds=self.timeout_s)
        return run_niced(lambda: dist.new_group(ranks=ranks, timeout=timeout, use_local_synchronization=local), nice,
                         self.timeout_s + 10.0)

    def release_transfers(self) -> None:
        """Drop the references to the transfer group and communicator (``close()``, once no job uses them); a torch
        group stays registered (see :meth:`_new_torch_group`), a collective-group object's goes with its reference."""
        self.transfer_group = self.communicator = None

    def wait_all_built(self, failed: bool = False) -> int:
        """Return once every rank has built its transfer group (or failed to): an untraced SUM all-reduce of one flag,
        1 where the build failed; returns how many ranks failed. Every rank joins it, built or not, so a build that
        returned on some ranks only is everyone's failure, and the EP group's all-reduces stay in step (a rank that
        skipped it would pair its next all-reduce with its peers' wait here).

        Building a gloo group returns on a rank as soon as its own connections are up, while a peer may still be
        reading the rendezvous store, which lives in one rank's process (rank 0's for ``init_process_group``). Without
        this, a rank 0 that went on and exited right after construction reset that peer inside its build ("Connection
        reset by peer"). A rank enters this all-reduce only after its build returned, so none leaves before all have.
        Untraced, like the run-identity agreement: ``cseq`` stays as it was. Raises what the all-reduce raises (its
        timeout is the collective timeout, bounded in the backend as :func:`eplb_fsm.run_identity.start_sum` says: a
        peer whose build failed never joins it).
        """
        flag = torch.tensor([1.0 if failed else 0.0], dtype=torch.float64)
        group_sum(self.group, self.custom, self.timeout_s, self.comm_device)(flag)
        return int(round(float(flag[0])))

    def name_communicator(self, communicator: Any = None) -> None:
        """Give ``communicator`` (default: the current one) the transfer group's trace name (one with a fixed name
        keeps it)."""
        try:
            (communicator if communicator is not None else self.communicator).name = self.transfer_group_name
        except AttributeError:
            pass

    def wrap(self, value: Any) -> Any:
        """One rank's weights as the communicator wants them (a multi-rank one takes a list of ranks')."""
        return [value] if getattr(self.communicator, "multi_rank", False) else value


class PostedReduce:
    """One all-reduce of :meth:`Collectives.post`: issued, and read by :meth:`wait` (once).

    ``names``, ``shapes``, ``sizes``: the parts; ``buf``: the (sum of sizes,) float64 tensor being summed; ``work``:
    the backend's handle while it runs (None once finished, or for a group without a non-blocking all-reduce);
    ``opened``: its open trace record.
    """

    def __init__(self, collectives: Collectives, names: list[str], shapes: list, sizes: list[int],
                 buf: torch.Tensor, timeout_s: float) -> None:
        self.collectives, self.names, self.shapes, self.sizes = collectives, names, shapes, sizes
        self.buf, self.timeout_s = buf, float(timeout_s)
        self.work: Any = None
        self.grace = 0.0      # added to the wait when the backend bounds the operation itself (start_sum)
        self.opened: Any = None
        self.error: GroupBroken | None = None

    @property
    def waiting(self) -> bool:
        """True while the sum may still be running (``wait()`` has not returned yet)."""
        return self.opened is not None

    def finish(self) -> None:
        """Wait for the backend (bounded by the timeout), then write the end record."""
        work, self.work = self.work, None
        if work is not None:
            work.wait(timeout=datetime.timedelta(seconds=self.timeout_s + self.grace))
        self.collectives.trace.close_collective(self.opened)
        self.opened = None

    def fail(self, exc: BaseException) -> None:
        """The collective raised or timed out: write ``collective_error``; ``wait()`` raises."""
        self.work = None
        if self.opened is not None:
            self.collectives.trace.close_collective(self.opened, exc)
            self.opened = None
        self.error = GroupBroken(f"all_reduce of {self.names} failed: {type(exc).__name__}: {exc}")
        self.error.__cause__ = exc

    def wait(self) -> dict[str, torch.Tensor]:
        """The summed parts, name -> tensor of the part's shape; raises :class:`GroupBroken`."""
        if self.opened is not None:
            try:
                self.finish()
            except Exception as exc:
                self.fail(exc)
            except BaseException as exc:   # a KeyboardInterrupt in the wait: its record ends, the interrupt goes on
                self.fail(exc)
                raise
        if self.error is not None:
            raise self.error
        return {name: piece.reshape(shape)
                for name, shape, piece in zip(self.names, self.shapes, torch.split(self.buf, self.sizes))}
