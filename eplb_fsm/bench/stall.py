"""``eplb-fsm bench stall``: how much a rearrangement slows the engine, sync against async.

W local gloo ranks run the same engine (bench/stall_engine.py: a fixed matmul, the routed load of a fixed skewed
batch, one small all-reduce per step) on a model whose expert rows add up to ``--mb`` MB per rank (by default
320 MB over 16 layers: 20 MB a layer, the "tens of MB" issue 14 names, so the sync stall stands well above this
box's step-to-step noise of a few ms). After ``--warm`` steps the engine asks for one rearrangement
(``EplbController.rearrange()``) and keeps stepping until the controller's ``history`` shows it committed; this
is done once with ``use_async=False`` and once with ``use_async=True`` per repeat (the order alternates between
repeats), each with a fresh controller and model, so both modes plan on the same load and must reach the same
placement.

A step's time is the job's: a step ends when its last rank ends it, and the job's step time is the time from one
such end to the next (the ranks run on one machine, so their monotonic clocks agree). Taking each step's slowest
rank instead would count every lag twice: the engine all-reduce keeps the ranks in lockstep, so a rank that ends
step i late makes the other rank's step i+1 (begun earlier) wait for it by as much
(:func:`eplb_fsm.bench.stall_metrics.job_steps`).
Per run (``runs``): ``baseline_step_ms`` is the median step before the rearrangement and ``baseline_mean_step_ms``
their mean; ``longest_step_ms`` is the longest step from the one that asked for it to the one that committed it,
``longest_extra_ms`` its extra over ``baseline_step_ms``; ``total_extra_ms`` is the sum of (step -
``baseline_mean_step_ms``) over those steps (a sum's baseline is the mean: the steps are skewed,
:func:`eplb_fsm.bench.stall_metrics.run_metrics`). Reported per mode as medians over repeats, with the ratios
async / sync of the longest step's extra time and of the total.
Targets: async adds at most 5% of the sync stall to any single step, 20% in total, judged
unrounded on medians of repeated runs (issue 14's method: >= 7; ``judged_on`` says how many), only
on layers of tens of MB (``--mb`` / ``--layers`` >= 10, ``at_target_size``; else null): ``meets_target.single_step`` is
the median over repeats of async's longest extra step over the median of sync's (the median
repeat, not the worst); ``async_over_sync.longest_extra_worst_repeat`` prints beside it the
worst repeat's own ratio (async / sync in one repeat), ``longest_extra_per_repeat`` each one's.
``async_over_sync.controller_extra`` puts async's ``controller_extra_ms`` (its total less the
engine's own work, which carries the box's noise and any starvation) over the sync stall:
what the controller's calls alone cost the engine thread (labelled; not a target);
``controller_cpu_extra`` is the part of it the engine thread spent on a CPU
(``time.thread_time``), the rest being time it waited inside those calls: for the GIL
while the worker held it, for a peer's post, for the scheduler.
``work_extra`` is the other part of the total (the engine's own work), and
``total_no_engine_credit`` the total with that part counted only when positive, run by
run, then the median (the engine's own work can come out faster during an async
rearrangement than before it, which is the host's doing, not the controller's);
``meets_target.total_no_engine_credit`` holds it to the same target.
``async_over_sync_interval`` gives 95 % paired bootstrap intervals of the three targeted
ratios over the repeats, and ``target_verdict`` judges each target against its interval
(bench/intervals.py): ``unresolved`` where the repeats cannot tell.
``commit_floor`` puts async's own commits (weights and maps, a whole layer in one step, on
the engine thread as in sync mode) over the sync stall: the least either ratio can be on
a host whose engine reads its weights from host memory.

Each repeat also runs ``plain``: the async controller and engine for as many steps as
that repeat's async run took, with no rearrangement; its extras over the same window are
the box's own noise, and ``noise_corrected`` gives async's extras less those (labelled;
``meets_target`` stays on the raw figures). ``breakdown`` says, per mode, where the extra
time went on the engine thread, part by part (bench/stall_stamps.py): on the worst steps
of the rearrangement and in total.

CPU: for each run the engine thread's CPU time (``time.thread_time`` on the thread that steps) and the whole
process's (every thread: the background worker's, gloo's) are taken over the baseline steps and over the
rearrangement, summed over ranks, so a worker that starves the engine thread shows as engine CPU per step
staying flat while its wall time grows and the other threads' CPU rises. ``--engine-threads`` sets
``torch.set_num_threads`` in every rank (intra-op threads of the engine's matmul and of the worker's copies
alike). Each step is also split into the engine's own work (``work_extra``: the same matmul, load and
all-reduce, slowed only by contention) and the rest (``controller_extra``: the controller's calls). The two
config knobs that bound the worker are flags: ``--worker-nice`` (``async_worker_nice``: the worker thread and
the transfer group's threads are reniced) and ``--max-bytes-per-step`` (``async_max_bytes_per_step``: the
transfer goes in chunks of at most that many bytes, one per engine step); ``--poll blocking`` turns off
``async_overlap_poll``; ``--switch-interval`` sets Python's GIL switch interval. ``--engine device`` replaces
the matmul by a CPU-idle wait of its median time (a GPU engine as the host sees it; bench/stall_engine.py). Load
average before and after. A rank that fails (a rearrangement skipped, or not committed within ``--max-steps``)
ends the command with one line naming it (bench/ranks.py).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from typing import Any

from eplb_fsm.bench.options import MAX_THREADS, judged_on, memory_rule, refuse, seed_rule, thread_rule, timeout_rule
from eplb_fsm.bench.stall_metrics import (
    TARGET_LAYER_MB,
    TARGET_SINGLE_STEP,
    TARGET_TOTAL,
    commit_floor,
    judged_targets,
    median_of,
    merge_ranks,
    noise_corrected,
    ratio,
    rounded,
    run_metrics,
)
from eplb_fsm.cli import hidden_alias

MODES = ("sync", "async")
PLAIN = "plain"             # the noise floor: the same steps as the async run, no rearrangement


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", dest="world", type=int, default=2, help="gloo ranks to start, 2-4 (default 2)")
    hidden_alias(parser, "--world", dest="world", type=int)
    parser.add_argument("--mb", type=float, default=320.0,
                        help="MB of expert weights per rank (default 320: with 16 layers, 20 MB a layer)")
    parser.add_argument("--layers", type=int, default=16, help="MoE layers (default 16)")
    parser.add_argument("--experts", type=int, default=16, help="logical experts per layer (default 16)")
    parser.add_argument("--redundant", type=int, default=4, help="redundant slots per layer (default 4)")
    parser.add_argument("--matmul", type=int, default=384, help="engine step work: an N x N matmul (default 384)")
    parser.add_argument("--warm", type=int, default=100,
                        help="steps before the rearrangement, the baseline's sample (default 100)")
    parser.add_argument("--tail", type=int, default=5, help="steps run after the commit (default 5)")
    parser.add_argument("--max-steps", type=int, default=5000,
                        help="steps a rearrangement may take before the run fails (default 5000)")
    parser.add_argument("--repeats", type=int, default=3, help="sync + async pairs, alternating order (default 3)")
    parser.add_argument("--engine-threads", type=int, default=1,
                        help=f"torch.set_num_threads per rank, 1..{MAX_THREADS} (default 1)")
    parser.add_argument("--worker-nice", type=int, default=0,
                        help="config async_worker_nice: nice increment of the async worker and transfer threads "
                             "(default 0)")
    parser.add_argument("--max-bytes-per-step", type=int, default=0,
                        help="config async_max_bytes_per_step: bytes the async worker moves per engine step "
                             "(default 0: no limit)")
    parser.add_argument("--prefetch", action="store_true",
                        help="config async_prefetch: move the next changed layer ahead into a second buffer")
    parser.add_argument("--no-align-slots", dest="align_slots", action="store_false",
                        help="config align_slots=False: commit the policy's rows as given (more rows change)")
    parser.add_argument("--poll", choices=("posted", "blocking"), default="posted",
                        help="config async_overlap_poll: async mode posts its ready flags and reads them on the "
                             "next step (posted) or waits for them within the step (blocking); default posted")
    parser.add_argument("--engine", choices=("matmul", "device"), default="matmul",
                        help="engine step: a CPU matmul, or a CPU-idle wait of its median time modelling a GPU "
                             "engine (default matmul)")
    parser.add_argument("--switch-interval", type=float, default=0.0,
                        help="sys.setswitchinterval in every rank, seconds (default 0: Python's 0.005)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the skewed load")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before the ranks are killed")


def _check(args: argparse.Namespace) -> int:
    """Reject bad settings with the option's name and the rule, before any process starts; return H, the floats
    per expert tensor that make ``--mb`` per rank."""
    refuse("stall", [(2 <= args.world <= 4, f"--ranks must be in 2..4, got {args.world}")])  # divides below
    rules = [
        (0 < args.mb < float("inf"), f"--mb must be > 0 and finite, got {args.mb}"),
        (args.layers >= 1, f"--layers must be >= 1, got {args.layers}"),
        (args.experts >= 2, f"--experts must be >= 2, got {args.experts}"),
        (args.redundant >= 0, f"--redundant must be >= 0, got {args.redundant}"),
        ((args.experts + args.redundant) % args.world == 0,
         f"--experts + --redundant ({args.experts + args.redundant}) must be divisible by --ranks ({args.world})"),
        (args.matmul >= 8, f"--matmul must be >= 8, got {args.matmul}"),
        (args.warm >= 4, f"--warm must be >= 4, got {args.warm}"),
        (args.tail >= 0, f"--tail must be >= 0, got {args.tail}"),
        (args.max_steps >= 1, f"--max-steps must be >= 1, got {args.max_steps}"),
        # one expert a rank and no replica: every placement loads the ranks alike, so the policy moves nothing
        (args.redundant > 0 or args.experts > args.world, f"--experts {args.experts} with --redundant 0 on "
         f"--ranks {args.world} is one expert a rank: nothing to rearrange; use more experts or --redundant >= 1"),
        (args.repeats >= 1, f"--repeats must be >= 1, got {args.repeats}"),
        thread_rule("--engine-threads", args.engine_threads),   # 100000 failed in every rank
        (0 <= args.switch_interval <= 1, f"--switch-interval must be in 0..1 s, got {args.switch_interval}"),
        (0 <= args.worker_nice <= 19, f"--worker-nice must be in 0..19, got {args.worker_nice}"),
        (args.max_bytes_per_step >= 0, f"--max-bytes-per-step must be >= 0, got {args.max_bytes_per_step}"),
        timeout_rule(args.timeout),
        seed_rule(args.seed),
    ]
    refuse("stall", rules)
    slots = (args.experts + args.redundant) // args.world
    hidden = max(1, int(args.mb * 2**20 / (args.layers * slots * 2 * 4)))
    # every rank holds its weights (two float32 (S, H) tensors a layer) and the engine's three matmul matrices
    need = args.world * 4 * (args.layers * slots * 2 * hidden + 3 * args.matmul**2)
    refuse("stall", [memory_rule(need, f"--ranks {args.world} x (--mb {args.mb:g} over --layers {args.layers} "
                                       f"+ three --matmul {args.matmul} square float32 matrices)")])
    return hidden


def _one_run(rank: int, world: int, cfg: dict, mode: str, plain_steps: int = 0,
             device_s: float | None = None) -> dict:
    """One rearrangement in ``mode`` on a fresh controller and model: step times and what it did.

    ``mode`` "plain": the async mode's controller and engine, no rearrangement; the window
    that stands for one is ``plain_steps`` steps from the trigger.
    """
    from eplb_fsm.bench.stall_engine import EngineStep, HeavyMoE, skewed_load
    from eplb_fsm.bench.stall_stamps import StepStamps, cpu_marks, cpu_span, noop
    from eplb_fsm.config import EplbConfig
    from eplb_fsm.fsm.controller import EplbController

    config = EplbConfig(window_size=cfg["warm"], step_interval=10**9, num_redundant_experts=cfg["redundant"],
                        use_async=mode != "sync", collective_timeout_s=cfg["collective_timeout_s"],
                        async_worker_nice=cfg["worker_nice"], async_max_bytes_per_step=cfg["max_bytes_per_step"],
                        async_overlap_poll=cfg["poll"] == "posted", async_prefetch=cfg["prefetch"],
                        align_slots=cfg["align_slots"])
    model = HeavyMoE(cfg["layers"], cfg["experts"], cfg["redundant"], cfg["hidden"], rank, world)
    controller = EplbController(config)
    try:
        controller.add_model(model, "main")
        initial = controller.maps("main").phy2log.copy()
        model.load_weights(initial)
        stamps = StepStamps()
        stamps.instrument(controller)
        load = skewed_load(cfg["seed"], cfg["layers"], cfg["experts"], tokens=4096)
        engine = EngineStep(model, load, cfg["matmul"], seed=cfg["seed"], engine=cfg["engine"], device_s=device_s)
        # a full collection of everything torch and the earlier runs left takes ~100 ms here and
        # lands in whichever step it likes: freeze what exists (as a long-running engine does
        # after start-up) so the measured steps only ever scan what they create
        gc.collect()
        gc.freeze()
        trigger = cfg["warm"]
        skip = min(3, trigger // 2)  # the first steps warm allocator and connections
        times: list[float] = []
        ends: list[float] = []       # when each step ended (perf_counter: one clock for every rank)
        start = 0.0
        work: list[float] = []       # the engine's own part of each step (matmul, load, all-reduce)
        controller_cpu: list[float] = []   # the engine thread's CPU inside the controller's calls
        marks: dict[str, tuple] = {}
        commit = None
        entry: dict = {}
        step = 0
        while commit is None or step <= commit + cfg["tail"]:
            if step == skip:
                marks["base0"] = cpu_marks()
            if step == trigger:
                marks["base1"] = marks["rea0"] = cpu_marks()
            t0 = time.perf_counter()
            if step == 0:
                start = t0
            engine()
            t1 = time.perf_counter()
            noop()
            t2 = time.perf_counter()
            c2 = time.thread_time()
            work.append(t1 - t0)
            if step == trigger and mode != PLAIN:
                controller.rearrange()
            controller.step()
            controller_cpu.append(time.thread_time() - c2)
            t3 = time.perf_counter()
            times.append(t3 - t0)
            ends.append(t3)
            stamps.close_step(engine.parts, t2 - t1, t3 - t2)
            if mode == PLAIN and commit is None and step == trigger + plain_steps - 1:
                commit = step
                marks["rea1"] = cpu_marks()
            if commit is None and controller.history:
                # decisions are shared, so every rank sees the outcome on the same step
                entry = controller.history[-1]
                if entry["outcome"] != "committed":
                    raise RuntimeError(f"{mode} rearrangement ended {entry['outcome']!r} ({entry['reason']}) "
                                       "on this load; try another --seed, --experts or --redundant")
                commit = step
                marks["rea1"] = cpu_marks()
            step += 1
            if commit is None and step > trigger + cfg["max_steps"]:
                raise RuntimeError(f"{mode} rearrangement not committed within --max-steps={cfg['max_steps']} steps")
        final = controller.maps("main").phy2log.copy()
        exact = model.weights_match(final)
    finally:
        controller.close()
        gc.unfreeze()
    return {
        "mode": mode, "times": times, "start": start, "ends": ends, "work": work, "parts": stamps.steps,
        "controller_cpu": controller_cpu, "trigger": trigger, "commit": commit,
        "skip": skip, "moves": int(entry.get("moves", 0)), "moved_bytes": int(entry.get("moved_bytes", 0)),
        "phy2log": final, "changed_slots": int((final != initial).sum()), "bit_exact": exact,
        "weight_bytes": model.weight_bytes, "device_s": engine.device_s,
        "cpu_base": cpu_span(marks["base0"], marks["base1"]), "cpu_rearrange": cpu_span(marks["rea0"], marks["rea1"]),
    }


def _bench_rank(rank: int, world: int, cfg: dict) -> list[dict]:
    import torch.distributed as dist

    # the controller's structlog lines go to stdout by default: keep the parent's JSON clean
    sys.stdout.flush()
    os.dup2(2, 1)
    if cfg["switch_interval"]:
        # how long a thread may hold the GIL while another waits for it (the engine thread
        # waits behind the worker's Python code for up to this long at every switch)
        sys.setswitchinterval(cfg["switch_interval"])
    device_s = None
    if cfg["engine"] == "device":
        # measured once, by rank 0, for every run and rank: a step length drawn anew per run
        # (it varies by 2x on a shared box) would compare sync and async on different engines
        import torch

        from eplb_fsm.bench.stall_engine import device_step_s

        value = torch.tensor([device_step_s(cfg["matmul"], cfg["seed"]) if rank == 0 else 0.0], dtype=torch.float64)
        dist.broadcast(value, src=0)
        device_s = float(value[0])
    runs = []
    for repeat in range(cfg["repeats"]):
        for mode in (MODES if repeat % 2 == 0 else MODES[::-1]):
            dist.barrier()
            runs.append(_one_run(rank, world, cfg, mode, device_s=device_s))
        # the noise floor: as many steps as this repeat's async run took, with nothing to move
        async_run = next(r for r in runs[-2:] if r["mode"] == "async")
        dist.barrier()
        runs.append(_one_run(rank, world, cfg, PLAIN, async_run["commit"] - async_run["trigger"] + 1,
                             device_s=device_s))
    return runs


def run(args: argparse.Namespace) -> dict[str, Any]:
    from eplb_fsm.bench.intervals import rounded as rounded_interval
    from eplb_fsm.bench.ranks import run_bench_ranks
    from eplb_fsm.bench.stall_stamps import breakdown_flat, unflatten

    hidden = _check(args)
    cfg = {"layers": args.layers, "experts": args.experts, "redundant": args.redundant, "hidden": hidden,
           "matmul": args.matmul, "warm": args.warm, "tail": args.tail, "max_steps": args.max_steps,
           "repeats": args.repeats, "seed": args.seed, "worker_nice": args.worker_nice, "poll": args.poll,
           "max_bytes_per_step": args.max_bytes_per_step, "engine": args.engine, "prefetch": args.prefetch,
           "align_slots": args.align_slots,
           "switch_interval": args.switch_interval, "collective_timeout_s": max(10.0, args.timeout / 4)}
    load_before = os.getloadavg()
    per_rank = run_bench_ranks("stall", _bench_rank, args.world, args=(cfg,), timeout=args.timeout,
                               torch_threads=args.engine_threads)
    load_after = os.getloadavg()
    merged = [merge_ranks(list(ranks)) for ranks in zip(*per_rank)]
    runs = [r for r in merged if r["mode"] != PLAIN]
    metrics = {mode: [run_metrics(r) for r in merged if r["mode"] == mode] for mode in (*MODES, PLAIN)}
    median = {mode: median_of(ms) for mode, ms in metrics.items()}
    sync, asy, plain = median["sync"], median["async"], median[PLAIN]

    def r4(value: float | None) -> float | None:
        return None if value is None else round(value, 4)

    def over_sync(key: str, stall: str = "total_extra_s") -> float | None:
        """Async's ``key`` over sync's ``stall`` (default: the total extra), rounded to print; None without a stall."""
        return r4(ratio(asy[key], sync[stall]))

    # the targeted ratios (point figures, intervals, verdicts) judged unrounded, and single_step repeat by repeat
    at_size = args.mb / args.layers >= TARGET_LAYER_MB
    judged = judged_targets(metrics["async"], metrics["sync"], covered=at_size)
    point = {name: r4(value) for name, value in judged["point"].items()}
    intervals = {name: rounded_interval(interval, 4) for name, interval in judged["interval"].items()}

    parts = {mode: median_of([breakdown_flat(r) for r in merged if r["mode"] == mode]) for mode in (*MODES, PLAIN)}
    placements = [r["phy2log"] for r in runs]
    import numpy as np

    return {
        "bench": "stall",
        "backend": "gloo",
        "world": args.world, "layers": args.layers, "experts": args.experts, "redundant": args.redundant,
        "weight_mb_per_rank": round(runs[0]["weight_bytes"] / 2**20, 2),
        "moved_slots": runs[0]["moves"],
        "changed_slots": runs[0]["changed_slots"],   # rows whose expert changes: the commit's copies
        "moved_mb": round(runs[0]["moved_bytes"] / 2**20, 2),
        "matmul": args.matmul,
        "engine_threads": args.engine_threads,
        "worker_nice": args.worker_nice,
        "max_bytes_per_step": args.max_bytes_per_step, "prefetch": args.prefetch, "align_slots": args.align_slots,
        "poll": args.poll,
        "engine": args.engine,
        "device_step_ms": round(runs[0]["device_s"] * 1e3, 3) if args.engine == "device" else None,
        "switch_interval_s": args.switch_interval or sys.getswitchinterval(),
        "repeats": args.repeats,
        "sync": rounded(sync),
        "async": rounded(asy),
        "plain": rounded(plain),
        "runs": {mode: [rounded(m) for m in ms] for mode, ms in metrics.items()},
        "breakdown": {mode: unflatten(rounded(p)) for mode, p in parts.items()},
        "noise_corrected": noise_corrected(sync, asy, plain),
        "commit_floor": commit_floor(sync, asy),
        "async_over_sync": {
            "longest_step": over_sync("longest_step_s", "longest_step_s"),
            "longest_extra": point["single_step"],   # the median repeat's (meets_target's); the worst beside it
            "longest_extra_worst_repeat": r4(judged["longest_extra_worst_repeat"]),
            "longest_extra_per_repeat": [r4(v) for v in judged["longest_extra_per_repeat"]],
            "total_extra": point["total"],
            # async's controller calls alone (total less the engine's own work: noise, starvation)
            "controller_extra": over_sync("controller_extra_s"),
            # of which the engine thread ran on a CPU (copies, bookkeeping); the rest it waited
            # (for the GIL, a peer's post, the OS scheduler)
            "controller_cpu_extra": over_sync("controller_cpu_extra_s"),
            # the engine's own work (the other part of the total): negative when it ran faster
            # during the rearrangement than before it, which is the host's doing
            "work_extra": over_sync("work_extra_s"),
            # the total without that credit (per run: total - min(work_extra, 0); then the median)
            "total_no_engine_credit": point["total_no_engine_credit"],
        },
        "target_single_step": TARGET_SINGLE_STEP,
        "target_total": TARGET_TOTAL,
        "target_size": {"min_mb_per_layer": TARGET_LAYER_MB}, "at_target_size": at_size,  # below it: verdicts null
        "judged_on": judged_on(args.repeats),   # medians of --repeats repeats (the default 3 is fewer than 7)
        # on async_over_sync's medians, unrounded (single_step: the median repeat, not the worst)
        "meets_target": judged["meets_target"],
        # 95 % bootstrap intervals of those three ratios, and each target judged against its
        # unrounded interval: "met" / "missed" only when the whole interval lies on one side of it
        "async_over_sync_interval": intervals,
        "target_verdict": judged["target_verdict"],
        "same_placement": all(np.array_equal(p, placements[0]) for p in placements),
        "bit_exact": all(r["bit_exact"] for r in runs),
        "cores": os.cpu_count(),
        "uptime_load_average": {"before": [round(v, 2) for v in load_before],
                                "after": [round(v, 2) for v in load_after]},
    }
