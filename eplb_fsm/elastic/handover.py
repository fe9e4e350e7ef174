"""Elastic EP: moving a controller between EP groups, and the joiners' handover.

The group swap: :func:`use_group` moves this rank's collectives (and transfers) to another
group, :func:`set_space` re-expresses every model's maps and load window in the new slot
space, :func:`resize_models` tells the models their new rank and world. A leaving rank
writes its last ``group_switch`` record with :func:`leave`.

The handover to joiners: rank 0 of the old group publishes :func:`handover_state` (maps,
counters, config, each model's layout and weight specs) in the store before the new group
forms; a joiner that does not match it refuses before the group forms and says why under
:func:`refusal_key` and :func:`any_refusal_key` (so does a process started with a rank that
is not a joiner's), one that matches says so under :func:`accepted_key`, and the serving
ranks build the new group only once every joiner has accepted (:func:`await_joiners`: a
refusal aborts the scale at once instead of after the group build's timeout); once
the group has formed, every rank of it runs :func:`join_handshake`: one "go" all-reduce,
then the non-expert weights go from the old ranks to the joiners, point to point.

All functions take the controller (``ctl``) first and use only its public port
(:mod:`eplb_fsm.elastic.port`), for the flows in :mod:`eplb_fsm.elastic.scaling` and
:mod:`eplb_fsm.elastic.joiner`.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np
import torch

from eplb_fsm.fsm.collectives import flags
from eplb_fsm.elastic.scale_plan import ScalePlan, place_lost, remap_columns, resize_window

__all__ = [
    "accepted_key",
    "any_refusal_key",
    "await_joiners",
    "expert_specs",
    "handover_state",
    "join_handshake",
    "late_timeout",
    "leave",
    "non_expert_tensors",
    "project_back",
    "publish_accepted",
    "publish_refusal",
    "read_refusals",
    "reduce_on",
    "refusal_key",
    "resize_models",
    "set_space",
    "use_group",
]


def late_timeout(ctl: Any) -> float:
    """How long an agreement after a broken group waits: a peer may still be inside a transfer
    (``timeout``) and then the failed agreement on the broken group (``2 * timeout``)."""
    return 4 * ctl.timeout_s + 5.0


def reduce_on(ctl: Any, group: Any, parts: dict, timeout_s: float) -> dict:
    """The controller's traced all-reduce on a group it has not moved to (raises ``GroupBroken``)."""
    return ctl.collectives.on(group).all_reduce(parts, timeout_s)


def use_group(ctl: Any, group: Any, communicator: Any, rank: int, world: int, *, role: str, phase: str,
              sp: ScalePlan) -> None:
    """Move this rank's collectives to ``group`` and say so in the trace (``group_switch``)."""
    old_name, old_rank, old_world = ctl.group_name, ctl.rank, ctl.world_size
    ctl.switch_group(group, communicator, rank, world)
    ctl.trace.emit("group_switch", generation=ctl.generation, phase=phase, role=role, kind=sp.kind,
                   old_group=old_name, new_group=ctl.group_name, transfer_group=ctl.transfer_group_name,
                   old_rank=old_rank, new_rank=rank, old_world=old_world, new_world=world)


def leave(ctl: Any, sp: ScalePlan, phase: str) -> None:
    """A leaving rank's last record: it belongs to no group from here on."""
    ctl.trace.emit("group_switch", generation=sp.generation, phase=phase, role="leaving", kind=sp.kind,
                   old_group=ctl.group_name, new_group=None, transfer_group=None,
                   old_rank=ctl.rank, new_rank=-1, old_world=ctl.world_size, new_world=sp.new_world)


def set_space(ctl: Any, columns: np.ndarray) -> None:
    """Re-express every model's maps and window in a new slot index space (whole ranks move).

    ``columns`` (P',): the old slot each new slot takes (-1: empty), see ``slot_columns``.
    Every model's new maps are computed before any is installed, so a model that does not
    fit ``columns`` raises with every model still in the old space.
    """
    moved = [(entry, remap_columns(entry.maps.phy2log, columns), resize_window(entry.window, columns))
             for entry in ctl.models]
    for entry, phy2log, window in moved:
        entry.install_placement(phy2log, ctl.device, window)


def project_back(ctl: Any, columns: np.ndarray) -> list[dict]:
    """:func:`set_space` onto the old ranks of a scale-up going back; returns what that loses.

    A committed layer may hold an expert only on a joiner. Rather than keep maps of the
    new slot space on the old group, such an expert gets a spare slot of its layer
    (:func:`~eplb_fsm.elastic.scale_plan.place_lost`) with zero load: the maps stay valid and
    sized for the old group. Returns one ``lost_experts`` entry per such expert, with that
    ``slot``, whose weights are another expert's until the engine reloads them.
    """
    lost: list[dict] = []
    moved = []
    for entry in ctl.models:
        phy2log = remap_columns(entry.maps.phy2log, columns)
        window = resize_window(entry.window, columns)
        for layer, expert, slot in place_lost(phy2log, entry.num_logical):
            window.window[:, layer, slot] = 0
            window.load_pass[layer, slot] = 0
            lost.append({"model": entry.name, "layer": layer, "expert": expert, "slot": slot})
        moved.append((entry, phy2log, window))
    for entry, phy2log, window in moved:
        entry.install_placement(phy2log, ctl.device, window)
    return lost


def resize_models(ctl: Any, rank: int, world: int) -> None:
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


# ---------------------------------------------------------------------------------------
# the handover to joiners


def handover_state(ctl: Any, sp: ScalePlan) -> dict:
    """What a joiner starts from (rank 0 publishes it, pickled, under the generation's ``handover`` key)."""
    return {
        "generation": sp.generation,
        "old_world": sp.old_world,
        "new_world": sp.new_world,
        "rank_mapping": dict(sp.rank_mapping),
        **ctl.export_counters(),   # steps, since, threshold, count
        "mode": "async" if ctl.config.use_async else "sync",
        "config": config_for_handover(ctl.config),
        "models": [{
            "name": e.name, "num_layers": e.num_layers, "num_logical": e.num_logical,
            "slots_per_rank": e.num_local, "num_groups": e.num_groups, "phy2log": e.maps.phy2log.copy(),
            "window": {"next_index": e.window.next_index, "filled": e.window.filled,
                       "size": e.window.window_size},
            "non_expert": non_expert_specs(e.model),
            "expert_weights": expert_specs(e.model),
        } for e in ctl.models],
    }


def config_for_handover(config: Any) -> dict:
    """The settings a joiner must share (redundancy follows from the new world size, so it may differ)."""
    return {k: v for k, v in config.to_dict().items() if k != "num_redundant_experts"}


def non_expert_specs(model: Any) -> list[tuple[tuple, str]]:
    """(shape, dtype) of each of a model's ``non_expert_weights`` (what a joiner's must match)."""
    return [(tuple(t.shape), str(t.dtype)) for t in (getattr(model, "non_expert_weights", None) or [])]


def expert_specs(model: Any) -> list[list[tuple[tuple, str]]]:
    """Per layer, the (row shape, dtype) of each ``expert_weights`` tensor: a tensor of shape
    ``(S, *row)`` gives ``(row, dtype)``. A joiner's must equal the serving ranks': transfers
    send rows as raw bytes, and gloo fills a larger receive buffer from a shorter message
    without complaint, so another row size or dtype would serve garbage rows."""
    return [[(tuple(t.shape[1:]), str(t.dtype)) for t in tensors] for tensors in model.expert_weights]


def refusal_key(namespace: str, generation: int, rank: int) -> str:
    """The store key under which joiner ``rank`` of ``generation`` says why it refused the handover."""
    return f"{namespace}/g{generation}/refused/{rank}"


def any_refusal_key(namespace: str, generation: int) -> str:
    """The store key the serving ranks poll for a refusal by any process that read the handover of
    ``generation``: a joiner, or one started with a rank that is not a joiner's (whose own
    :func:`refusal_key` they would never read). It holds the whole sentence their reason quotes."""
    return f"{namespace}/g{generation}/refused/any"


def publish_refusal(store: Any, namespace: str, generation: int, rank: int, who: str, reason: str) -> None:
    """A process that refuses the handover says why, under its :func:`refusal_key` and then under
    :func:`any_refusal_key` as ``"<who> refused: <reason>"`` (``who``: ``joiner rank 2``, or what
    the process was started as). Best effort: the process's own ValueError is what counts, so a
    store that fails here changes nothing but the serving ranks' reason."""
    try:
        store.set(refusal_key(namespace, generation, rank), reason.encode())
        store.set(any_refusal_key(namespace, generation), f"{who} refused: {reason}".encode())
    except Exception:  # noqa: BLE001 - see the docstring
        pass


def accepted_key(namespace: str, generation: int, rank: int) -> str:
    """The store key under which joiner ``rank`` of ``generation`` says it checked the handover and will join."""
    return f"{namespace}/g{generation}/accepted/{rank}"


def publish_accepted(store: Any, key: str) -> None:
    """A joiner whose checks passed says so before it builds the new group (best effort: a store
    that fails here fails that build too, and the serving ranks wait out their deadline)."""
    try:
        store.set(key, b"1")
    except Exception:  # noqa: BLE001 - see the docstring
        pass


def await_joiners(ctl: Any, sp: ScalePlan, timeout_s: float, poll_s: float = 0.02) -> str | None:
    """A serving rank of a scale-up, before it builds the new group: wait until every joiner has
    accepted (None) or a process that read the handover has refused (``"joiner rank j refused: why"``;
    ``"a process joining as rank r of W refused: why"`` for one started with a rank that is not a
    joiner's), without waiting for the rest, or ``timeout_s`` passes (a reason naming the joiners
    that never answered). The gloo build that follows cannot be interrupted, so this is where a
    refusal can end the scale early.
    A store error propagates (the caller's prepare phase records it)."""
    store, namespace = ctl.group.store, ctl.group.namespace
    pending = list(sp.joiners)
    anyone = any_refusal_key(namespace, sp.generation)
    end = time.monotonic() + float(timeout_s)
    while True:
        if store.check([anyone]):
            return store.get(anyone).decode(errors="replace")
        for j in list(pending):
            key = refusal_key(namespace, sp.generation, j)
            if store.check([key]):  # a joiner writes this one first
                return f"joiner rank {j} refused: {store.get(key).decode(errors='replace')}"
            if store.check([accepted_key(namespace, sp.generation, j)]):
                pending.remove(j)
        if not pending:
            return None
        if time.monotonic() >= end:
            return f"joiner rank(s) {pending} did not answer the handover within {float(timeout_s):g} s"
        time.sleep(poll_s)


def read_refusals(ctl: Any, sp: ScalePlan) -> list[str]:
    """The refusal published under :func:`any_refusal_key` and ``"joiner rank j refused: why"`` for each
    joiner of the scale that published one, without duplicates (no wait: read once the scale is
    aborting, which a refusing process causes even where this rank did not see it in time)."""
    store, namespace = ctl.group.store, ctl.group.namespace
    keys = [(any_refusal_key(namespace, sp.generation), "")] + \
        [(refusal_key(namespace, sp.generation, j), f"joiner rank {j} refused: ") for j in sp.joiners]
    found: list[str] = []
    for key, prefix in keys:
        try:
            if store.check([key]):
                text = prefix + store.get(key).decode(errors="replace")
                if text not in found:
                    found.append(text)
        except Exception:  # noqa: BLE001 - a store that fails now only costs the reason its detail
            pass
    return found


def join_handshake(ctl: Any, sp: ScalePlan) -> tuple[str, str] | None:
    """Both roles, in the new group: the go all-reduce, then the non-expert weights to the joiners.

    Returns None when done, else ``(state the fault it fired led to, why)``: the reason
    goes into the caller's scaling record (a handshake runs outside any rearrangement, so
    no history entry keeps it).
    """
    try:
        go = ctl.collectives.all_reduce({"scale_go": flags(1.0)}, 2 * ctl.timeout_s + 5.0)["scale_go"]
    except Exception as exc:
        return ctl.rearranger.group_fault(exc), f"scale go: {exc}"
    if int(round(float(go[0]))) != sp.new_world:
        reason = f"scale go: {float(go[0])} of {sp.new_world} ranks"
        return ctl.rearranger.abort(reason, recoverable=False), reason
    senders = [sp.new_rank(i) for i in range(sp.old_world)]
    try:
        nbytes = _send_non_expert(ctl, sp, senders)
    except Exception as exc:
        return ctl.rearranger.group_fault(exc), f"non-expert weights: {type(exc).__name__}: {exc}"
    ctl.trace.emit("handover", generation=sp.generation, nbytes=nbytes, senders=senders, joiners=list(sp.joiners))
    return None


def non_expert_tensors(model: Any, name: str) -> list[torch.Tensor]:
    """A model's ``non_expert_weights``; ValueError naming the model and the tensor unless each
    is a contiguous tensor (they travel as flat byte views: a strided one would be sent in the
    wrong order, and a joiner would receive into a temporary copy)."""
    tensors = list(getattr(model, "non_expert_weights", None) or [])
    for k, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) or not t.is_contiguous():
            what = "not contiguous" if isinstance(t, torch.Tensor) else f"a {type(t).__name__}, not a tensor"
            raise ValueError(f"model {name!r}: non_expert_weights[{k}] must be a contiguous tensor; it is {what}")
    return tensors


def _handover_tensors(ctl: Any) -> list[torch.Tensor]:
    return [t for entry in ctl.models for t in non_expert_tensors(entry.model, entry.name)]


def _send_non_expert(ctl: Any, sp: ScalePlan, senders: Sequence[int]) -> int:
    """Every joiner gets every non-expert tensor; tensor k comes from sender k mod len(senders)."""
    tensors = _handover_tensors(ctl)
    comm = ctl.collectives.communicator
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
