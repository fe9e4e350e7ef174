"""Run identity: every rank of a run agrees on a run id and checks it has rank 0's config.

At construction, before any other collective of the run, the controller calls
:func:`agree` with a SUM all-reduce over its EP group. Three all-reduces of float64:

1. a fixed size, whatever the config: rank 0 contributes its run id (64 random bits as
   two 32-bit halves); every rank contributes its field set's digest (the number of
   fields and 64 bits of a hash of the sorted names, in 16-bit pieces), each piece's
   square, and a 1. Every rank reads the same sums, and the digests agree on every rank
   exactly when ``ranks * sum(x**2) == sum(x)**2`` for each piece ``x``. When they do not,
   the field vectors below would differ in length (a collective mismatch that aborts the
   process in gloo), so every rank raises :class:`FieldSetMismatch` instead, after one more
   fixed-size all-reduce that names what it can (:func:`name_bits`). This holds among ranks
   on versions that have the field-set digest (this one on): a rank on an older version
   starts with an all-reduce of another size, and gloo still aborts;
2. rank 0 contributes one 32-bit hash per config field; every other rank contributes
   zeros, so the sum is rank 0's values everywhere (a broadcast through the all-reduce
   every group has);
3. each rank compares its own field hashes with rank 0's and contributes a 0/1 flag
   per field; the sum counts, per field, the ranks that differ.

Every rank sees the same sums, so every rank fails together (:class:`ConfigMismatch`,
naming the fields) or none does. Values below 2**53 are exact in float64, hence the
32-bit and 16-bit pieces. These all-reduces are not traced as collectives: they happen
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

__all__ = ["ConfigMismatch", "FieldSetMismatch", "RunIdentity", "agree", "field_hashes", "field_set_digest",
           "for_controller", "group_sum", "local_identity", "lookup", "name_bits", "new_run_id", "publish",
           "write_header"]

_HALF = 1 << 32
NAME_BITS = 4096   # buckets of the names' all-reduce: two names share one with odds ~1/4096 a pair


class ConfigMismatch(ValueError):
    """This run's ranks were constructed with different configs; ``fields`` names where they differ.

    ``run_id``: the run id every rank agreed on before the comparison failed (the first all-reduce
    carries it, whatever the configs), so every rank's header names one run; None when not known.
    """

    run_id: str | None = None

    def __init__(self, fields: list[str], counts: dict[str, int], mine: list[str], rank: int, world: int,
                 run_id: str | None = None):
        self.run_id = run_id
        self.fields = list(fields)
        self.counts = dict(counts)
        self.mine = list(mine)
        detail = ", ".join(f"{f!r} ({counts[f]} of {world} ranks)" for f in self.fields)
        here = f"this rank (rank {rank}) differs in {self.mine}" if self.mine else f"rank {rank} matches rank 0"
        super().__init__(f"config differs from rank 0's in field(s) {detail}; {here}. Every rank must "
                         "construct its EplbController with the same EplbConfig.")


class FieldSetMismatch(ConfigMismatch):
    """The ranks' configs do not have the same field names (another eplb_fsm version that has the field-set
    digest, this one on; an extra key).

    ``fields`` / ``mine``: this rank's fields that some rank lacks, as far as :func:`name_bits`
    tells (a name that shares its bucket with another rank's name goes unnamed); ``counts``:
    per such field, how many ranks lack it. A field this rank lacks is named by the ranks that have it.
    """

    def __init__(self, lacking: dict[str, int], unseen: int, sizes: tuple[int, int], matches_rank0: bool,
                 rank: int, world: int, run_id: str | None = None):
        self.run_id = run_id
        self.fields, self.mine = sorted(lacking), sorted(lacking)
        self.counts = dict(lacking)
        named = ", ".join(f"{f!r} (missing on {lacking[f]} of {world} ranks)" for f in self.mine) or "none it can name"
        ValueError.__init__(
            self, f"config field set differs between ranks: rank 0 has {sizes[0]} field(s), " + (
                "this rank is rank 0; " if rank == 0 else f"this rank (rank {rank}) has {sizes[1]}, "
                f"{'the same names as rank 0' if matches_rank0 else 'not the same names as rank 0'}; ") +
            f"its fields other ranks lack: {named}; fields of other ranks it lacks: {unseen} (named by those ranks). "
            "Every rank must "
            "construct its EplbController with the same EplbConfig (and the same eplb_fsm version).")


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


def field_set_digest(names: list[str]) -> list[int]:
    """The field set as 5 ints below 2**16: the number of names, then 64 bits of a hash of the sorted names
    in 16-bit pieces (a piece's square, summed over up to 2**20 ranks, stays exact in float64)."""
    digest = hashlib.sha256("\n".join(sorted(names)).encode("utf-8")).digest()
    return [len(names) % (1 << 16), *(int.from_bytes(digest[i:i + 2], "big") for i in range(0, 8, 2))]


def _bucket(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:4], "big") % NAME_BITS


def name_bits(names: list[str], reduce: Callable[[torch.Tensor], None], world: int) -> tuple[dict[str, int], int]:
    """After a field-set mismatch: ``({own name: ranks that lack it}, how many buckets other ranks' names fill
    that this rank's do not)``, from one SUM all-reduce of a (NAME_BITS,) float64 vector of 0/1 per bucket."""
    mine = {n: _bucket(n) for n in names}
    own = set(mine.values())
    bits = torch.zeros(NAME_BITS, dtype=torch.float64)
    bits[sorted(own)] = 1.0
    reduce(bits)
    have = [int(v) for v in bits.tolist()]
    lacking = {n: world - have[b] for n, b in mine.items() if have[b] < world}
    return lacking, sum(1 for b, c in enumerate(have) if c and b not in own)


def local_identity() -> RunIdentity:
    """A run of one rank (no group): its own run id."""
    return RunIdentity(new_run_id(), agreed=False)


def agree(config: dict, rank: int, world: int, reduce: Callable[[torch.Tensor], None]) -> RunIdentity:
    """Agree on rank 0's run id and check every config field against rank 0's (three SUM all-reduces).

    ``config``: this rank's config dict. ``reduce(t)``: sums the (n,) float64 CPU tensor
    ``t`` over the group in place, raising on failure or timeout. Raises
    :class:`FieldSetMismatch` on every rank when the ranks' field names differ (checked first,
    with vectors of one size on every rank), else :class:`ConfigMismatch` on every rank when
    any rank's config differs from rank 0's. Either carries the agreed ``run_id``: rank 0's id
    travels in the first all-reduce, which has one size on every rank whatever its config.
    """
    names, hashes = field_hashes(config)
    run_id = new_run_id() if rank == 0 else "0" * 16
    digest = field_set_digest(names)
    head = [int(run_id[:8], 16), int(run_id[8:], 16), *digest] if rank == 0 else [0] * (2 + len(digest))
    buf = torch.tensor([*head, 1, *digest, *(x * x for x in digest)], dtype=torch.float64)   # (18,)
    reduce(buf)
    got = [int(v) for v in buf.tolist()]
    agreed_id = f"{got[0] % _HALF:08x}{got[1] % _HALF:08x}"
    ranks, sums, squares = got[7], got[8:13], got[13:18]
    if any(ranks * sq != sm * sm for sm, sq in zip(sums, squares)):   # every rank reads the same sums
        lacking, unseen = name_bits(names, reduce, ranks)
        raise FieldSetMismatch(lacking, unseen, (got[2], len(names)), got[2:7] == digest, rank, world, agreed_id)
    buf = torch.tensor(hashes if rank == 0 else [0] * len(hashes), dtype=torch.float64)
    reduce(buf)
    theirs = [int(v) for v in buf.tolist()]
    differs = [0.0 if mine == ref else 1.0 for mine, ref in zip(hashes, theirs)]
    flags = torch.tensor(differs, dtype=torch.float64)
    reduce(flags)
    counts = {n: int(c) for n, c in zip(names, flags.tolist()) if int(c) > 0}
    if counts:
        mine = [n for n, d in zip(names, differs) if d]
        raise ConfigMismatch(sorted(counts), counts, mine, rank, world, agreed_id)
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
        grace = backend_grace(buf, timeout_s, group.size())
        start_sum(group, buf, timeout_s).wait(timeout=datetime.timedelta(seconds=timeout_s + grace))
        tensor.copy_(buf.cpu())

    return reduce


def start_sum(group: Any, buf: torch.Tensor, timeout_s: float) -> Any:
    """Issue a SUM all-reduce of ``buf`` on the torch process group ``group``; returns its work.

    A CPU buffer (gloo) carries ``timeout_s`` into the backend: gloo aborts the operation
    itself when one of its waits runs past it, and closes its connections, so every rank
    fails it. A wait that only gave up on the work would leave the operation queued in gloo,
    where a peer frozen past the timeout later completes it and acts on a sum this rank never
    read, each side then on another layer: such a wait allows what :func:`backend_grace` says. An NCCL
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


def backend_grace(buf: torch.Tensor, timeout_s: float, world_size: int) -> float:
    """Seconds a wait on :func:`start_sum`'s work adds to ``timeout_s``. Where the backend bounds the operation
    itself (gloo) the wait must not give up first: a rank that did, while the backend went on and completed the
    sum on its peers (a frozen peer resumed), would be alone in its verdict. gloo's timeout bounds each of its
    waits, not the operation: a wait that receives data starts afresh, so peers arriving late and a member frozen
    past the timeout stretch the operation, and a ring all-reduce waits 2 (W - 1) times in a row. The wait thus
    allows that many timeouts, plus a second for the backend to say how it ended. NCCL: none (its watchdog)."""
    if buf.device.type != "cpu":
        return 0.0
    return timeout_s * max(0, 2 * (world_size - 1) - 1) + 1.0


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
        # the id's all-reduce completed before the comparison failed: every rank's header names the one run,
        # so a replay of the folder reads the mismatch instead of a folder of several runs
        return (RunIdentity(exc.run_id, agreed=True) if exc.run_id else local_identity()), exc
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
    for a config mismatch, since every rank sees the same per-field counts. A config mismatch
    (field set or values) still writes the agreed run id, so a replay of the folder reads one
    run and names the differing fields (verdict ``config_mismatch``); a failed all-reduce leaves
    each rank an id of its own.
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
