"""The per-rank body of ``eplb-fsm simulate`` and what it is configured with.

The parent (``eplb_fsm.commands.simulate``) builds a :class:`SimOptions` (everything
picklable, load targets included, so every rank sees the same numbers) and runs
:func:`run_rank` on G local gloo processes through ``eplb_fsm.sim.launcher.run_ranks``.
Each rank builds a :class:`~eplb_fsm.sim.model.ToyMoE` and an
:class:`~eplb_fsm.fsm.controller.EplbController`, then for every engine step: sets the
gate bias from the load source, runs the distributed forward, checks its output against
the placement-free reference bit for bit, and calls ``controller.step``.

Hooks: ``SimOptions.hooks`` lists ``("package.module:factory", {kwargs})`` pairs. Each
rank imports the factory, calls ``factory(**kwargs)`` and uses the object it returns
(any of the :class:`SimHooks` methods; missing ones are skipped). That is where fault
injection or elastic scaling plug in without touching this loop; a hook sees the whole
:class:`RankContext` (controller, model, group, options) and can store results in
``ctx.extra``, which comes back in the rank's result.

Every wait is bounded: the controller's by ``collective_timeout_s``, the forward's all-reduce by the
process-group timeout (the run's deadline; an elastic StoreGroup's: 60 s) or, while injecting, by
``Injector.engine_timeout_s`` (3 x ``collective_timeout_s`` + 10 s); the whole run by the launcher's deadline.
"""

from __future__ import annotations

import importlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eplb_fsm.sim import signals
# re-exported: the load targets every rank is built with (eplb_fsm.sim.targets, numpy only)
from eplb_fsm.sim.targets import default_esft_dir, load_targets, target_at
from eplb_fsm.stats import balancedness, rank_loads_physical

__all__ = [
    "SimOptions",
    "RankContext",
    "SimHooks",
    "build_hooks",
    "run_rank",
    "load_targets",
    "target_at",
    "progress_path",
    "default_esft_dir",
]


@dataclass
class SimOptions:
    """Everything one simulation run needs (picklable; identical on every rank)."""

    ranks: int = 4
    layers: int = 4
    experts: int = 32
    redundant: int = 8
    hidden: int = 16
    top_k: int = 2
    tokens: int = 128
    steps: int = 400
    interval: int = 100
    window: int = 40
    mode: str = "sync"
    load: str = "zipf"
    seed: int = 0
    drift: float = 0.6
    zipf_exponent: float = 1.0
    gate_strength: float = 1.0
    dummy_every: int = 0               # every n-th step is a dummy step (0: none)
    policy: str = "default"
    min_balancedness_gain: float = 0.0
    collective_timeout_s: float = 20.0
    watchdog_deadline_s: float = 0.0
    log_dir: str | None = None
    redirect_output: bool = True       # each rank's stdout (structlog) goes to <log_dir>/rank<NNNNN>.log
    progress_every: int = 5
    log_interval: int = 25             # controller balancedness logging (an all-reduce) every n steps
    # load targets: (phases, L, N) float64 rows of routing probabilities, phase of a step by target_at
    targets: Any = None
    phase_start: int = 0               # steps before the first change of phase
    phase_steps: int = 1               # steps per later phase
    hooks: tuple = ()                  # (("module:factory", {kwargs}), ...)
    extra: dict = field(default_factory=dict)  # free-form settings for hooks

    @property
    def physical(self) -> int:
        return self.experts + self.redundant

    def config_dict(self) -> dict:
        """The user-facing settings (no arrays), for reports."""
        keys = ("ranks", "layers", "experts", "redundant", "hidden", "top_k", "tokens", "steps", "interval",
                "window", "mode", "load", "seed", "drift", "dummy_every", "policy", "min_balancedness_gain",
                "collective_timeout_s")
        return {k: getattr(self, k) for k in keys}


@dataclass
class RankContext:
    """What a rank's hooks see and may change."""

    rank: int
    world: int
    opts: SimOptions
    model: Any
    controller: Any
    group: Any
    step: int = 0
    extra: dict = field(default_factory=dict)
    stop: bool = False                 # a hook sets it to end the run early (every rank must agree)


class SimHooks:
    """The hook points of the rank loop (a hook object may define any subset)."""

    def on_start(self, ctx: RankContext) -> None:
        """After the controller and model exist, before the first step."""

    def before_step(self, ctx: RankContext, step: int) -> dict | None:
        """Before step ``step``'s forward; may return overrides: ``{"is_dummy": bool}``, and
        ``{"skip_step": True}`` (the forward runs but ``controller.step`` is not called: fault injection)."""

    def after_step(self, ctx: RankContext, step: int) -> None:
        """After ``controller.step`` of step ``step``."""

    def on_finish(self, ctx: RankContext, result: dict) -> None:
        """After the last step, with the rank's result (may add to it)."""


def build_hooks(specs: Any) -> list[Any]:
    """Instantiate hook objects from ``(("module:factory", kwargs), ...)``."""
    hooks = []
    for spec in specs or ():
        if isinstance(spec, str):
            path, kwargs = spec, {}
        else:
            path, kwargs = spec[0], dict(spec[1] or {})
        module_name, _, attr = path.partition(":")
        if not module_name or not attr:
            raise ValueError(f"hook {path!r} must look like 'package.module:factory'")
        factory = getattr(importlib.import_module(module_name), attr)
        hooks.append(factory(**kwargs))
    return hooks


def call_hooks(hooks: list[Any], name: str, *args: Any) -> list[Any]:
    out = []
    for hook in hooks:
        method = getattr(hook, name, None)
        if method is not None:
            out.append(method(*args))
    return out


# --------------------------------------------------------------------------- the rank body


def progress_path(log_dir: str | os.PathLike, rank: int) -> Path:
    return Path(log_dir) / "progress" / f"rank{rank:05d}.json"


_progress_failed: set[Path] = set()   # the progress files this process could not write (warned once each)


def _write_progress(path: Path | None, payload: dict) -> None:
    """Best effort, as the trace is: a full disk or a file-size limit must not stop the engine for a file that only
    feeds the parent's live line (the first failure of each file is printed to the rank's log)."""
    if path is None:
        return
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(json.dumps(payload))
        os.replace(tmp, path)
    except OSError as exc:
        if path not in _progress_failed:
            _progress_failed.add(path)
            print(f"eplb-fsm simulate: progress file {path} not written ({type(exc).__name__}: {exc}); the rank "
                  "runs on without it", flush=True)


def _maps_agree(phy2log: np.ndarray, group: Any, world: int) -> bool:
    if world == 1 or group is None:
        return True
    import torch.distributed as dist

    mine = torch.from_numpy(phy2log.copy())
    lo, hi = mine.clone(), mine.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    return bool(torch.equal(lo, mine) and torch.equal(hi, mine))


def write_step_progress(path: Path, controller: Any, rank: int, step: int, opts: SimOptions, state: str,
                        **extra: Any) -> None:
    """The progress file simulate's live line reads: this rank's step, state, layer, rearrangements."""
    _write_progress(path, {"rank": rank, "step": step + 1, "steps": opts.steps, "state": state,
                           "layer": controller.layer,
                           "rearrangements": sum(h["outcome"] == "committed" for h in controller.history),
                           **extra})


@dataclass
class OutputTally:
    """What one rank's forward passes showed: output checks, mismatches, per-step balancedness."""

    checks: int = 0
    mismatches: int = 0
    first_mismatch: int | None = None
    series: list = field(default_factory=list)


def rank_result(controller: Any, tally: "OutputTally", wall: float, ctx: RankContext) -> dict:
    """The result fields every rank loop reports (fixed-size and elastic) at the end of a run."""
    entry = controller.models[0]
    return {
        "final_state": controller.state,
        "final_layer": controller.layer,
        "history": controller.history,
        "balancedness": tally.series,
        "controller_balancedness": controller.balancedness_log,
        "state_seconds": controller.state_seconds,
        "output_checks": tally.checks,
        "mismatches": tally.mismatches,
        "first_mismatch_step": tally.first_mismatch,
        "phy2log": entry.maps.phy2log.tolist(),
        "slot_bytes": entry.slot_bytes[0],
        "trace": str(controller.trace.path) if controller.trace.path else None,
        "wall_s": wall,
        "extra": ctx.extra,
    }


def engine_step(ctx: RankContext, hooks: list[Any], opts: SimOptions, model: Any, controller: Any,
                group: Any, world: int, step: int, tally: OutputTally) -> tuple[str, str]:
    """One simulated engine step: hooks, forward with its output check, ``controller.step``.

    Returns ``(state before, state after)``. A hook may mark the step dummy or make this
    rank skip its ``controller.step`` call (fault injection).
    """
    overrides: dict = {}
    for result in call_hooks(hooks, "before_step", ctx, step):
        if result:
            overrides.update(result)
    is_dummy = bool(overrides.get("is_dummy", opts.dummy_every > 0 and step % opts.dummy_every
                                  == opts.dummy_every - 1))
    if not is_dummy:
        model.set_load_target(target_at(opts, step))
        x = model.make_batch(step, opts.tokens)
        out = model.forward(x, group)
        tally.checks += 1
        if not torch.equal(out, model.reference_forward(x)):
            tally.mismatches += 1
            if tally.first_mismatch is None:
                tally.first_mismatch = step
        # the batch's balancedness under the placement it was routed with (local:
        # every rank routes the whole batch)
        tally.series.append((step, balancedness(rank_loads_physical(model.last_global_load, world))))
    before = controller.state
    if overrides.get("skip_step"):
        return before, before  # this rank's engine forgot the controller this step
    return before, controller.step(is_dummy=is_dummy, log_stats=True)


def run_rank(rank: int, world: int, opts: SimOptions) -> dict:
    """Simulate ``opts.steps`` engine steps on this rank; returns the rank's result dict."""
    import torch.distributed as dist

    from eplb_fsm.config import EplbConfig
    from eplb_fsm.fsm.controller import EplbController
    from eplb_fsm.sim.model import ToyMoE

    if opts.log_dir and opts.redirect_output:
        signals.log_to(Path(opts.log_dir) / f"rank{rank:05d}.log")
    group = dist.group.WORLD if dist.is_initialized() else None
    progress = None
    if opts.log_dir:
        progress = progress_path(opts.log_dir, rank)
        progress.parent.mkdir(parents=True, exist_ok=True)
    config = EplbConfig(
        window_size=opts.window,
        step_interval=opts.interval,
        num_redundant_experts=opts.redundant,
        use_async=opts.mode == "async",
        policy=opts.policy,
        log_balancedness=True,
        log_balancedness_interval=max(1, opts.log_interval),
        min_balancedness_gain=opts.min_balancedness_gain,
        collective_timeout_s=opts.collective_timeout_s,
        watchdog_deadline_s=opts.watchdog_deadline_s,
    )
    model = ToyMoE(opts.layers, opts.experts, opts.redundant, opts.hidden, opts.top_k, rank, world,
                   seed=opts.seed, gate_strength=opts.gate_strength)
    controller = EplbController(config, group=group, trace_dir=opts.log_dir)
    controller.add_model(model, "main")
    hooks = build_hooks(opts.hooks)
    ctx = RankContext(rank, world, opts, model, controller, group)
    call_hooks(hooks, "on_start", ctx)
    tally = OutputTally()
    t0 = time.perf_counter()
    step = 0
    try:
        for step in range(opts.steps):
            ctx.step = step
            before, state = engine_step(ctx, hooks, opts, model, controller, group, world, step, tally)
            call_hooks(hooks, "after_step", ctx, step)
            if progress is not None and (step % opts.progress_every == 0 or state != before):
                write_step_progress(progress, controller, rank, step, opts, state)
            if ctx.stop:
                break
        wall = time.perf_counter() - t0
        entry = controller.models[0]
        bad_rows = model.check_weights(entry.maps.phy2log)
        result = {
            "rank": rank,
            "world": world,
            "steps": step + 1,
            **rank_result(controller, tally, wall, ctx),
            "weights_exact": not bad_rows,
            "bad_rows": bad_rows[:20],
            "maps_agree": _maps_agree(entry.maps.phy2log, group, world),
        }
        call_hooks(hooks, "on_finish", ctx, result)
        write_step_progress(progress, controller, rank, step, opts, controller.state, done=True)
        return result
    except BaseException as exc:  # issue 12 wiring: `end how=exception` (SIGTERM: sim/signals.py ends it)
        controller.trace.end("exception", error=f"{type(exc).__name__}: {exc}")
        raise
    finally:
        controller.close()
