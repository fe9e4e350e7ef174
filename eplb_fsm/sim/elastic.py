"""Elastic simulation: ranks leave and join while the toy engine serves (``simulate --scale``).

``--scale STEP:RANKS`` (repeatable) asks every rank serving at step STEP to call
``EplbController.request_scale(RANKS)`` before that step's forward pass. This module
holds the specs and what one process runs (:func:`run_elastic_rank`);
``eplb_fsm.sim.elastic_report`` checks the processes' results across ranks. The launcher
(``eplb_fsm.sim.elastic_launcher``) owns the processes:

- it hosts the TCP store every EP group is built from (``transfer.groups``): generation
  0 for the first ranks, generation i+1 for the i-th ``--scale``; no rank ever calls
  ``init_process_group``;
- a scale-down's leaving ranks finish the transfer, return their result and exit cleanly;
- a scale-up's joiners are fresh processes, started when old rank 0 announces the scale in
  the store (at the scale step); they call ``EplbController.join`` and then serve from
  that step on. The serving ranks wait for them at most ``join_timeout_s``;
- ``STEP:RANKS:absent`` is a drill for the fault path: the joiners are never started, so
  the scale must abort within the timeout and the old group go on serving;
  ``STEP:RANKS:late`` starts them only once old rank 0 has the scale's outcome (in the
  store, :func:`outcome_key`): they come after the abort, as a joiner slower than
  ``join_timeout_s`` does, and end ``not_joined``.

A joiner whose scale aborted (``ScaleAborted`` from ``EplbController.join``) is the
expected end of an aborted scale, not a failure: its process reports a short result with
``status`` ``"not_joined"`` (:data:`NOT_JOINED`) and the ``reason``.

Every wait is bounded: each rank's collectives by the controller's timeouts, joiners by
``join_timeout_s``, the whole run by the launcher's deadline (then every process is
killed). Each process reports one result dict (the keys of ``sim.run.run_rank``'s, plus
``role``, ``process``, ``start_step``, ``left``, ``scalings``, ``checks`` (after each scale),
``weight_checks`` / ``bad_weight_steps`` (every row checked after every step)), or a
not-joined joiner's; a process that raises or dies makes the run raise ``RankFailedError``
after stopping the others.
"""

from __future__ import annotations

import pickle
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from eplb_fsm.sim import signals

__all__ = ["ScaleEvent", "parse_scale_specs", "scale_events", "spawn_key", "outcome_key", "run_elastic_rank",
           "rank_log_name", "JOINER_ID", "NOT_JOINED", "MAX_RANKS"]

# process ids of joiners: JOINER_ID * (scale index + 1) + new rank (first ranks: their rank)
JOINER_ID = 1000
#: most ranks a simulated EP group may have (--ranks, each --scale size): every rank is a local process
#: (a torch import, a model, a gloo group), and a joiner's process id needs a rank below JOINER_ID
MAX_RANKS = 64
NOT_JOINED = "not_joined"  # the status of a joiner whose scale aborted (it never served)


@dataclass(frozen=True)
class ScaleEvent:
    """One ``--scale``: at ``step`` the serving ranks go to ``ranks``; joiners never start (``absent``) or late."""

    step: int
    ranks: int
    absent: bool = False
    late: bool = False

    @property
    def spec(self) -> str:
        return f"{self.step}:{self.ranks}" + (":absent" if self.absent else ":late" if self.late else "")


def parse_scale_specs(specs: Sequence[Any], ranks: int, steps: int, experts: int, redundant: int) -> list[ScaleEvent]:
    """``["100:2", "200:4"]`` (or ScaleEvents) -> validated events; ValueError naming ``--scale`` and the rule.

    Steps must increase and lie in [1, steps); RANKS in [1, MAX_RANKS]; each size needs P' = S * RANKS >= experts
    (S = (experts + redundant) / ranks slots per rank stay fixed). The world size is followed through the specs,
    each earlier scale taken to switch (an ``:absent`` / ``:late`` one to abort): RANKS must differ from the size
    the group has by then, and ``:absent`` / ``:late`` name joiners, so they need a scale-up.
    """
    events: list[ScaleEvent] = []
    world = ranks   # the group's size when the next spec comes, if every earlier scale went as expected
    if (experts + redundant) % ranks:
        raise ValueError(f"--experts + --redundant ({experts + redundant}) must be divisible by --ranks ({ranks})")
    per_rank = (experts + redundant) // ranks
    for spec in specs or ():
        if isinstance(spec, ScaleEvent):
            event = spec
        else:
            parts = str(spec).split(":")
            if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in ("absent", "late")):
                raise ValueError(f"--scale {spec!r}: expected STEP:RANKS (or STEP:RANKS:absent, STEP:RANKS:late)")
            try:
                event = ScaleEvent(int(parts[0]), int(parts[1]), parts[2:] == ["absent"], parts[2:] == ["late"])
            except ValueError:
                raise ValueError(f"--scale {spec!r}: STEP and RANKS must be integers") from None
        if not 1 <= event.step < steps:
            raise ValueError(f"--scale {event.spec}: STEP must be in [1, --steps={steps})")
        if events and event.step <= events[-1].step:
            raise ValueError(f"--scale {event.spec}: steps must increase (after {events[-1].step})")
        if not 1 <= event.ranks <= MAX_RANKS:
            raise ValueError(f"--scale {event.spec}: RANKS must be in [1, {MAX_RANKS}] (each rank is a local "
                             "process)")
        if per_rank * event.ranks < experts:
            raise ValueError(f"--scale {event.spec}: {event.ranks} ranks x {per_rank} slots per rank = "
                             f"{per_rank * event.ranks} slots cannot hold {experts} experts")
        after = "" if not events else f" after --scale {' '.join(e.spec for e in events)}" + (
            ", an :absent or :late scale aborting" if any(e.absent or e.late for e in events) else "")
        if event.ranks == world:
            raise ValueError(f"--scale {event.spec}: RANKS must differ from the group's size at that step "
                             f"({world} ranks{after}): a scale to the same size changes nothing")
        if (event.absent or event.late) and event.ranks < world:
            raise ValueError(f"--scale {event.spec}: :absent and :late name a scale-up's joiners, and this is a "
                             f"scale-down ({world} -> {event.ranks} ranks{after})")
        if not (event.absent or event.late):  # an :absent / :late scale aborts: the group keeps its size
            world = event.ranks
        events.append(event)
    return events


def scale_events(opts: Any) -> list[ScaleEvent]:
    """The validated ``--scale`` events a run's options carry (``opts.extra["scale"]``)."""
    return parse_scale_specs(opts.extra.get("scale") or (), opts.ranks, opts.steps, opts.experts, opts.redundant)


def rank_log_name(rank: int, join: dict | None = None) -> str:
    """The file a process's stdout goes to in the trace folder: ``rank<NNNNN>.log``, a joiner's ``.g<gen>.log``."""
    return f"rank{rank:05d}.log" if join is None else f"rank{rank:05d}.g{join['generation']}.log"


def spawn_key(index: int) -> str:
    """The store key where old rank 0 announces the ``index``-th scale's joiners to the launcher."""
    return f"sim/spawn/{index}"


def outcome_key(index: int) -> str:
    """The store key where old rank 0 puts the ``index``-th scale-up's outcome (``late`` joiners wait for it)."""
    return f"sim/outcome/{index}"


def _crc(array: Any) -> int:
    import numpy as np

    return zlib.crc32(np.ascontiguousarray(np.asarray(array, dtype=np.int64)).tobytes())


# --------------------------------------------------------------------------- one process


def run_elastic_rank(role: str, rank: int, world: int, opts: Any, store_info: Any,
                     join: dict | None = None) -> dict:
    """One process of an elastic run: a first rank (``role="initial"``) or a joiner."""
    import torch

    from eplb_fsm.config import EplbConfig
    from eplb_fsm.elastic import ScaleAborted
    from eplb_fsm.fsm.controller import EplbController
    from eplb_fsm.sim.model import ToyMoE
    from eplb_fsm.sim.run import (
        OutputTally, RankContext, call_hooks, build_hooks, engine_step, progress_path, rank_result,
        write_step_progress,
    )
    from eplb_fsm.transfer.groups import StoreGroup, connect_store

    events = scale_events(opts)
    join_timeout = float(opts.extra.get("join_timeout_s") or opts.collective_timeout_s)
    if opts.log_dir and opts.redirect_output:
        signals.log_to(Path(opts.log_dir) / rank_log_name(rank, join))
    slots = (opts.experts + opts.redundant) // opts.ranks
    config = EplbConfig(
        window_size=opts.window, step_interval=opts.interval, num_redundant_experts=slots * world - opts.experts,
        use_async=opts.mode == "async", policy=opts.policy, log_balancedness=True,
        log_balancedness_interval=max(1, opts.log_interval), min_balancedness_gain=opts.min_balancedness_gain,
        collective_timeout_s=opts.collective_timeout_s, watchdog_deadline_s=opts.watchdog_deadline_s,
    )
    model = ToyMoE(opts.layers, opts.experts, slots * world - opts.experts, opts.hidden, opts.top_k, rank, world,
                   seed=opts.seed, gate_strength=opts.gate_strength)
    store = connect_store(store_info, max(join_timeout, opts.collective_timeout_s) + 30.0)
    hooks = build_hooks(opts.hooks)
    started: list = []   # the hooks' RankContext, once on_start ran

    def start_hooks(ctl: Any) -> None:
        ctx = RankContext(rank, world, opts, model, ctl, ctl.group, step=ctl.steps)
        ctx.extra["role"] = role
        started.append(ctx)
        call_hooks(hooks, "on_start", ctx)

    if join is None:
        group = StoreGroup(store, 0, rank, world, opts.collective_timeout_s, namespace=store_info.namespace,
                           info=store_info)
        controller = EplbController(config, group=group, trace_dir=opts.log_dir)
        controller.add_model(model, "main")
        start_hooks(controller)
        first_event = 0
    else:
        # a fresh process has no weights: prove that everything it serves with arrives
        with torch.no_grad():
            for tensors in model.expert_weights:
                for t in tensors:
                    t.zero_()
            for t in model.non_expert_weights:
                t.zero_()
        try:
            controller = EplbController.join(config, {"main": model}, store=store_info,
                                             generation=join["generation"], rank=rank, world_size=world,
                                             trace_dir=opts.log_dir, timeout_s=join_timeout,
                                             setup=start_hooks)  # its hooks (--inject) see its own scale
        except ScaleAborted as exc:  # it came after the old ranks gave up: they serve on, nothing failed
            return not_joined_result(rank, world, opts, join, exc)
        first_event = join["index"] + 1
    start = controller.steps
    ctx = started[0]
    ctx.world, ctx.rank, ctx.group = controller.world_size, controller.rank, controller.group
    checks: list[dict] = []

    def check(label: str, generation: int) -> None:
        entry = controller.models[0]
        bad = model.check_weights(entry.maps.phy2log)
        checks.append({"at": label, "step": controller.steps, "generation": generation, "world": controller.world_size,
                       "rank": controller.rank, "bad_rows": bad[:20], "maps_crc": _crc(entry.maps.phy2log),
                       "gates_exact": all(torch.equal(a, b) for a, b in zip(model.non_expert_weights,
                                                                              _fresh_gates(opts, world)))})

    if join is not None:
        check("joined", join["generation"])
    tally = OutputTally()
    weight_checks = 0
    bad_weight_steps: list[int] = []
    left = False
    progress = progress_path(opts.log_dir, rank) if opts.log_dir else None
    if progress is not None:
        progress.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    step = start
    stop_reason = None
    try:
        for step in range(start, opts.steps):
            ctx.step = step
            for index, event in enumerate(events):
                if event.step != step or index < first_event:
                    continue
                if event.ranks == controller.world_size:
                    checks.append({"at": "skipped", "step": step, "generation": index + 1,
                                   "reason": f"already {event.ranks} ranks"})
                    continue
                announce = event.ranks > controller.world_size and controller.rank == 0
                if announce:
                    store.set(spawn_key(index), pickle.dumps({
                        "index": index, "generation": index + 1, "from": controller.world_size, "to": event.ranks,
                        "joiners": list(range(controller.world_size, event.ranks)), "step": step}))
                result = controller.request_scale(event.ranks, timeout_s=join_timeout, generation=index + 1)
                if announce:  # what a `late` scale's joiners start after
                    store.set(outcome_key(index), str(result["outcome"]))
                if result["outcome"] == "left":
                    left = True
                    break
                if result["outcome"] == "failed":
                    stop_reason = result["reason"]
                    break
                ctx.world, ctx.rank, ctx.group = controller.world_size, controller.rank, controller.group
                check(result["outcome"], index + 1)
            if left or stop_reason:
                break
            before, state = engine_step(ctx, hooks, opts, model, controller, controller.group, controller.world_size,
                                        step, tally)
            call_hooks(hooks, "after_step", ctx, step)
            # every row against the committed maps, every step (cheap at simulation sizes)
            if model.check_weights(controller.models[0].maps.phy2log):
                bad_weight_steps.append(step)
            weight_checks += 1
            if progress is not None and (step % opts.progress_every == 0 or state != before):
                write_step_progress(progress, controller, controller.rank, step, opts, state,
                                    world=controller.world_size)
            if ctx.stop:
                break
        wall = time.perf_counter() - t0
        entry = controller.models[0]
        bad_rows = model.check_weights(entry.maps.phy2log)
        result = {
            "rank": controller.rank if not left else rank,
            "world": controller.world_size,
            "steps": step + (0 if left else 1),
            "start_step": start,
            "role": role,
            "process": rank if join is None else JOINER_ID * (join["index"] + 1) + rank,
            "left": left,
            "stop_reason": stop_reason,
            **rank_result(controller, tally, wall, ctx),
            "scalings": controller.scalings,
            "checks": checks,
            "weights_exact": not bad_rows and not bad_weight_steps,
            "bad_rows": bad_rows[:20],
            "weight_checks": weight_checks,
            "bad_weight_steps": bad_weight_steps[:20],
            "maps_agree": True,  # the parent compares the ranks' maps (and per-scale checksums)
        }
        call_hooks(hooks, "on_finish", ctx, result)
        write_step_progress(progress, controller, controller.rank, step, opts,
                            "left" if left else controller.state, done=True, world=controller.world_size)
        return result
    except BaseException as exc:  # issue 12 wiring: `end how=exception` (SIGTERM: sim/signals.py ends it)
        controller.trace.end("exception", error=f"{type(exc).__name__}: {exc}")
        raise
    finally:
        controller.close()


def not_joined_result(rank: int, world: int, opts: Any, join: dict, exc: BaseException) -> dict:
    """The result of a joiner whose scale aborted before it joined (status :data:`NOT_JOINED`, not a failure)."""
    from eplb_fsm.trace import trace_path

    path = trace_path(opts.log_dir, rank, join["generation"]) if opts.log_dir else None
    start = getattr(opts.log_dir, "start", None) or {}  # a reused --trace-dir: only this run's part counts
    wrote = path is not None and path.is_file() and path.stat().st_size > start.get(path.name, 0)
    return {"status": NOT_JOINED, "reason": f"{type(exc).__name__}: {exc}", "rank": rank, "world": world,
            "role": "joiner", "process": JOINER_ID * (join["index"] + 1) + rank, "generation": join["generation"],
            "start_step": join["step"], "steps": join["step"], "left": False, "stop_reason": None,
            "final_state": None, "trace": str(path) if wrote else None}


def _fresh_gates(opts: Any, world: int) -> list:
    """The gates a model built from the seed has (what a joiner must have received)."""
    from eplb_fsm.sim.model import ToyMoE

    key = (opts.seed, opts.layers, opts.experts, opts.hidden)
    cached = _GATES.get(key)
    if cached is None:
        probe = ToyMoE(opts.layers, opts.experts, 0, opts.hidden, min(opts.top_k, opts.experts), 0, 1,
                       seed=opts.seed)
        cached = _GATES[key] = probe.non_expert_weights
    return cached


_GATES: dict = {}
