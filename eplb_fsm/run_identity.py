"""Run identity: every rank of a run agrees on a run id and checks it has rank 0's config.

At construction, before any other collective of the run, the controller calls
:func:`agree` with a SUM all-reduce over its EP group. Two all-reduces of float64:

1. rank 0 contributes its run id (64 random bits as two 32-bit halves) and one
   32-bit hash per config field; every other rank contributes zeros, so the sum is
   rank 0's values everywhere (a broadcast through the all-reduce every group has);
2. each rank compares its own field hashes with rank 0's and contributes a 0/1 flag
   per field; the sum counts, per field, the ranks that differ.

Every rank sees the same counts, so every rank fails together (:class:`ConfigMismatch`,
naming the fields) or none does. Values below 2**53 are exact in float64, hence the
32-bit pieces. These two all-reduces are not traced as collectives: they happen
before the header, and leaving them out keeps every group's ``cseq`` as it was.

A joiner of an elastic scale-up does not run the agreement (the serving ranks are not
constructing); it reads the run id rank 0 published in the group's store
(:func:`publish`, :func:`lookup`) and its config was already checked against the
serving ranks' in the handover.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import uuid
from typing import Any, Callable

import torch

__all__ = ["ConfigMismatch", "RunIdentity", "agree", "field_hashes", "for_controller", "group_sum",
           "local_identity", "lookup", "new_run_id", "publish", "write_header"]

_HALF = 1 << 32


class ConfigMismatch(ValueError):
    """This run's ranks were constructed with different configs; ``fields`` names where they differ."""

    def __init__(self, fields: list[str], counts: dict[str, int], mine: list[str], rank: int, world: int):
        self.fields = list(fields)
        self.counts = dict(counts)
        self.mine = list(mine)
        detail = ", ".join(f"{f!r} ({counts[f]} of {world} ranks)" for f in self.fields)
        here = f"this rank (rank {rank}) differs in {self.mine}" if self.mine else f"rank {rank} matches rank 0"
        super().__init__(f"config differs from rank 0's in field(s) {detail}; {here}. Every rank must "
                         "construct its EplbController with the same EplbConfig.")


class RunIdentity:
    """What a rank writes in its header: ``run_id`` (16 hex digits) and whether it was agreed."""

    def __init__(self, run_id: str, agreed: bool) -> None:
        self.run_id = run_id
        self.agreed = agreed


def new_run_id() -> str:
    """16 hex digits of fresh randomness."""
    return uuid.uuid4().hex[:16]


def _field_hash(value: Any) -> int:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:4], "big")


def field_hashes(config: dict) -> tuple[list[str], list[int]]:
    """``(field names sorted, a 32-bit hash of each field's value)`` of a config dict."""
    names = sorted(config)
    return names, [_field_hash(config[n]) for n in names]


def local_identity() -> RunIdentity:
    """A run of one rank (no group): its own run id."""
    return RunIdentity(new_run_id(), agreed=False)


def agree(config: dict, rank: int, world: int, reduce: Callable[[torch.Tensor], None]) -> RunIdentity:
    """Agree on rank 0's run id and check every config field against rank 0's (two SUM all-reduces).

    ``config``: this rank's config dict (the field names must be the same on every rank:
    they come from the same ``EplbConfig`` class). ``reduce(t)``: sums the (n,) float64
    CPU tensor ``t`` over the group in place, raising on failure or timeout.
    Raises :class:`ConfigMismatch` on every rank when any rank's config differs from rank 0's.
    """
    names, hashes = field_hashes(config)
    run_id = new_run_id() if rank == 0 else "0" * 16
    values = [int(run_id[:8], 16), int(run_id[8:], 16), *hashes]
    buf = torch.tensor(values if rank == 0 else [0] * len(values), dtype=torch.float64)
    reduce(buf)
    got = [int(v) for v in buf.tolist()]
    agreed_id = f"{got[0] % _HALF:08x}{got[1] % _HALF:08x}"
    theirs = got[2:]
    differs = [0.0 if mine == ref else 1.0 for mine, ref in zip(hashes, theirs)]
    flags = torch.tensor(differs, dtype=torch.float64)
    reduce(flags)
    counts = {n: int(c) for n, c in zip(names, flags.tolist()) if int(c) > 0}
    if counts:
        mine = [n for n, d in zip(names, differs) if d]
        raise ConfigMismatch(sorted(counts), counts, mine, rank, world)
    return RunIdentity(agreed_id, agreed=True)


def group_sum(group: Any, custom: bool, timeout_s: float, device: Any = "cpu") -> Callable[[torch.Tensor], None]:
    """The SUM all-reduce over the controller's group, untraced: ``reduce(t)`` sums ``t`` in place.

    ``custom``: ``group`` is a collective-group object (its own ``all_reduce(t, timeout_s)``),
    else a torch process group. ``device``: where the buffer must live (NCCL: the GPU).
    """

    def reduce(tensor: torch.Tensor) -> None:
        if custom:
            group.all_reduce(tensor, timeout_s)
            return
        buf = tensor.to(device)
        start_sum(group, buf, timeout_s).wait(timeout=datetime.timedelta(seconds=timeout_s + backend_grace(buf)))
        tensor.copy_(buf.cpu())

    return reduce


def start_sum(group: Any, buf: torch.Tensor, timeout_s: float) -> Any:
    """Issue a SUM all-reduce of ``buf`` on the torch process group ``group``; returns its work.

    A CPU buffer (gloo) carries ``timeout_s`` into the backend: gloo aborts the operation
    itself when it runs past it, on every rank. A wait that only gives up on the work would
    leave the operation queued in gloo, where a peer frozen past the timeout later completes
    it and acts on a sum this rank never read, each side then on another layer. An NCCL
    buffer keeps the group's own timeout: an operation timeout there makes NCCL's watchdog
    tear the process down (recover() catches ranks that still diverged).
    """
    import torch.distributed as dist

    if buf.device.type != "cpu":
        return dist.all_reduce(buf, group=group, async_op=True)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    opts.timeout = datetime.timedelta(seconds=timeout_s)
    return group.allreduce([buf], opts)


def backend_grace(buf: torch.Tensor) -> float:
    """Seconds a wait on :func:`start_sum`'s work adds to the timeout: where the backend bounds the
    operation itself (gloo), it gets this long to say how it ended, since a wait that gave up
    first while the backend completed it would leave this rank alone in its verdict."""
    return 1.0 if buf.device.type == "cpu" else 0.0


def _run_id_key(group: Any) -> str | None:
    namespace = getattr(group, "namespace", None)
    return f"{namespace}/run_id" if namespace and getattr(group, "store", None) is not None else None


def publish(group: Any, identity: RunIdentity, rank: int) -> None:
    """Rank 0 of a store-backed group (elastic EP) leaves the run id where joiners find it."""
    key = _run_id_key(group)
    if key is not None and rank == 0:
        group.store.set(key, identity.run_id)


def lookup(group: Any) -> RunIdentity:
    """A joiner's run id: the one rank 0 published in the group's store, else a fresh one (not agreed)."""
    key = _run_id_key(group)
    if key is not None:
        try:
            if group.store.check([key]):
                return RunIdentity(group.store.get(key).decode("ascii"), agreed=True)
        except Exception:  # a store that can't say: the joiner still runs, with an id of its own
            pass
    return local_identity()


def for_controller(group: Any, custom: bool, rank: int, world: int, config: dict, timeout_s: float,
                   device: Any, role: str) -> tuple[RunIdentity, BaseException | None]:
    """The controller's identity at construction: ``(identity, error or None)``.

    A member of a group of several ranks agrees (:func:`agree`) and rank 0 publishes the id
    (:func:`publish`); a joiner looks it up; a lone rank makes its own and publishes it too. ``error`` is the
    :class:`ConfigMismatch`, or a ``RuntimeError`` when the agreement's all-reduce failed:
    the controller writes its header and an ``end`` record first, then raises it.
    """
    if group is None:
        return local_identity(), None
    if role == "joiner":
        return lookup(group), None
    if world <= 1:  # nobody to agree with, but a joiner of a later scale-up looks the id up
        identity = local_identity()
        publish(group, identity, rank)
        return identity, None
    try:
        identity = agree(config, rank, world, group_sum(group, custom, timeout_s, device))
    except ConfigMismatch as exc:
        return local_identity(), exc
    except Exception as exc:
        err = RuntimeError(f"run identity: the all-reduce agreeing on the run id failed on rank {rank} of "
                           f"{world} (every rank must construct its controller): {type(exc).__name__}: {exc}")
        return local_identity(), err
    publish(group, identity, rank)
    return identity, None


def write_header(trace: Any, collectives: Any, config: dict, role: str, /, **fields: Any) -> RunIdentity:
    """The controller's first act on its group: agree on the run identity, then write the header.

    ``collectives``: the controller's ``fsm.collectives.Collectives`` (its ``group``,
    ``custom``, ``rank``, ``world_size``, ``timeout_s``, ``comm_device``); ``fields``: the
    header's other fields. The header carries ``run_id`` (and ``config_hash``, from the
    trace). When the identity failed (a differing config, the all-reduce failed) the trace
    gets ``end how=exception`` and is closed, and the error is raised: on every rank at once
    for a config mismatch, since every rank sees the same per-field counts.
    """
    identity, error = for_controller(collectives.group, collectives.custom, collectives.rank,
                                     collectives.world_size, config, collectives.timeout_s,
                                     collectives.comm_device, role)
    trace.header(config, run_id=identity.run_id, **fields)
    if error is not None:
        trace.end("exception", error=f"{type(error).__name__}: {error}")
        trace.close()
        raise error
    return identity
