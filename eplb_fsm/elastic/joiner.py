"""Elastic EP: the joiner's side of a scale-up (``EplbController.join``).

A joiner is a new process. It waits for the handover that rank 0 of the serving group
publishes (:func:`~eplb_fsm.elastic.handover.handover_state`), checks that its config
and models match the serving ranks', joins the new group, builds its controller in
``scaling`` with the shared counters and the maps projected onto the new ranks, then
takes the same transitions as the serving ranks from ``groups_ready`` on, a switch with
the rearrangement cut short (:mod:`~eplb_fsm.elastic.partial`) included.
"""

from __future__ import annotations

import datetime
import os
import pickle
import time
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from eplb_fsm.config import EplbConfig
from eplb_fsm.elastic.bounds import ScaleDeadline
from eplb_fsm.fsm.collectives import resolve_device
from eplb_fsm.fsm.machine import SCALING
from eplb_fsm.fsm.model_protocol import validate_model
from eplb_fsm.elastic.handover import (
    accepted_key,
    config_for_handover,
    expert_specs,
    join_handshake,
    non_expert_specs,
    non_expert_tensors,
    publish_accepted,
    publish_refusal,
    resize_models,
)
from eplb_fsm.maps import as_count, check_seconds
from eplb_fsm.elastic.partial import partial_switch_agreed, switch_partial
from eplb_fsm.elastic.scale_plan import make_scale_plan, remap_columns, slot_columns
from eplb_fsm.elastic.records import rearrange_for_scale, scaling_record, tag_history

__all__ = ["ScaleAborted", "join"]


class ScaleAborted(RuntimeError):
    """A joiner's scale operation did not complete (the scale was aborted or its group broke)."""


def join(cls: type, config: Any, models: Any, *, store: Any, generation: int, rank: int, world_size: int,
         trace_dir: str | None = None, device: Any = None, timeout_s: float | None = None,
         keep_trace: bool = False, namespace: str = "eplb", setup: Any = None):
    """Start a joiner's controller: wait for the handover, build the group, take part in the scale.

    See ``EplbController.join``. Returns the controller in ``collecting`` (serving in the
    new group) or raises :class:`ScaleAborted` (its trace says why) / ``ValueError``: bad
    arguments, checked before any wait (:func:`_check_models`, :func:`_check_arguments`), or
    a mismatch with the serving ranks' handover (:func:`_check_matches`), checked before the
    new group forms; such a refusal is also published for the serving ranks
    (``handover.publish_refusal``). An error other than ``ScaleAborted`` once the controller
    exists ends its trace ``end`` how=exception before it is closed.

    ``setup``: None or ``setup(controller)``, called once the controller holds the handover's
    models, maps and counters (``controller.steps``: the serving ranks' step count at the
    scale) and before the scale's first transfer, so that what it installs (``transfer_hooks``,
    machine listeners) sees the joiner's own scale. An error from it ends the join as above.
    """
    from eplb_fsm.transfer.groups import StoreGroup, StoreInfo, connect_store

    started = time.perf_counter()
    generation = as_count(generation, "generation", 1)
    world_size = as_count(world_size, "world_size", 1)
    rank = as_count(rank, "rank", 0)
    if rank >= world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    if not isinstance(config, EplbConfig):
        raise ValueError(f"config must be an EplbConfig, got {type(config).__name__}")
    timeout = check_seconds(config.collective_timeout_s if timeout_s is None else timeout_s, "timeout_s")
    if setup is not None and not callable(setup):
        raise ValueError(f"setup must be None or a callable taking the joiner's controller, got {setup!r}")
    named = _check_models(models, world_size)
    namespace = _check_arguments(store, namespace, device, trace_dir)
    if isinstance(store, StoreInfo):
        info, store = store, connect_store(store, timeout)
    else:
        info = None
    key = f"{namespace}/g{generation}/handover"
    try:
        store.wait([key], datetime.timedelta(seconds=float(timeout)))
        state = pickle.loads(store.get(key))
    except Exception as exc:
        raise ScaleAborted(f"no handover for generation {generation} within {timeout:g} s: {exc}") from exc
    sp = make_scale_plan(state["old_world"], state["new_world"], state["rank_mapping"], generation)
    is_joiner = sp.kind == "scale_up" and world_size == sp.new_world and rank in sp.joiners
    try:
        if not is_joiner:
            raise ValueError(f"rank {rank} of {world_size} is not a joiner of generation {generation} "
                             f"({sp.old_world} -> {sp.new_world} ranks, joiners {list(sp.joiners)})")
        _check_matches(config, named, state)
    except ValueError as exc:
        # the serving ranks wait for every joiner's answer before they build the new group:
        # a refusal ends their scale at once, and its reason goes into their scale_aborted record;
        # a process started with a wrong rank is heard too (any_refusal_key), not taken for a silent joiner
        who = f"joiner rank {rank}" if is_joiner else f"a process joining as rank {rank} of {world_size}"
        publish_refusal(store, namespace, generation, rank, who, str(exc))
        raise
    publish_accepted(store, accepted_key(namespace, generation, rank))  # the serving ranks build only now
    # from the handover on, the joiner's waits share one deadline, as the serving ranks' do
    deadline = ScaleDeadline(timeout, float(config.collective_timeout_s))
    redundant = {spec["slots_per_rank"] * sp.new_world - spec["num_logical"] for spec in state["models"]}
    if len(redundant) == 1:
        config = config.replace(num_redundant_experts=redundant.pop())
    try:
        group = StoreGroup(store, generation, rank, world_size, deadline.left(timeout), namespace=namespace,
                           info=info)
    except Exception as exc:
        raise ScaleAborted(f"the group of generation {generation} was not complete: {exc}") from exc
    try:
        ctl = cls(config, group=group, device=device, trace_dir=trace_dir, keep_trace=keep_trace, role="joiner",
                  start_step=int(state["steps"]))
    except (ValueError, TypeError):  # the joiner's own arguments (device, trace_dir): not the scale's fault
        group.close()
        raise
    except Exception as exc:  # its transfer group did not form: the scale did not complete here
        group.close()
        raise ScaleAborted(f"the transfer group of generation {generation} was not complete: {exc}") from exc
    ctl.collectives.cap = deadline.left
    try:
        _take_handover(ctl, sp, named, state)
        if setup is not None:
            setup(ctl)   # the handshake and the scale's layer transfers come next: what it installs sees them
        step = ctl.steps
        history_len = len(ctl.history)
        faulted = join_handshake(ctl, sp)  # None: handed over; else (where its fault led, why)
        phase = "handover" if faulted else "transfer"
        reached, reason = faulted or (None, None)
        if reached is None:
            full = np.arange(state["models"][0]["slots_per_rank"] * sp.new_world, dtype=np.int64)
            reached = rearrange_for_scale(ctl, sp, sp.new_world, full, full)
            tag_history(ctl, sp, history_len)
        if reached != SCALING:
            if reason is None:
                reason = ctl.history[-1]["reason"] if len(ctl.history) > history_len else "the transfer failed"
            if partial_switch_agreed(ctl, sp, deadline, reached, phase, history_len):
                reason = switch_partial(ctl, sp, "joiner", rank, reason)
                scaling_record(ctl, sp, "joiner", "switched", started, step, -1, reason=reason, phase=phase,
                               partial=True, bounds=deadline.describe())
                return ctl
            scaling_record(ctl, sp, "joiner", "aborted", started, step, -1, reason=reason, phase=phase,
                           bounds=deadline.describe())
            raise ScaleAborted(f"scale to generation {generation} aborted in its {phase} phase: {reason}")
        resize_models(ctl, rank, world_size)
        ctl.restart_interval()
        ctl.fire("switched", extra={"generation": generation, "role": "joiner"})
        scaling_record(ctl, sp, "joiner", "switched", started, step, -1, bounds=deadline.describe())
        return ctl
    except ScaleAborted:  # its `scaling` record (outcome aborted) already says why
        ctl.close()
        raise
    except BaseException as exc:
        # without it close() would end the trace `closed` and a replay would read the joiner
        # as a rank that stopped answering (a hang), with the error lost
        ctl.trace.end("exception", f"{type(exc).__name__}: {exc}")
        ctl.close()
        raise
    finally:
        ctl.collectives.cap = None


def _check_models(models: Any, world_size: int) -> list[tuple[str, Any]]:
    """``models`` as ``[(name, model)]``, each following the MoE protocol for ``world_size`` ranks with
    contiguous ``non_expert_weights`` (a joiner receives into them: a strided one would take a copy's bytes)."""
    named = list(models.items()) if isinstance(models, Mapping) else list(models)
    if not named or any(not (isinstance(p, tuple) and len(p) == 2) for p in named):
        raise ValueError("models must be a dict {name: model} or a list of (name, model) pairs, not empty")
    for name, model in named:
        try:
            validate_model(model, world_size)
        except ValueError as exc:
            raise ValueError(f"model {name!r}: {exc}") from None
        non_expert_tensors(model, name)
    return named


def _check_arguments(store: Any, namespace: Any, device: Any, trace_dir: Any) -> str:
    """The store, namespace, device and trace_dir rules (ValueError naming the argument); returns the
    namespace the handover is read under (a ``StoreInfo`` carries its own, ``namespace`` is then unused)."""
    import torch.distributed as dist

    from eplb_fsm.transfer.groups import StoreInfo, check_namespace

    if isinstance(store, StoreInfo):
        namespace = store.namespace
    elif not isinstance(store, dist.Store):
        raise ValueError(f"store must be a StoreInfo or a torch.distributed.Store (a raw store, with namespace), "
                         f"got {type(store).__name__}")
    else:
        check_namespace(namespace)   # StoreGroup's own rule: whatever a serving group was built under
    resolve_device(device)   # the controller resolves it again; here only so that a bad one costs no wait
    if trace_dir is not None:
        if not isinstance(trace_dir, (str, os.PathLike)) or not os.fspath(trace_dir):
            raise ValueError(f"trace_dir must be a non-empty path (str or os.PathLike) or None, got {trace_dir!r}")
        path = Path(trace_dir)
        # the trace creates the folder later; whatever exists of it now must be folders
        existing = next((p for p in (path, *path.parents) if p.exists()), None)
        if existing is not None and not existing.is_dir():
            raise ValueError(f"trace_dir: {trace_dir} is not a folder (a file has that name or one above it)")
    return namespace


def _check_matches(config: Any, named: list, state: dict) -> None:
    """The joiner's config and models must be the serving ranks' (ValueError naming the model and the field).

    Checked before the new group forms. Besides config and names: each model's layout
    (layers, logical experts, slots per rank, expert groups) and, per layer, the row shape
    and dtype of each ``expert_weights`` tensor and the shape and dtype of each
    ``non_expert_weights`` tensor, because a transfer of rows of another size or type is
    not refused by gloo: it would serve garbage.
    """
    slots = {m["name"]: m["slots_per_rank"] for m in state["models"]}
    if len(set(slots.values())) > 1:  # one slot layout moves every model (the serving ranks refuse this too)
        raise ValueError(f"the serving ranks' models differ in slots per rank: {slots}")
    mine = config_for_handover(config)
    if mine != state["config"]:
        diff = sorted(k for k in mine if mine[k] != state["config"].get(k))
        raise ValueError(f"config differs from the serving ranks' in {diff}")
    if [n for n, _ in named] != [m["name"] for m in state["models"]]:
        raise ValueError(f"models must be {[m['name'] for m in state['models']]} in that order, "
                         f"got {[n for n, _ in named]}")
    for (name, model), spec in zip(named, state["models"]):
        for field, key in _LAYOUT:
            if getattr(model, field) != spec[key]:
                raise ValueError(f"model {name!r}: {field} {getattr(model, field)} differs from the serving "
                                 f"ranks' {spec[key]}")
        _check_expert_specs(name, expert_specs(model), spec["expert_weights"])
        got = non_expert_specs(model)
        if got != [(tuple(shape), str(dtype)) for shape, dtype in spec["non_expert"]]:
            raise ValueError(f"model {name!r}: non_expert_weights {got} differ from the serving ranks' "
                             f"{spec['non_expert']}")


# (the model's attribute, its handover key): the layout a joiner's model must share
_LAYOUT = (("num_moe_layers", "num_layers"), ("num_logical_experts", "num_logical"),
           ("num_local_physical_experts", "slots_per_rank"), ("num_expert_groups", "num_groups"))


def _check_expert_specs(name: str, mine: list, theirs: list) -> None:
    """Per layer, the joiner's (row shape, dtype) of each expert weight tensor against the serving ranks'."""
    for layer, (got, want) in enumerate(zip(mine, theirs)):
        if len(got) != len(want):
            raise ValueError(f"model {name!r}: expert_weights[{layer}] has {len(got)} tensors, the serving "
                             f"ranks' have {len(want)}")
        for t, ((shape, dtype), (their_shape, their_dtype)) in enumerate(zip(got, want)):
            field = f"model {name!r}: expert_weights[{layer}][{t}]"
            if shape != tuple(their_shape):
                raise ValueError(f"{field} row shape {shape} differs from the serving ranks' {tuple(their_shape)} "
                                 "(a row: one expert's part of the tensor)")
            if dtype != their_dtype:
                raise ValueError(f"{field} dtype {dtype} differs from the serving ranks' {their_dtype}")


def _take_handover(ctl: Any, sp: Any, named: list, state: dict) -> None:
    """Counters from the handover, then each model added with its maps projected onto the new ranks."""
    ctl.restore_counters(state)
    to_new = slot_columns(list(sp.old_of_new), state["models"][0]["slots_per_rank"])
    for (name, model), spec in zip(named, state["models"]):
        entry = ctl.add_model(model, name)
        entry.install_placement(remap_columns(np.asarray(spec["phy2log"]), to_new), ctl.device)
        entry.window.next_index = int(spec["window"]["next_index"])
        entry.window.filled = int(spec["window"]["filled"])
    ctl.trace.emit("group_switch", generation=sp.generation, phase="prepare", role="joiner", kind=sp.kind,
                   old_group=None, new_group=ctl.group_name, transfer_group=ctl.transfer_group_name,
                   old_rank=-1, new_rank=ctl.rank, old_world=sp.old_world, new_world=ctl.world_size)
