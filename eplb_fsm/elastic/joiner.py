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
import pickle
import time
from typing import Any, Mapping

import numpy as np

from eplb_fsm.elastic.bounds import ScaleDeadline
from eplb_fsm.fsm.machine import SCALING
from eplb_fsm.elastic.handover import (
    config_for_handover,
    join_handshake,
    non_expert_specs,
    non_expert_tensors,
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
         keep_trace: bool = False, namespace: str = "eplb"):
    """Start a joiner's controller: wait for the handover, build the group, take part in the scale.

    See ``EplbController.join``. Returns the controller in ``collecting`` (serving in the
    new group) or raises :class:`ScaleAborted` (its trace says why) / ``ValueError`` (bad
    arguments, checked before any wait: ints ``generation`` >= 1, ``world_size`` >= 1,
    ``0 <= rank < world_size``, ``timeout_s`` a finite number > 0; or a mismatch with the
    serving ranks' handover).
    """
    from eplb_fsm.transfer.groups import StoreGroup, StoreInfo, connect_store

    started = time.perf_counter()
    generation = as_count(generation, "generation", 1)
    world_size = as_count(world_size, "world_size", 1)
    rank = as_count(rank, "rank", 0)
    if rank >= world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    timeout = check_seconds(config.collective_timeout_s if timeout_s is None else timeout_s, "timeout_s")
    named = list(models.items()) if isinstance(models, Mapping) else list(models)
    if not named or any(not (isinstance(p, tuple) and len(p) == 2) for p in named):
        raise ValueError("models must be a dict {name: model} or a list of (name, model) pairs, not empty")
    for name, model in named:  # a joiner receives into them: a strided one would take a copy's bytes
        non_expert_tensors(model, name)
    if isinstance(store, StoreInfo):
        namespace = store.namespace
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
    if sp.kind != "scale_up" or world_size != sp.new_world or rank not in sp.joiners:
        raise ValueError(f"rank {rank} of {world_size} is not a joiner of generation {generation} "
                         f"({sp.old_world} -> {sp.new_world} ranks, joiners {list(sp.joiners)})")
    _check_matches(config, named, state)
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
    except BaseException:
        ctl.close()
        raise
    finally:
        ctl.collectives.cap = None


def _check_matches(config: Any, named: list, state: dict) -> None:
    """The joiner's config and models must be the serving ranks' (ValueError naming the difference)."""
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
        got = non_expert_specs(model)
        if got != [(tuple(shape), str(dtype)) for shape, dtype in spec["non_expert"]]:
            raise ValueError(f"model {name!r}: non_expert_weights {got} differ from the serving ranks' "
                             f"{spec['non_expert']}")


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
