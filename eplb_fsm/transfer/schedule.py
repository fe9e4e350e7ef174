"""The schedule of a rearrangement: every layer's plans, messages and copy runs, cached.

Pure bookkeeping between the planners (:mod:`.plan_all`, :mod:`.local_copies`,
:mod:`.batching`) and the executor (:mod:`.execute`): nothing here touches a tensor or
a process group. :func:`prepare_maps` checks the maps and returns their
:class:`Schedule`, built lazily layer by layer and kept in a small LRU keyed by (maps,
group size, local ranks, batching), so a repeated rearrangement re-plans nothing.
Without migration batching, and where the optional C extension is built, every layer
is planned in one C call instead (:mod:`.native_schedule`; same result). The records a
schedule is made of (:data:`Run`, :class:`WaveOps`, :class:`PreparedLayer`,
:class:`Commit`, :func:`row_runs`) live in :mod:`.schedule_types` and are re-exported here.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping as MappingABC
from typing import Any, Iterator, Mapping

import numpy as np

from eplb_fsm.maps import host_array
from eplb_fsm.transfer import native_schedule
from eplb_fsm.transfer.batching import Wave, plan_waves, single_wave
from eplb_fsm.transfer.local_copies import order_local_copies
from eplb_fsm.transfer.plan import LayerPlan, LayerTransfers, as_int64
from eplb_fsm.transfer.plan_all import all_layer_transfers, check_held, plans_for_rank
from eplb_fsm.transfer.rank_mapping import expand_maps
from eplb_fsm.transfer.schedule_types import Commit, PreparedLayer, Run, WaveOps, row_runs

__all__ = [
    "Commit",
    "PreparedLayer",
    "Run",
    "Schedule",
    "WaveOps",
    "clear_schedule_cache",
    "prepare_maps",
    "row_runs",
]


def _as_maps(name: str, m: Any, ndim: int) -> np.ndarray:
    want = "(L, P)" if ndim == 2 else "(P,)"
    try:
        arr = host_array(m, name)
    except ValueError as exc:  # rows of different lengths: numpy's message names no field
        if hasattr(m, "detach"):  # a tensor's own error (a meta tensor) already names it
            raise
        raise ValueError(f"{name}: must be an integer array of shape {want} with rows of equal length, "
                         f"got nested sequences numpy cannot make one array of ({exc})") from exc
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{name}: must be an integer array (int64 phy2log), got dtype {arr.dtype}")
    if arr.ndim != ndim:
        raise ValueError(f"{name}: must have shape {want}, got {arr.shape}")
    return as_int64(name, arr)


def prepare_maps(
    old_phy2log: Any,
    new_phy2log: Any,
    world_size: int,
    rank_mapping: Mapping[int, int] | None,
    ndim: int,
    local_ranks: tuple[int, ...],
    migration_batching: bool,
) -> tuple[np.ndarray, np.ndarray, "Schedule"]:
    """Maps as int64 (L, P) in the group's index space, checked layer by layer, and their schedule.

    The schedule (every layer's plan, messages and copy runs) is cached per (maps, group
    size, local ranks, batching): the same maps were validated when it was built, so a
    cache hit skips the per-layer checks and the planning.
    """
    old = _as_maps("old_phy2log", old_phy2log, ndim)
    new = _as_maps("new_phy2log", new_phy2log, ndim)
    if rank_mapping is not None:
        old, new, _ = expand_maps(old, new, rank_mapping, world_size)
    if ndim == 1:
        old, new = old[None, :], new[None, :]
    if old.shape != new.shape:
        raise ValueError(f"new_phy2log: shape {new.shape} must equal old_phy2log's {old.shape}")
    if old.shape[1] % world_size:
        raise ValueError(
            f"phy2log: P={old.shape[1]} slots must divide by the group size G={world_size} (P % G == 0)"
        )
    old = np.ascontiguousarray(old)
    new = np.ascontiguousarray(new)
    key = (old.shape, old.tobytes(), new.tobytes(), int(world_size), tuple(local_ranks), bool(migration_batching))
    with _SCHEDULES_LOCK:
        sched = _SCHEDULES.get(key)
        if sched is not None:
            _SCHEDULES.move_to_end(key)
    if sched is None:
        check_held(old, new, world_size, name_layers=ndim == 2)
        sched = Schedule(old, new, int(world_size), tuple(local_ranks), bool(migration_batching))
        with _SCHEDULES_LOCK:
            _SCHEDULES[key] = sched
            while len(_SCHEDULES) > _SCHEDULE_CACHE_SIZE:
                _SCHEDULES.popitem(last=False)
    return sched.old, sched.new, sched


def _commit_of(plan: LayerPlan) -> tuple[Commit, tuple[Run, ...], np.ndarray]:
    """(commit, staged local runs weights -> buffer, staged buffer rows) of one rank's plan."""
    order = order_local_copies(plan.local_rows, plan.local_src_rows)
    dst = np.concatenate([order.staged_rows, plan.primary_rows, plan.duplicate_rows])
    src = np.concatenate([order.staged_rows, plan.primary_rows, plan.duplicate_src_rows])
    by_dst = np.argsort(dst, kind="stable")
    dst, src = dst[by_dst], src[by_dst]
    commit = Commit(
        row_runs(order.direct_rows, order.direct_src_rows, same_tensor=True),
        order.direct_src_rows,
        dst,
        src,
        row_runs(dst, src),
    )
    return commit, row_runs(order.staged_rows, order.staged_src_rows), order.staged_rows


def _layer_messages(
    transfers: LayerTransfers, local_ranks: tuple[int, ...], migration_batching: bool
) -> tuple[list[Wave], tuple[WaveOps, ...]]:
    """A layer's waves and, per wave and local rank, its ((peer, row), ...) sends and receives.

    Straight from the layer's transfers (sorted by (src, dst, expert)): a rank's sends are
    its run of ``src``, its receives the transfers whose ``dst`` it is; the same lists, in
    the same order, as its plan's ``send_*``/``recv_*`` fields.
    """
    waves = plan_waves(transfers) if migration_batching else single_wave(transfers)
    if not waves:
        return waves, ()
    mine = {}
    for r in local_ranks:
        a, b = np.searchsorted(transfers.src, [r, r + 1])
        recvs = transfers.dst == r
        mine[r] = (
            tuple(zip(transfers.dst[a:b].tolist(), transfers.src_row[a:b].tolist())),
            tuple(zip(transfers.src[recvs].tolist(), transfers.dst_row[recvs].tolist())),
        )
    if len(waves) == 1:  # one wave carries every transfer of the layer: nothing to filter
        return waves, (WaveOps({r: m[0] for r, m in mine.items()}, {r: m[1] for r, m in mine.items()}),)
    ops = []
    for wave in waves:
        pairs = set(wave.pairs)
        sends = {r: tuple((peer, row) for peer, row in m[0] if (r, peer) in pairs) for r, m in mine.items()}
        recvs = {r: tuple((peer, row) for peer, row in m[1] if (peer, r) in pairs) for r, m in mine.items()}
        ops.append(WaveOps(sends, recvs))
    return waves, tuple(ops)


def _prepare_layer(
    layer: int,
    transfers: LayerTransfers,
    plans: dict[int, LayerPlan],
    migration_batching: bool,
    messages: "tuple[list[Wave], tuple[WaveOps, ...]] | None" = None,
) -> PreparedLayer:
    waves, ops = messages if messages is not None else _layer_messages(transfers, tuple(plans), migration_batching)
    commits, local_runs, staged = {}, {}, {}
    for r, plan in plans.items():
        commits[r], local_runs[r], staged[r] = _commit_of(plan)
    return PreparedLayer(layer, plans, waves, ops, local_runs, commits, staged)


def _split_runs(prev: PreparedLayer, nxt: PreparedLayer) -> tuple[dict[int, Commit], dict[int, Commit]]:
    """Split ``prev``'s commit into what must run before ``nxt`` writes the buffer, and the rest.

    Early: the buffer writes whose buffer rows ``nxt`` overwrites (its receives and staged
    local rows), preceded by all of ``prev``'s direct copies if any of those writes hits a
    row a direct copy still reads. Late: everything else, direct copies first.
    """
    early, late = {}, {}
    for r, commit in prev.commit.items():
        # row masks over the S rows (np.isin sorts; these arrays hold a few rows each)
        overwritten = np.zeros(nxt.plans[r].slots_per_rank, dtype=bool)
        overwritten[nxt.plans[r].recv_rows] = True
        overwritten[nxt.staged[r]] = True
        hit = overwritten[commit.src]
        direct_early = False
        if commit.direct:
            read = np.zeros_like(overwritten)
            read[commit.direct_reads] = True
            direct_early = bool(read[commit.dst[hit]].any())
        early[r] = commit.part(hit, with_direct=direct_early)
        rest = commit.part(~hit, with_direct=not direct_early)
        if not rest.empty:
            late[r] = rest
    return early, late


class _PlansOnDemand(MappingABC):
    """A layer's plans per local rank, planned in Python on first access.

    What a C-planned layer carries as ``plans``: the executor only iterates its ranks;
    the one-layer entry points and the tests read the plans themselves.
    """

    __slots__ = ("_schedule", "_layer")

    def __init__(self, schedule: "Schedule", layer: int) -> None:
        self._schedule = schedule
        self._layer = layer

    def __getitem__(self, rank: int) -> LayerPlan:
        if rank not in self._schedule.local_ranks:
            raise KeyError(rank)
        return self._schedule.plans()[rank][self._layer]

    def __iter__(self) -> Iterator[int]:
        return iter(self._schedule.local_ranks)

    def __len__(self) -> int:
        return len(self._schedule.local_ranks)


class Schedule:
    """Every layer of one (old, new) pair of maps, prepared on first use and kept.

    Built for one group size, set of local ranks and batching mode; the maps it holds are
    read-only copies. Without batching and with the C extension, the first use plans
    every layer and split at once (:mod:`.native_schedule`, tens of microseconds).
    Otherwise layers (and the commit split between consecutive layers) are prepared
    lazily in Python, so a first call still plans layer k+1 while layer k is in flight.
    """

    def __init__(self, old: np.ndarray, new: np.ndarray, world_size: int, local_ranks: tuple[int, ...], batching: bool):
        self.old = old.copy()
        self.new = new.copy()
        self.old.flags.writeable = False
        self.new.flags.writeable = False
        self.world_size = world_size
        self.local_ranks = local_ranks
        self.batching = batching
        n = old.shape[0]
        self._layers: list[PreparedLayer | None] = [None] * n
        self._splits: list[tuple[dict, dict] | None] = [None] * max(n - 1, 0)
        self._transfers: list[LayerTransfers] | None = None
        self._plans: dict[int, list[LayerPlan]] = {}
        self._messages: dict[int, tuple[list[Wave], tuple[WaveOps, ...]]] = {}
        # None: not tried yet; decided at first use, so EPLB_FSM_NATIVE applies per schedule
        self._native: bool | None = None

    def _all_transfers(self) -> list[LayerTransfers]:
        if self._transfers is None:
            # every layer's transfers in one vectorised pass (plan_all); schedule_for checked the maps
            self._transfers = all_layer_transfers(self.old, self.new, self.world_size, validate=False)
        return self._transfers

    def plans(self) -> dict[int, list[LayerPlan]]:
        """Every local rank's plan of every layer (one vectorised Python pass, kept)."""
        if not self._plans:
            transfers = self._all_transfers()
            self._plans = {r: plans_for_rank(self.old, self.new, transfers, r) for r in self.local_ranks}
        return self._plans

    def _plan_natively(self) -> bool:
        """At first use: plan every layer and split in C if this schedule can; whether it did."""
        if self._native is None:
            # the C planner needs slots; maps with none (P = 0) move nothing and plan in Python
            native = (not self.batching and bool(self._layers) and self.old.shape[1] > 0
                      and native_schedule.available())
            if native:
                layers, splits = native_schedule.prepared_layers(
                    self.old, self.new, self.world_size, self.local_ranks, lambda k: _PlansOnDemand(self, k)
                )
                self._layers[:] = layers
                self._splits[:] = splits
            # set last: a thread that reads it True finds every layer filled in
            self._native = native
        return self._native

    def layer(self, k: int) -> PreparedLayer:
        prep = self._layers[k]
        if prep is None and self._plan_natively():
            prep = self._layers[k]
        if prep is None:
            plans = {r: p[k] for r, p in self.plans().items()}
            prep = _prepare_layer(k, self._all_transfers()[k], plans, self.batching, self._messages.pop(k, None))
            self._layers[k] = prep
        return prep

    @property
    def prepared(self) -> bool:
        """Whether layer 0 is prepared (a cached schedule: nothing left to plan before posting)."""
        return self._layers[0] is not None if self._layers else True

    def messages(self, k: int) -> PreparedLayer:
        """Layer k's waves and messages only, for posting them before the rest is planned.

        The result's ``plans`` maps each local rank to None and it has no copy runs or
        commit: those come from :meth:`layer` (computed while the messages fly), which
        reuses these messages. Costs the vectorised transfers of every layer and this
        layer's message lists, not the per-rank plans or the commit order. A schedule
        planned in C returns the whole layer (it costs no more).
        """
        prep = self._layers[k]
        if prep is not None or self._plan_natively():
            return self._layers[k]
        msgs = self._messages.get(k)
        if msgs is None:
            msgs = _layer_messages(self._all_transfers()[k], self.local_ranks, self.batching)
            self._messages[k] = msgs
        return PreparedLayer(k, dict.fromkeys(self.local_ranks), msgs[0], msgs[1])

    def split(self, k: int) -> tuple[dict[int, Commit], dict[int, Commit]]:
        """(early, late) runs of layer k's commit with respect to layer k+1."""
        sp = self._splits[k]
        if sp is None and self._plan_natively():
            sp = self._splits[k]
        if sp is None:
            sp = _split_runs(self.layer(k), self.layer(k + 1))
            self._splits[k] = sp
        return sp


_SCHEDULE_CACHE_SIZE = 16
_SCHEDULES: "OrderedDict[tuple, Schedule]" = OrderedDict()
_SCHEDULES_LOCK = threading.Lock()


def clear_schedule_cache() -> None:
    """Forget every cached schedule (benchmarks use it to time planning as a new rearrangement would)."""
    with _SCHEDULES_LOCK:
        _SCHEDULES.clear()
