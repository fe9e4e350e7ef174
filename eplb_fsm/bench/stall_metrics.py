"""``bench stall``'s figures from the ranks' step records: pure functions, no I/O.

:func:`merge_ranks` turns the ranks' records of one run into the job's: a step ends when
its last rank ends it (:func:`job_steps`). :func:`run_metrics` gives a merged run's
baseline, longest and total extra step time, their split and its CPU; :func:`median_of`,
:func:`noise_corrected` and :func:`commit_floor` combine the runs of each mode,
:func:`judged_targets` holds the targeted ratios to their targets, and :func:`rounded`
prints seconds as milliseconds. Every time is in seconds. Every verdict is taken on the
unrounded figures; rounding is for display only.
"""

from __future__ import annotations

import statistics

__all__ = ["TARGETED", "TARGET_LAYER_MB", "TARGET_SINGLE_STEP", "TARGET_TOTAL", "commit_floor", "job_steps",
           "judged_targets", "median_of", "merge_ranks", "noise_corrected", "ratio", "rounded", "run_metrics"]

TARGET_SINGLE_STEP = 0.05   # async's longest extra step time, as a fraction of sync's
TARGET_TOTAL = 0.20         # async's total extra step time, as a fraction of sync's
TARGET_LAYER_MB = 10.0      # the targets are for layers of tens of MB (issue 14): MB of weights per layer and rank
#: the targeted ratios, one row each: its name (in meets_target, the intervals and the verdicts),
#: async's figure, sync's stall it is put over, and its target (an upper bound); the last is
#: the total without crediting an engine that ran faster than its baseline
TARGETED = (("single_step", "longest_extra_s", "longest_extra_s", TARGET_SINGLE_STEP),
            ("total", "total_extra_s", "total_extra_s", TARGET_TOTAL),
            ("total_no_engine_credit", "total_no_engine_credit_s", "total_extra_s", TARGET_TOTAL))


def job_steps(starts: list[float], ends: list[list[float]]) -> tuple[list[float], list[int], list[float]]:
    """The job's step times, the rank that ended each step last, and how early that rank began it.

    ``starts``: (W,) when each rank began step 0; ``ends``: (W, T) when each rank ended each
    step, on one clock. A step of the job ends when its last rank ends it; its time runs
    from the previous step's end (step 0: from the last rank's start). The rank that ends
    step i last may have begun it before the job's step i-1 ended (it ended i-1 sooner);
    that lead is time it spent waiting for the lagging rank, which the job's step i-1
    already counts. Returns ((T,) seconds, (T,) rank indices, (T,) leads in seconds).
    """
    last = [max(range(len(ends)), key=lambda r: ends[r][i]) for i in range(len(ends[0]))]
    job_ends = [ends[r][i] for i, r in enumerate(last)]
    previous = [max(starts)] + job_ends[:-1]
    times = [b - a for a, b in zip(previous, job_ends)]
    began = [starts[r] if i == 0 else ends[r][i - 1] for i, r in enumerate(last)]
    leads = [p - b for p, b in zip(previous, began)]
    return times, last, leads


def merge_ranks(per_rank: list[dict]) -> dict:
    """One run as the ranks saw it together: the job's step times, CPU summed, wall of the slowest."""
    first = per_rank[0]
    if any(len(r["times"]) != len(first["times"]) or r["commit"] != first["commit"] for r in per_rank):
        raise RuntimeError("ranks disagree on the steps of a run (their decisions must be shared)")
    times, last, leads = job_steps([r["start"] for r in per_rank], [r["ends"] for r in per_rank])
    # the split of each step into engine work and controller calls, from the rank that ended
    # it; its lead (waiting for a rank that ended the step before late) is taken off its
    # engine all-reduce, where a lockstep rank waits, since the job's previous step counts it
    work = [per_rank[r]["work"][i] - lead for i, (r, lead) in enumerate(zip(last, leads))]
    # the engine thread's CPU inside the controller's calls, from the same rank (absent: none taken)
    cpu_of = [r.get("controller_cpu") or [0.0] * len(times) for r in per_rank]
    controller_cpu = [cpu_of[r][i] for i, r in enumerate(last)]
    parts = []
    for i, (r, lead) in enumerate(zip(last, leads)):
        row = dict(per_rank[r]["parts"][i])
        row["engine_all_reduce"] = row.get("engine_all_reduce", 0.0) - lead
        parts.append(row)
    cpu = {}
    for key in ("cpu_base", "cpu_rearrange"):
        cpu[key] = {
            "wall_s": max(r[key]["wall_s"] for r in per_rank),
            "engine_cpu_s": sum(r[key]["engine_cpu_s"] for r in per_rank),
            "process_cpu_s": sum(r[key]["process_cpu_s"] for r in per_rank),
        }
    return {**first, "times": times, "work": work, "controller_cpu": controller_cpu, "parts": parts,
            "bit_exact": all(r["bit_exact"] for r in per_rank), **cpu}


def run_metrics(run: dict) -> dict[str, float]:
    """Baseline, longest and total extra step time of one merged run (seconds).

    The longest step's extra is over the median step before the rearrangement (the typical
    step); the total's is over their mean. Steps here are skewed (most near the median, a
    tail of slow ones), and a sum of deviations from the median grows by (mean - median) a
    step: runs with nothing to move summed to +40..+155 ms over 65-132 steps that way.
    """
    times, trigger, commit = run["times"], run["trigger"], run["commit"]
    before = times[run["skip"]:trigger]
    baseline = statistics.median(before)
    baseline_mean = statistics.fmean(before)
    during = times[trigger:commit + 1]
    work = run["work"]
    work_base = statistics.fmean(work[run["skip"]:trigger])
    longest = max(during)
    total_extra = sum(during) - len(during) * baseline_mean
    work_extra = sum(work[trigger:commit + 1]) - len(during) * work_base
    base_steps = trigger - run["skip"]
    rea_steps = len(during)
    cb, cr = run["cpu_base"], run["cpu_rearrange"]
    # a layer's weights and maps flip together between two forwards, on the engine thread in
    # either mode (host weights): no async schedule moves this time off the engine's steps
    commits = [p["commit_weights"] + p["commit_maps"] for p in run["parts"][trigger:commit + 1]]
    controller_cpu = run.get("controller_cpu") or [0.0] * len(times)   # (T,) engine-thread CPU in the calls
    cpu_base = statistics.fmean(controller_cpu[run["skip"]:trigger])
    return {
        "baseline_step_s": baseline,
        "baseline_mean_step_s": baseline_mean,
        # the noise floor: the longest step with no rearrangement (a loaded machine's hiccups)
        "baseline_longest_step_s": max(before),
        "longest_step_s": longest,
        "longest_extra_s": longest - baseline,
        "total_extra_s": total_extra,
        # where it went: the engine's own work slowed down (CPU or GIL taken by the worker), or
        # the rest: the controller's calls in the step (sync: the whole transfer; async: commits,
        # the ready flags' all-reduce, waiting there for a slower rank)
        "work_extra_s": work_extra,
        "controller_extra_s": total_extra - work_extra,
        # the total without crediting an engine that ran faster than before the rearrangement
        "total_no_engine_credit_s": total_extra - min(work_extra, 0.0),
        # of the controller's extra, what the engine thread spent on a CPU (the rest it waited)
        "controller_cpu_extra_s": sum(controller_cpu[trigger:commit + 1]) - len(during) * cpu_base,
        "commit_s": sum(commits),
        "longest_commit_s": max(commits),
        "steps_to_commit": rea_steps,
        "rearrangement_wall_s": sum(during),
        # CPU seconds per step, summed over ranks: the engine threads', and every other thread's
        "engine_cpu_per_step_base_s": cb["engine_cpu_s"] / base_steps,
        "engine_cpu_per_step_rearrange_s": cr["engine_cpu_s"] / rea_steps,
        "other_cpu_per_step_base_s": (cb["process_cpu_s"] - cb["engine_cpu_s"]) / base_steps,
        "other_cpu_per_step_rearrange_s": (cr["process_cpu_s"] - cr["engine_cpu_s"]) / rea_steps,
        # CPU the rearrangement cost on top of plain steps (all ranks, all threads): with no idle
        # core this is engine time lost, whichever thread spends it
        "extra_cpu_s": cr["process_cpu_s"] - rea_steps * cb["process_cpu_s"] / base_steps,
        "cores_busy_base": cb["process_cpu_s"] / cb["wall_s"] if cb["wall_s"] > 0 else 0.0,
        "cores_busy_rearrange": cr["process_cpu_s"] / cr["wall_s"] if cr["wall_s"] > 0 else 0.0,
    }


def median_of(rows: list[dict]) -> dict:
    """Key by key, the median over runs."""
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def judged_targets(asy_runs: list[dict], sync_runs: list[dict], covered: bool = True) -> dict:
    """The :data:`TARGETED` ratios async / sync held to their targets, unrounded.

    ``asy_runs``, ``sync_runs``: (R,) :func:`run_metrics` dicts, element i of both from
    repeat i. ``point``: each ratio as the median over repeats of async's figure over the
    median of sync's stall (issue 14's method, medians of repeated runs: ``meets_target``
    judges the median repeat, not the worst); ``interval``: its 95 % paired bootstrap
    interval (bench/intervals.py), which ``target_verdict`` judges. Beside them, repeat by
    repeat: ``longest_extra_per_repeat``, (R,) async's longest extra step over sync's in the
    same repeat (None where sync's is <= 0), and ``longest_extra_worst_repeat``, the largest
    of those (None when none is defined). Every figure is unrounded. ``covered`` False (layers
    smaller than the targets name, :data:`TARGET_LAYER_MB`): every ``meets_target`` and
    ``target_verdict`` is None, the ratios and intervals are still given.
    """
    from eplb_fsm.bench.intervals import median_ratio_interval, verdict

    asy, sync = median_of(asy_runs), median_of(sync_runs)
    point = {name: ratio(asy[key], sync[stall]) for name, key, stall, _ in TARGETED}
    # how far each could move with the repeats drawn again, paired repeat by repeat
    interval = {name: median_ratio_interval([m[key] for m in asy_runs], [m[stall] for m in sync_runs])
                for name, key, stall, _ in TARGETED}
    per_repeat = [ratio(a["longest_extra_s"], s["longest_extra_s"]) for a, s in zip(asy_runs, sync_runs)]
    known = [r for r in per_repeat if r is not None]
    return {
        "point": point,
        "interval": interval,
        "meets_target": {name: (point[name] is not None and point[name] <= target) if covered else None
                         for name, _, _, target in TARGETED},
        "target_verdict": {name: verdict(interval[name], target, at_most=True) if covered else None
                           for name, _, _, target in TARGETED},
        "longest_extra_per_repeat": per_repeat,
        "longest_extra_worst_repeat": max(known) if known else None,
    }


def noise_corrected(sync: dict, asy: dict, plain: dict) -> dict:
    """Async's extras less a plain run's over the same steps (the box's own hiccups), against sync's.

    Labelled apart from the raw figures: ``meets_target`` is decided on the raw ones.
    """
    single = asy["longest_extra_s"] - plain["longest_extra_s"]
    total = asy["total_extra_s"] - plain["total_extra_s"]
    r_single, r_total = ratio(single, sync["longest_extra_s"]), ratio(total, sync["total_extra_s"])
    return {
        "what": "async minus a plain run of the same steps with no rearrangement; raw figures decide meets_target",
        "plain_longest_extra_ms": round(plain["longest_extra_s"] * 1e3, 3),
        "plain_total_extra_ms": round(plain["total_extra_s"] * 1e3, 3),
        "async_longest_extra_ms": round(single * 1e3, 3),
        "async_total_extra_ms": round(total * 1e3, 3),
        "longest_extra_over_sync": None if r_single is None else round(r_single, 4),
        "total_extra_over_sync": None if r_total is None else round(r_total, 4),
        # on the unrounded ratios (a printed 0.05 may be 0.05004: over the target)
        "within_target": {"single_step": r_single is not None and r_single <= TARGET_SINGLE_STEP,
                          "total": r_total is not None and r_total <= TARGET_TOTAL},
    }


def commit_floor(sync: dict, asy: dict) -> dict:
    """Async's own commits against sync's stall: the least its ratios can be with host weights.

    A layer's rows and maps must flip together between two forwards, so async makes the
    same commit copies as sync, on the engine thread, a whole layer in one step; no
    schedule of the transfer itself takes them off the engine's steps (a GPU engine only
    enqueues them). Where a floor is above its target, no async mode meets it on this host.
    """
    single = ratio(asy["longest_commit_s"], sync["longest_extra_s"])
    total = ratio(asy["commit_s"], sync["total_extra_s"])
    return {
        "what": "async's commits (weights and maps, engine thread) over sync's stall: the least either ratio can be",
        "async_longest_commit_ms": round(asy["longest_commit_s"] * 1e3, 3),
        "async_commit_ms": round(asy["commit_s"] * 1e3, 3),
        "single_step": None if single is None else round(single, 4),
        "total": None if total is None else round(total, 4),
        "target_below_floor": {"single_step": single is not None and TARGET_SINGLE_STEP < single,
                               "total": total is not None and TARGET_TOTAL < total},
    }


def ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def rounded(d: dict, ms: bool = True) -> dict:
    """Seconds (keys ending ``_s``) as milliseconds (``_ms``), every float to 3 decimals."""
    out = {}
    for k, v in d.items():
        if ms and k.endswith("_s"):
            out[k[:-2] + "_ms"] = round(v * 1e3, 3)
        else:
            out[k] = round(v, 3) if isinstance(v, float) else v
    return out
