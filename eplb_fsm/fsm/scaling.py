"""Elastic EP: the ``scaling`` state's actions (ranks leave or join while the engine serves).

The machine (``fsm.machine``) has the rows; this module performs them for the controller:

Scale-down, G -> G' < G (default: the highest ranks leave)::

    collecting --scale_requested--> scaling      survivors build the new group (G' ranks);
                                                  all G agree on it in the old group
    scaling --groups_ready--> planning            plan over the survivors: P' = S * G'
    planning --plan_ready--> transferring ...     in the OLD group: leaving ranks' new slots
    ... --committed--> scaling                    are empty, so they only send
    scaling --switched--> collecting              survivors swap to the new group; leaving
                                                  ranks write their last record and stop

Scale-up, G -> G' > G (default: old ranks keep their numbers, joiners take the rest)::

    collecting --scale_requested--> scaling      rank 0 publishes the handover (maps,
                                                  counters) in the store; all G' build the
                                                  new group; the old G agree in the old group;
                                                  joiners get the non-expert weights (split
                                                  over the old ranks, point to point)
    scaling --groups_ready--> planning            in the NEW group: joiners' old slots empty
    ... transferring ... committing --committed--> scaling --switched--> collecting

A joiner is a new process: :func:`join` builds its controller in ``scaling`` and it takes
the same transitions from ``groups_ready`` on. Both directions run inside one call
(``EplbController.request_scale`` on the ranks already serving, ``EplbController.join``
on the joiners), in sync and async mode alike; async mode first drains a rearrangement
that is in flight (its pending layer is committed or rolled back) so that nothing runs in
the background across the switch. The load-balancing interval restarts after a switch.

Faults (every wait is bounded by ``timeout_s``):

- the new group is not complete in time (a joiner never arrives): every old rank learns
  it in one all-reduce on the old group and fires ``fault`` (recoverable): back to
  ``collecting`` with the old group, old size, old maps; nothing moved;
- a transfer fails while the old group still works: the usual rollback (committed layers
  new, the rest old) and the old group keeps serving; a scale-up then projects the maps
  back onto the old ranks;
- the old group breaks during a scale-down (a leaving rank died before its experts were
  out): the survivors agree over the new group they already built; if every expert
  still has a replica on a survivor they finish the switch there, otherwise they stay
  ``failed`` and the ``scale_aborted`` record names the lost (layer, expert) pairs.

The trace gets ``group_switch`` (a rank's collectives move to another group),
``scale_aborted`` and one ``scaling`` summary per request (docs/events.md).
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from eplb_fsm.fsm.machine import COLLECTING, COMMITTING, FAILED, PLANNING, SCALING, TRANSFERRING
from eplb_fsm.maps import ExpertMaps
from eplb_fsm.stats import LoadWindow
from eplb_fsm.transfer.plan import moved_slots
from eplb_fsm.transfer.rank_mapping import RankMappingInfo, validate_rank_mapping

__all__ = [
    "ScalePlan",
    "ScaleAborted",
    "default_rank_mapping",
    "make_scale_plan",
    "slot_columns",
    "remap_columns",
    "resize_window",
    "lost_experts",
    "request_scale",
    "join",
]


class ScaleAborted(RuntimeError):
    """A joiner's scale operation did not complete (the scale was aborted or its group broke)."""


# ---------------------------------------------------------------------------------------
# pure planning: who goes where, which slot columns move


@dataclass(frozen=True)
class ScalePlan:
    """A validated scale request: the rank mapping and where each phase runs.

    ``rank_mapping[old] = new`` (or -1: leaves). ``kind``: ``scale_down`` (transfer in the
    old group of ``old_world``) or ``scale_up`` (transfer in the new group of
    ``new_world``). ``joiners``: new ranks with no old rank; ``leaving``: old ranks mapped
    to -1. ``old_of_new[j]``: the old rank now called j (-1 for a joiner).
    """

    kind: str
    generation: int
    old_world: int
    new_world: int
    rank_mapping: dict
    joiners: tuple[int, ...]
    leaving: tuple[int, ...]
    old_of_new: tuple[int, ...]
    info: RankMappingInfo = field(repr=False)

    @property
    def group_world(self) -> int:
        """Ranks in the group the transfer runs in."""
        return self.old_world if self.kind == "scale_down" else self.new_world

    def new_rank(self, old_rank: int) -> int:
        return int(self.rank_mapping[old_rank])

    def describe(self) -> dict:
        return {"kind": self.kind, "generation": self.generation, "from_ranks": self.old_world,
                "to_ranks": self.new_world, "rank_mapping": {str(k): v for k, v in self.rank_mapping.items()},
                "joiners": list(self.joiners), "leaving": list(self.leaving)}


def default_rank_mapping(old_world: int, new_world: int) -> dict[int, int]:
    """Scale-down: the highest ranks leave, the others keep their numbers; scale-up: identity."""
    return {i: (i if i < new_world else -1) for i in range(old_world)}


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return int(value)


def make_scale_plan(old_world: int, new_world: int, rank_mapping: Mapping[int, int] | None = None,
                    generation: int = 1) -> ScalePlan:
    """Validate a request to go from ``old_world`` to ``new_world`` ranks; ValueError naming the rule."""
    old_world = _positive("old world size", old_world)
    new_world = _positive("new_world_size", new_world)
    if new_world == old_world:
        raise ValueError(f"new_world_size must differ from the current world size {old_world}")
    if isinstance(generation, bool) or not isinstance(generation, int) or generation < 1:
        raise ValueError(f"generation must be an int >= 1, got {generation!r}")
    mapping = default_rank_mapping(old_world, new_world) if rank_mapping is None else dict(rank_mapping)
    if new_world < old_world:
        info = validate_rank_mapping(mapping, old_world)
        if info.new_world != new_world:
            raise ValueError(f"rank_mapping keeps {info.new_world} ranks but new_world_size is {new_world}")
        kind = "scale_down"
        old_of_new = tuple(info.group_of_new)
    else:
        info = validate_rank_mapping(mapping, new_world)
        kind = "scale_up"
        inverse = {int(v): int(k) for k, v in mapping.items()}
        old_of_new = tuple(inverse.get(j, -1) for j in range(new_world))
    mapping = {int(k): int(v) for k, v in mapping.items()}
    joiners = tuple(j for j, o in enumerate(old_of_new) if o < 0)
    leaving = tuple(i for i in range(old_world) if mapping[i] < 0)
    return ScalePlan(kind, int(generation), old_world, new_world, mapping, joiners, leaving, old_of_new, info)


def slot_columns(src_of_dst_rank: Sequence[int], slots_per_rank: int) -> np.ndarray:
    """Column map for moving whole ranks: entry c = source column of destination column c, or -1.

    ``src_of_dst_rank[d]`` is the source rank whose S slots become destination rank d's
    (-1: destination rank d starts empty).
    """
    s = _positive("slots_per_rank", slots_per_rank)
    out = np.full(len(src_of_dst_rank) * s, -1, dtype=np.int64)
    for d, src in enumerate(src_of_dst_rank):
        if src >= 0:
            out[d * s:(d + 1) * s] = np.arange(src * s, (src + 1) * s)
    return out


def remap_columns(arr: Any, columns: np.ndarray, fill: int = -1) -> np.ndarray:
    """``arr[..., columns]`` with ``fill`` where a column is -1 (numpy, int64 kept)."""
    a = np.asarray(arr)
    cols = np.asarray(columns, dtype=np.int64)
    if cols.size and cols.max() >= a.shape[-1]:
        raise ValueError(f"columns name column {int(cols.max())} of an array with {a.shape[-1]}")
    out = np.take(a, np.maximum(cols, 0), axis=-1)
    out[..., cols < 0] = fill
    return out


def resize_window(window: LoadWindow, columns: np.ndarray) -> LoadWindow:
    """A new window whose slot c holds the counts of ``window``'s slot ``columns[c]`` (0 if -1).

    Ring position and fill level are kept, so every rank's window stays in step.
    """
    cols = torch.as_tensor(np.asarray(columns, dtype=np.int64))
    new = LoadWindow(window.num_layers, int(cols.numel()), window.window_size, device=window.load_pass.device)
    keep = cols >= 0
    if bool(keep.any()):
        dst = torch.nonzero(keep).reshape(-1).to(new.window.device)
        src = cols[keep].to(new.window.device)
        new.window[:, :, dst] = window.window[:, :, src]
        new.load_pass[:, dst] = window.load_pass[:, src]
    new.next_index = window.next_index
    new.filled = window.filled
    return new


def lost_experts(phy2log: Any, num_logical: int) -> list[tuple[int, int]]:
    """(layer, expert) pairs that have no slot in ``phy2log`` (L, P)."""
    arr = np.asarray(phy2log, dtype=np.int64)
    lost = []
    for layer, row in enumerate(arr):
        present = np.bincount(row[row >= 0], minlength=num_logical)[:num_logical] > 0
        lost.extend((layer, int(e)) for e in np.flatnonzero(~present))
    return lost


# ---------------------------------------------------------------------------------------
# controller plumbing


def _check_request(ctl: Any, sp: ScalePlan) -> None:
    """Everything that can be checked before anything changes."""
    if ctl.group is None or not callable(getattr(ctl.group, "successor", None)):
        raise ValueError("request_scale needs an EP group built with eplb_fsm.transfer.groups.StoreGroup "
                         "(a group that can build its successor from a shared store)")
    if not ctl.models:
        raise ValueError("request_scale needs at least one model (add_model)")
    if ctl.state == FAILED:
        raise ValueError("request_scale: the machine is failed; recover() first")
    nodes = ctl.config.num_nodes
    if sp.new_world % nodes:
        raise ValueError(f"new_world_size ({sp.new_world}) must be divisible by config.num_nodes ({nodes})")
    for entry in ctl.models:
        p_new = entry.num_local * sp.new_world
        if p_new < entry.num_logical:
            raise ValueError(
                f"new_world_size {sp.new_world} gives model {entry.name!r} {p_new} slots "
                f"({entry.num_local} per rank) for {entry.num_logical} experts: every expert needs a slot")


def _swap_group(ctl: Any, group: Any, name: str) -> tuple:
    saved = (ctl.group, ctl.group_name)
    ctl.group, ctl.group_name = group, name
    return saved


def _reduce_on(ctl: Any, group: Any, name: str, parts: dict, timeout_s: float) -> dict:
    """The controller's traced all-reduce on another group (raises its _GroupBroken)."""
    saved = _swap_group(ctl, group, name)
    try:
        return ctl._all_reduce(parts, timeout_s)
    finally:
        ctl.group, ctl.group_name = saved


def _late_timeout(ctl: Any) -> float:
    """How long an agreement after a broken group waits: a peer may still be inside a transfer
    (``timeout``) and then the failed agreement on the broken group (``2 * timeout``)."""
    return 4 * ctl._timeout + 5.0


def _flags(*values: float) -> torch.Tensor:
    return torch.tensor([float(v) for v in values], dtype=torch.float64)


def _set_space(ctl: Any, columns: np.ndarray) -> None:
    """Re-express every model's maps and window in a new slot index space (whole ranks move)."""
    for entry in ctl.models:
        phy2log = remap_columns(entry.maps.phy2log, columns)
        window = resize_window(entry.window, columns)
        entry.window = window
        ctl._windows[entry.index] = window
        entry.num_physical = int(columns.size)
        _install_maps(ctl, entry, phy2log)


def _install_maps(ctl: Any, entry: Any, phy2log: np.ndarray) -> None:
    """Give a model entry these maps (empty slots allowed) and hand them to the model."""
    maps = ExpertMaps.from_phy2log(phy2log, entry.num_logical,
                                   max_replicas=max(phy2log.shape[1] - entry.num_logical + 1, 1), allow_empty=True)
    entry.maps = maps
    entry.log2phy = torch.from_numpy(maps.log2phy.copy()).to(ctl.device)
    entry.replica_count = torch.from_numpy(maps.replica_count.copy()).to(ctl.device)
    entry.model.set_eplb_state(entry.window.load_pass, entry.log2phy, entry.replica_count)


def _resize_models(ctl: Any, rank: int, world: int) -> None:
    """Tell each model its new rank and world (``set_ep_world`` if it has one, else the counts)."""
    for entry in ctl.models:
        model = entry.model
        setter = getattr(model, "set_ep_world", None)
        if callable(setter):
            setter(rank, world)
        else:
            model.num_physical_experts = entry.num_physical
            model.num_redundant_experts = entry.num_physical - entry.num_logical
    redundant = {e.num_physical - e.num_logical for e in ctl.models}
    if len(redundant) == 1:
        ctl.config = ctl.config.replace(num_redundant_experts=redundant.pop())


def _use_group(ctl: Any, group: Any, communicator: Any, rank: int, world: int, *, role: str, phase: str,
               sp: ScalePlan) -> None:
    """Move this rank's collectives to ``group`` and say so in the trace (``group_switch``)."""
    old_name, old_rank, old_world = ctl.group_name, ctl.rank, ctl.world
    ctl.group = group
    ctl.rank, ctl.world = rank, world
    ctl.generation = int(getattr(group, "generation", ctl.generation))
    ctl.group_name = getattr(group, "trace_name", ctl.group_name)
    ctl._transfer_generation = 0
    ctl._communicator = communicator
    try:
        communicator.name = ctl.transfer_group_name
    except AttributeError:
        pass
    ctl.trace.set_world(rank, world)
    ctl.trace.emit("group_switch", generation=ctl.generation, phase=phase, role=role, kind=sp.kind,
                   old_group=old_name, new_group=ctl.group_name, transfer_group=ctl.transfer_group_name,
                   old_rank=old_rank, new_rank=rank, old_world=old_world, new_world=world)


def _leave(ctl: Any, sp: ScalePlan, phase: str) -> None:
    """A leaving rank's last record: it belongs to no group from here on."""
    ctl.trace.emit("group_switch", generation=sp.generation, phase=phase, role="leaving", kind=sp.kind,
                   old_group=ctl.group_name, new_group=None, transfer_group=None,
                   old_rank=ctl.rank, new_rank=-1, old_world=ctl.world, new_world=sp.new_world)


# ---------------------------------------------------------------------------------------
# the rearrangement inside a scale


def _scale_plan_for(ctl: Any, loads: list[torch.Tensor], plan_world: int, to_group: np.ndarray,
                    from_group: np.ndarray, step: int):
    """Plan over ``plan_world`` ranks, expressed in the transfer group's slot space."""
    from eplb_fsm.fsm.controller import Plan, _balancedness
    from eplb_fsm.policy.bounds import rank_loads

    t0 = time.perf_counter()
    new_rows, changed, moved, before, after = [], [], [], [], []
    moved_bytes = changed_slots = 0
    for entry, load in zip(ctl.models, loads):
        old = entry.maps.phy2log
        p_plan = entry.num_local * plan_world
        plan_old = remap_columns(old, from_group)
        hint = None if lost_experts(plan_old, entry.num_logical) else torch.from_numpy(plan_old.copy())
        phy2log, _, _ = ctl.policy.rebalance_experts(load, p_plan, entry.num_groups, ctl.config.num_nodes,
                                                     plan_world, old_phy2log=hint)
        planned = np.ascontiguousarray(np.asarray(phy2log.detach().cpu().numpy(), dtype=np.int64))
        if planned.shape != (entry.num_layers, p_plan):
            raise ValueError(f"policy returned phy2log of shape {planned.shape} for model {entry.name!r}, "
                             f"expected {(entry.num_layers, p_plan)}")
        ExpertMaps.from_phy2log(planned, entry.num_logical, max_replicas=p_plan - entry.num_logical + 1)
        new = remap_columns(planned, to_group)
        for layer in range(entry.num_layers):
            changed.append(not np.array_equal(old[layer], new[layer]))
            count = moved_slots(old[layer], new[layer], ctl.world)
            moved.append(count)
            moved_bytes += count * entry.slot_bytes[layer]
        changed_slots += int((old != new).sum())
        before.append(rank_loads(old, load, ctl.world))
        after.append(rank_loads(planned, load, plan_world))
        new_rows.append(new)
    plan = Plan(step=step, forced=True, loads=loads, new_phy2log=new_rows, changed=changed, moved=moved,
                moves=int(sum(moved)), moved_bytes=int(moved_bytes), balancedness_before=_balancedness(before),
                balancedness_after=_balancedness(after), policy_s=time.perf_counter() - t0)
    return plan, changed_slots


def _rearrange(ctl: Any, sp: ScalePlan, plan_world: int, to_group: np.ndarray, from_group: np.ndarray) -> None:
    """groups_ready -> planning -> transferring ... -> committing -> scaling (or a fault)."""
    ctl._fire("groups_ready", extra={"generation": sp.generation, "kind": sp.kind, "group": ctl.group_name})
    ctl._current = ctl._begin(ctl.steps, forced=True)
    try:
        reduced = ctl._all_reduce({"loads": ctl._local_loads()}, ctl._timeout)
    except Exception as exc:  # _GroupBroken
        ctl._group_fault(exc)
        return
    flat = reduced["loads"]
    bad = _bad_loads(flat)
    if bad:  # a scale can't be refused for bad statistics: plan on zero load instead
        ctl.trace.emit("loads_rejected", reason=bad, scale=sp.generation)
        flat = torch.zeros_like(flat)
    loads = ctl._split_loads(flat)
    try:
        plan, changed_slots = _scale_plan_for(ctl, loads, plan_world, to_group, from_group, ctl._current.step)
    except Exception as exc:
        ctl._abort(f"scale policy failed: {type(exc).__name__}: {exc}", recoverable=True)
        return
    ctl._current.plan = plan
    fired = ctl._fire("plan_ready", extra={
        "scale": sp.generation, "moved_slots": plan.moves, "moved_bytes": plan.moved_bytes,
        "balancedness_before": round(plan.balancedness_before, 6),
        "balancedness_after": round(plan.balancedness_after, 6),
        "changed_layers": int(sum(plan.changed)), "policy_s": round(plan.policy_s, 6), "forced": True,
    }, moves=changed_slots, worth=True)
    if fired.dest == COLLECTING:  # nothing changes at all: go straight to the switch
        ctl._finish("skipped", reason="no_moves")
        ctl._fire("scale_requested", extra={"generation": sp.generation, "nothing_to_move": True})
        return
    ctl._sync_transfer()


def _bad_loads(flat: torch.Tensor) -> str | None:
    from eplb_fsm.fsm.controller import _bad_load_reason

    return _bad_load_reason(flat) if flat.numel() else None


def _handover_tensors(ctl: Any) -> list[torch.Tensor]:
    out = []
    for entry in ctl.models:
        tensors = getattr(entry.model, "non_expert_weights", None)
        if tensors is None:
            continue
        for t in tensors:
            if not isinstance(t, torch.Tensor) or not t.is_contiguous():
                raise ValueError(f"model {entry.name!r}: non_expert_weights must be contiguous tensors")
            out.append(t)
    return out


def _send_non_expert(ctl: Any, sp: ScalePlan, senders: Sequence[int]) -> int:
    """Every joiner gets every non-expert tensor; tensor k comes from sender k mod len(senders)."""
    tensors = _handover_tensors(ctl)
    comm = ctl._communicator
    me = ctl.rank
    nbytes = sends = recvs = 0
    for k, t in enumerate(tensors):
        src = senders[k % len(senders)]
        msg = t.reshape(-1).view(torch.uint8)
        for j in sp.joiners:
            if me == src:
                comm.add_send(msg, src, j)
                sends += 1
                nbytes += msg.numel()
            elif me == j:
                comm.add_recv(msg, src, j)
                recvs += 1
                nbytes += msg.numel()
    with ctl.trace.collective("batch_isend_irecv", group=ctl.transfer_group_name, purpose="handover",
                              layer=None, wave=0, waves=1, sends=sends, recvs=recvs, nbytes=nbytes):
        comm.execute()
    return nbytes


# ---------------------------------------------------------------------------------------
# entry points


def _result(ctl: Any, sp: ScalePlan, role: str, outcome: str, started: float, step: int, old_rank: int,
            reason: str | None = None, lost: list | None = None, degraded: bool = False) -> dict:
    plan_entry = None
    if ctl.history and ctl.history[-1].get("scale") == sp.generation:
        plan_entry = ctl.history[-1]
    entry = {
        "generation": sp.generation,
        "step": step,
        "kind": sp.kind,
        "from_ranks": sp.old_world,
        # the size of the group this rank served in afterwards (left: the group it left behind)
        "to_ranks": {"switched": sp.new_world, "left": sp.new_world, "aborted": sp.old_world}.get(outcome),
        "requested_ranks": sp.new_world,
        "role": role,
        "outcome": outcome,
        "old_rank": old_rank,
        "rank": ctl.rank if outcome != "left" else -1,
        "moved_slots": plan_entry["moves"] if plan_entry else 0,
        "moved_bytes": plan_entry["moved_bytes"] if plan_entry else 0,
        "layers_committed": plan_entry["layers_committed"] if plan_entry else 0,
        "seconds": round(time.perf_counter() - started, 6),
        "reason": reason,
        "lost_experts": lost or [],
        "degraded": degraded,
        "state": ctl.state,
    }
    ctl.scalings.append(entry)
    ctl.trace.emit("scaling", **{k: v for k, v in entry.items() if k != "state"})
    return entry


def _tag_history(ctl: Any, sp: ScalePlan, count_before: int) -> None:
    if len(ctl.history) > count_before:
        ctl.history[-1]["scale"] = sp.generation


def _drain(ctl: Any) -> None:
    """Async mode: finish (or roll back) a rearrangement in flight before the scale starts.

    Each round waits (bounded) for the worker's job, then all ranks exchange their ready
    flags in one all-reduce and act on the sum, exactly as a step would.
    """
    while ctl._current is not None and ctl.state in (PLANNING, TRANSFERRING, COMMITTING):
        job = ctl._current.job
        if job is not None and not job.done():
            try:
                job.future.exception(timeout=ctl._timeout + 1.0)
            except Exception:  # still running after the timeout: its flags say "late"
                pass
        try:
            reduced = ctl._all_reduce({"ready": ctl._ready_flags()}, 2 * ctl._timeout)
        except Exception as exc:
            ctl._group_fault(exc)
            return
        ctl.trace.emit("scale_drain", state=ctl.state, layer=ctl.layer)
        ctl._async_progress(reduced["ready"])


def request_scale(ctl: Any, new_world_size: int, rank_mapping: Mapping[int, int] | None = None, *,
                  timeout_s: float | None = None, generation: int | None = None) -> dict:
    """Scale the EP group of a serving controller (every rank of the old group calls it at the same point).

    See ``EplbController.request_scale`` for the contract; returns this rank's scaling entry.
    """
    last = max(ctl.generation, getattr(ctl, "_last_generation", 0))
    generation = last + 1 if generation is None else generation
    sp = make_scale_plan(ctl.world, new_world_size, rank_mapping, generation)
    if generation <= last:
        raise ValueError(f"generation must be > {last} (the last one used), got {generation}")
    _check_request(ctl, sp)
    timeout = float(ctl._timeout if timeout_s is None else timeout_s)
    if not timeout > 0:
        raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
    started = time.perf_counter()
    step = ctl.steps
    ctl.trace.set_context(step=step)
    if ctl.state != COLLECTING:
        _drain(ctl)
    ctl._last_generation = generation  # used up even if the request aborts: no store prefix is reused
    if ctl.state == FAILED:
        return _result(ctl, sp, "member", "failed", started, step, ctl.rank, reason="failed before the scale began")
    old_rank = ctl.rank
    new_rank = sp.new_rank(old_rank)
    ctl._fire("scale_requested", extra={**sp.describe(), "timeout_s": timeout})
    if sp.kind == "scale_down":
        return _scale_down(ctl, sp, timeout, started, step, old_rank, new_rank)
    return _scale_up(ctl, sp, timeout, started, step, old_rank, new_rank)


def _abort_prepare(ctl: Any, sp: ScalePlan, failed: int, error: str | None, started: float, step: int,
                   old_rank: int) -> dict:
    reason = (f"new group of generation {sp.generation} ({sp.new_world} ranks) was not complete on "
              f"{failed} rank(s)" + (f": {error}" if error else ""))
    ctl.trace.emit("scale_aborted", generation=sp.generation, phase="prepare", reason=reason, lost_experts=[])
    ctl._fire("fault", extra={"reason": reason, "scale": sp.generation}, recoverable=True)
    return _result(ctl, sp, "member", "aborted", started, step, old_rank, reason=reason)


def _scale_down(ctl: Any, sp: ScalePlan, timeout: float, started: float, step: int, old_rank: int,
                new_rank: int) -> dict:
    old_group, old_name = ctl.group, ctl.group_name
    leaving = new_rank < 0
    role = "leaving" if leaving else "survivor"
    new_group = new_comm = None
    error = None
    if not leaving:
        try:
            new_group = old_group.successor(sp.generation, new_rank, sp.new_world, timeout)
            new_comm = new_group.transfer_communicator(ctl._timeout, timeout)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            new_group = None
    try:
        agreed = ctl._all_reduce({"scale_ready": _flags(1.0 if error else 0.0)}, 2 * timeout + 5.0)
    except Exception as exc:
        ctl._group_fault(exc)
        return _result(ctl, sp, role, "failed", started, step, old_rank, reason=str(exc))
    failed = int(round(float(agreed["scale_ready"][0])))
    if failed:
        return _abort_prepare(ctl, sp, failed, error, started, step, old_rank)
    S = ctl.models[0].num_local
    # old group space <- plan space (old rank i takes new rank mapping[i]'s slots; leaving: empty)
    to_group = slot_columns([sp.new_rank(i) for i in range(sp.old_world)], S)
    from_group = slot_columns(list(sp.old_of_new), S)  # plan space <- old group space
    history_len = len(ctl.history)
    _rearrange(ctl, sp, sp.new_world, to_group, from_group)
    _tag_history(ctl, sp, history_len)
    if ctl.state == SCALING:
        if leaving:
            ctl._fire("switched", extra={"generation": sp.generation, "role": "leaving"})
            _leave(ctl, sp, "switch")
            out = _result(ctl, sp, "leaving", "left", started, step, old_rank)
            ctl.close()
            return out
        _switch_down(ctl, sp, new_group, new_comm, new_rank, from_group)
        ctl._fire("switched", extra={"generation": sp.generation, "role": role})
        return _result(ctl, sp, role, "switched", started, step, old_rank)
    if ctl.state == COLLECTING:  # a transfer fault the old group survived: it keeps serving
        reason = f"scale-down aborted: {ctl.history[-1]['reason'] if ctl.history else 'transfer failed'}"
        ctl.trace.emit("scale_aborted", generation=sp.generation, phase="transfer", reason=reason, lost_experts=[])
        if new_group is not None:
            new_group.close()
        return _result(ctl, sp, role, "aborted", started, step, old_rank, reason=reason)
    # the old group broke (a rank died): survivors try to finish on the group they built
    if leaving or new_group is None:
        ctl.trace.emit("scale_aborted", generation=sp.generation, phase="transfer",
                       reason="the old group broke during the scale-down", lost_experts=None)
        return _result(ctl, sp, role, "failed", started, step, old_rank, reason="the old group broke")
    return _salvage_down(ctl, sp, new_group, new_comm, new_rank, from_group, started, step, old_rank, old_name)


def _switch_down(ctl: Any, sp: ScalePlan, new_group: Any, new_comm: Any, new_rank: int,
                 from_group: np.ndarray) -> None:
    _set_space(ctl, from_group)
    _use_group(ctl, new_group, new_comm, new_rank, sp.new_world, role="survivor", phase="switch", sp=sp)
    _resize_models(ctl, new_rank, sp.new_world)
    ctl._since = 0
    ctl._threshold = ctl.config.step_interval


def _salvage_down(ctl: Any, sp: ScalePlan, new_group: Any, new_comm: Any, new_rank: int, from_group: np.ndarray,
                  started: float, step: int, old_rank: int, old_name: str) -> dict:
    """The old group broke mid scale-down: finish on the survivors' group if nothing was lost."""
    committed = float(ctl.history[-1]["layers_committed"]) if ctl.history else 0.0
    lost: list[dict] = []
    for entry in ctl.models:
        projected = remap_columns(entry.maps.phy2log, from_group)
        lost += [{"model": entry.name, "layer": layer, "expert": expert}
                 for layer, expert in lost_experts(projected, entry.num_logical)]
    try:
        agreed = _reduce_on(ctl, new_group, new_group.trace_name,
                            {"salvage": _flags(committed, 1.0 if lost else 0.0, 1.0)}, _late_timeout(ctl))["salvage"]
    except Exception as exc:
        reason = f"survivors could not agree on the new group: {exc}"
        ctl.trace.emit("scale_aborted", generation=sp.generation, phase="salvage", reason=reason, lost_experts=lost)
        return _result(ctl, sp, "survivor", "failed", started, step, old_rank, reason=reason, lost=lost)
    ranks = int(round(float(agreed[2])))
    if int(round(float(agreed[1]))) or float(agreed[0]) != committed * ranks:
        reason = ("experts lost with the leaving rank(s): " + ", ".join(
            f"{d['model']} layer {d['layer']} expert {d['expert']}" for d in lost)) if lost else \
            "survivors disagree on the committed layers"
        ctl.trace.emit("scale_aborted", generation=sp.generation, phase="salvage", reason=reason, lost_experts=lost)
        if ctl.state != FAILED:
            ctl._fire("fault", extra={"reason": reason, "scale": sp.generation, "lost_experts": lost},
                      recoverable=False)
        return _result(ctl, sp, "survivor", "failed", started, step, old_rank, reason=reason, lost=lost)
    reason = "a leaving rank died before the scale-down finished; every expert still has a replica on a survivor"
    ctl._fire("recovered", extra={"reason": reason, "scale": sp.generation})
    ctl._fire("scale_requested", extra={**sp.describe(), "salvage": True})
    _switch_down(ctl, sp, new_group, new_comm, new_rank, from_group)
    ctl._fire("switched", extra={"generation": sp.generation, "role": "survivor", "salvage": True})
    return _result(ctl, sp, "survivor", "switched", started, step, old_rank, reason=reason, degraded=True)


def _handover_state(ctl: Any, sp: ScalePlan) -> dict:
    return {
        "generation": sp.generation,
        "old_world": sp.old_world,
        "new_world": sp.new_world,
        "rank_mapping": dict(sp.rank_mapping),
        "steps": ctl.steps,
        "since": ctl._since,
        "threshold": ctl._threshold,
        "count": ctl._count,
        "mode": "async" if ctl.config.use_async else "sync",
        "config": {k: v for k, v in ctl.config.to_dict().items() if k != "num_redundant_experts"},
        "models": [{
            "name": e.name, "num_layers": e.num_layers, "num_logical": e.num_logical,
            "slots_per_rank": e.num_local, "phy2log": e.maps.phy2log.copy(),
            "window": {"next_index": e.window.next_index, "filled": e.window.filled,
                       "size": e.window.window_size},
            "non_expert": [(tuple(t.shape), str(t.dtype)) for t in (getattr(e.model, "non_expert_weights", None) or [])],
        } for e in ctl.models],
    }


def _scale_up(ctl: Any, sp: ScalePlan, timeout: float, started: float, step: int, old_rank: int,
              new_rank: int) -> dict:
    old_group, old_name, old_comm = ctl.group, ctl.group_name, ctl._communicator
    old_tgen, old_world, old_gen = ctl._transfer_generation, ctl.world, ctl.generation
    error = None
    new_group = new_comm = None
    try:
        if old_rank == 0:
            ctl.group.store.set(ctl.group.key("handover", sp.generation), pickle.dumps(_handover_state(ctl, sp)))
        new_group = old_group.successor(sp.generation, new_rank, sp.new_world, timeout)
        new_comm = new_group.transfer_communicator(ctl._timeout, timeout)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        new_group = None
    try:
        agreed = ctl._all_reduce({"scale_ready": _flags(1.0 if error else 0.0)}, 2 * timeout + 5.0)
    except Exception as exc:
        ctl._group_fault(exc)
        return _result(ctl, sp, "member", "failed", started, step, old_rank, reason=str(exc))
    failed = int(round(float(agreed["scale_ready"][0])))
    if failed:
        if new_group is not None:
            new_group.close()
        return _abort_prepare(ctl, sp, failed, error, started, step, old_rank)
    S = ctl.models[0].num_local
    to_new = slot_columns(list(sp.old_of_new), S)          # new space <- old space
    back = slot_columns([sp.new_rank(i) for i in range(sp.old_world)], S)  # old space <- new space
    _use_group(ctl, new_group, new_comm, new_rank, sp.new_world, role="member", phase="prepare", sp=sp)
    _set_space(ctl, to_new)
    history_len = len(ctl.history)
    ok = _join_handshake(ctl, sp)
    if ok:
        _rearrange(ctl, sp, sp.new_world, np.arange(S * sp.new_world, dtype=np.int64),
                   np.arange(S * sp.new_world, dtype=np.int64))
        _tag_history(ctl, sp, history_len)
    if ok and ctl.state == SCALING:
        _resize_models(ctl, new_rank, sp.new_world)
        ctl._since = 0
        ctl._threshold = ctl.config.step_interval
        ctl._fire("switched", extra={"generation": sp.generation, "role": "member"})
        return _result(ctl, sp, "member", "switched", started, step, old_rank)
    # roll back onto the old group: project the maps onto the old ranks
    new_group.close()
    ctl.group, ctl.group_name, ctl._communicator = old_group, old_name, old_comm
    ctl._transfer_generation = old_tgen
    ctl.rank, ctl.world = old_rank, old_world
    ctl.generation = old_gen
    ctl.trace.set_world(old_rank, old_world)
    ctl.trace.emit("group_switch", generation=sp.generation, phase="rollback", role="member", kind=sp.kind,
                   old_group=new_group.trace_name, new_group=old_name, transfer_group=ctl.transfer_group_name,
                   old_rank=new_rank, new_rank=old_rank, old_world=sp.new_world, new_world=old_world)
    committed = float(ctl.history[-1]["layers_committed"]) if len(ctl.history) > history_len else 0.0
    lost: list[dict] = []
    for entry in ctl.models:
        lost += [{"model": entry.name, "layer": layer, "expert": expert}
                 for layer, expert in lost_experts(remap_columns(entry.maps.phy2log, back), entry.num_logical)]
    try:
        agreed = ctl._all_reduce({"rollback": _flags(committed, 1.0 if lost else 0.0)},
                                 _late_timeout(ctl))["rollback"]
    except Exception as exc:
        ctl._group_fault(exc)
        return _result(ctl, sp, "member", "failed", started, step, old_rank, reason=str(exc), lost=lost)
    if int(round(float(agreed[1]))) or float(agreed[0]) != committed * old_world:
        reason = ("experts would be lost moving back to the old group: " + ", ".join(
            f"{d['model']} layer {d['layer']} expert {d['expert']}" for d in lost)) if lost else \
            "old ranks disagree on the committed layers"
        ctl.trace.emit("scale_aborted", generation=sp.generation, phase="rollback", reason=reason, lost_experts=lost)
        if ctl.state != FAILED:
            ctl._fire("fault", extra={"reason": reason, "scale": sp.generation, "lost_experts": lost},
                      recoverable=False)
        return _result(ctl, sp, "member", "failed", started, step, old_rank, reason=reason, lost=lost)
    _set_space(ctl, back)
    reason = "scale-up aborted in the new group; the old group keeps serving"
    if ctl.state == FAILED:
        ctl._fire("recovered", extra={"reason": reason, "scale": sp.generation})
    elif ctl.state != COLLECTING:
        ctl._fire("fault", extra={"reason": reason, "scale": sp.generation}, recoverable=True)
    ctl.trace.emit("scale_aborted", generation=sp.generation, phase="transfer", reason=reason, lost_experts=[])
    return _result(ctl, sp, "member", "aborted", started, step, old_rank, reason=reason)


def _join_handshake(ctl: Any, sp: ScalePlan) -> bool:
    """Both roles, in the new group: the go all-reduce, then the non-expert weights to the joiners."""
    try:
        go = ctl._all_reduce({"scale_go": _flags(1.0)}, 2 * ctl._timeout + 5.0)["scale_go"]
    except Exception as exc:
        ctl._group_fault(exc)
        return False
    if int(round(float(go[0]))) != sp.new_world:
        ctl._abort(f"scale go: {float(go[0])} of {sp.new_world} ranks", recoverable=False)
        return False
    senders = [sp.new_rank(i) for i in range(sp.old_world)]
    try:
        nbytes = _send_non_expert(ctl, sp, senders)
    except Exception as exc:
        ctl._group_fault(exc)
        return False
    ctl.trace.emit("handover", generation=sp.generation, nbytes=nbytes, senders=senders, joiners=list(sp.joiners))
    return True


def join(cls: type, config: Any, models: Any, *, store: Any, generation: int, rank: int, world_size: int,
         trace_dir: str | None = None, device: Any = None, timeout_s: float | None = None,
         keep_trace: bool = False, namespace: str = "eplb"):
    """Start a joiner's controller: wait for the handover, build the group, take part in the scale.

    See ``EplbController.join``. Returns the controller in ``collecting`` (serving in the
    new group) or raises :class:`ScaleAborted` (its trace says why) / ``ValueError``.
    """
    from eplb_fsm.transfer.groups import StoreGroup, StoreInfo, connect_store

    started = time.perf_counter()
    timeout = float(config.collective_timeout_s if timeout_s is None else timeout_s)
    named = list(models.items()) if isinstance(models, Mapping) else list(models)
    if not named or any(not (isinstance(p, tuple) and len(p) == 2) for p in named):
        raise ValueError("models must be a dict {name: model} or a list of (name, model) pairs, not empty")
    if isinstance(store, StoreInfo):
        namespace = store.namespace
        info, store = store, connect_store(store, timeout)
    else:
        info = None
    key = f"{namespace}/g{generation}/handover"
    try:
        store.wait([key], _td(timeout))
        state = pickle.loads(store.get(key))
    except Exception as exc:
        raise ScaleAborted(f"no handover for generation {generation} within {timeout:g} s: {exc}") from exc
    sp = make_scale_plan(state["old_world"], state["new_world"], state["rank_mapping"], generation)
    if sp.kind != "scale_up" or world_size != sp.new_world or rank not in sp.joiners:
        raise ValueError(f"rank {rank} of {world_size} is not a joiner of generation {generation} "
                         f"({sp.old_world} -> {sp.new_world} ranks, joiners {list(sp.joiners)})")
    mine = {k: v for k, v in config.to_dict().items() if k != "num_redundant_experts"}
    if mine != state["config"]:
        diff = sorted(k for k in mine if mine[k] != state["config"].get(k))
        raise ValueError(f"config differs from the serving ranks' in {diff}")
    if [n for n, _ in named] != [m["name"] for m in state["models"]]:
        raise ValueError(f"models must be {[m['name'] for m in state['models']]} in that order, "
                         f"got {[n for n, _ in named]}")
    for (name, model), spec in zip(named, state["models"]):
        got = [(tuple(t.shape), str(t.dtype)) for t in (getattr(model, "non_expert_weights", None) or [])]
        if got != [(tuple(shape), str(dtype)) for shape, dtype in spec["non_expert"]]:
            raise ValueError(f"model {name!r}: non_expert_weights {got} differ from the serving ranks' "
                             f"{spec['non_expert']}")
    redundant = {spec["slots_per_rank"] * sp.new_world - spec["num_logical"] for spec in state["models"]}
    if len(redundant) == 1:
        config = config.replace(num_redundant_experts=redundant.pop())
    try:
        group = StoreGroup(store, generation, rank, world_size, timeout, namespace=namespace, info=info)
    except Exception as exc:
        raise ScaleAborted(f"the group of generation {generation} was not complete: {exc}") from exc
    ctl = cls(config, group=group, device=device, trace_dir=trace_dir, keep_trace=keep_trace, role="joiner",
              start_step=int(state["steps"]))
    try:
        ctl.steps = int(state["steps"])
        ctl._since = int(state["since"])
        ctl._threshold = int(state["threshold"])
        ctl._count = int(state["count"])
        ctl.trace.set_context(step=ctl.steps)
        S = state["models"][0]["slots_per_rank"]
        to_new = slot_columns(list(sp.old_of_new), S)
        for (name, model), spec in zip(named, state["models"]):
            entry = ctl.add_model(model, name)
            _install_maps(ctl, entry, remap_columns(np.asarray(spec["phy2log"]), to_new))
            entry.window.next_index = int(spec["window"]["next_index"])
            entry.window.filled = int(spec["window"]["filled"])
        ctl.trace.emit("group_switch", generation=generation, phase="prepare", role="joiner", kind=sp.kind,
                       old_group=None, new_group=ctl.group_name, transfer_group=ctl.transfer_group_name,
                       old_rank=-1, new_rank=rank, old_world=sp.old_world, new_world=world_size)
        step = ctl.steps
        history_len = len(ctl.history)
        if _join_handshake(ctl, sp):
            full = np.arange(S * sp.new_world, dtype=np.int64)
            _rearrange(ctl, sp, sp.new_world, full, full)
            _tag_history(ctl, sp, history_len)
        if ctl.state != SCALING:
            reason = ctl.history[-1]["reason"] if len(ctl.history) > history_len else "the handshake failed"
            _result(ctl, sp, "joiner", "aborted", started, step, -1, reason=reason)
            raise ScaleAborted(f"scale to generation {generation} aborted: {reason}")
        _resize_models(ctl, rank, world_size)
        ctl._since = 0
        ctl._threshold = ctl.config.step_interval
        ctl._fire("switched", extra={"generation": generation, "role": "joiner"})
        _result(ctl, sp, "joiner", "switched", started, step, -1)
        return ctl
    except BaseException:
        ctl.close()
        raise


def _td(seconds: float):
    import datetime

    return datetime.timedelta(seconds=float(seconds))
