"""Where a ``bench stall`` step's time goes: per-step stamps on the engine thread, and their breakdown.

Each engine step is cut into parts (seconds, engine thread only):

- ``compute``: the engine's matmul, or the device engine's wait (bench/stall_engine.py);
- ``route``: recording the routed load through the current maps;
- ``engine_all_reduce``: the engine's own collective (it also waits for the slower rank);
- ``gil_probe``: a no-op Python call right after the forward: how long the engine thread
  waited to run Python again (the GIL held by the worker shows here);
- ``ready_all_reduce``: the controller's agreement all-reduces on this thread (async: the
  ready flags every step of a rearrangement, their post and, on the next step, their read;
  sync: the per-layer agreements and the loads);
- ``commit_weights``: writing a transferred layer's rows from the buffer into the weights;
- ``commit_maps``: flipping that layer's maps and window counts;
- ``transfer``: a layer's transfer when it runs on this thread (sync mode only);
- ``controller_other``: the rest of ``rearrange()`` + ``step()`` (policy in sync mode, the
  machine, trace records, job hand-offs).

:class:`StepStamps` wraps the controller's collaborators (``collectives.post`` and the read of
what it returns, which every all-reduce goes through,
``mover.write`` / ``mover.transfer``, each entry's ``commit_row``) on the instance, counting
only calls made on the engine thread (the async worker's transfer runs elsewhere).
:func:`breakdown` turns a merged run's per-step parts into the extra time of each part over
its own baseline: on the worst steps of the rearrangement (over the baseline median, as the
longest step's extra) and in total (over the baseline mean, as the total extra, so the
parts add up to it; eplb_fsm.bench.stall_metrics.run_metrics says why).
:func:`cpu_marks` and :func:`cpu_span` take a run's wall and CPU clocks over a span of steps.
"""

from __future__ import annotations

import resource
import statistics
import threading
import time
from typing import Any, Callable

__all__ = ["PARTS", "StepStamps", "breakdown", "breakdown_flat", "cpu_marks", "cpu_span", "noop", "unflatten"]

ENGINE_PARTS = ("compute", "route", "engine_all_reduce")
CONTROLLER_PARTS = ("ready_all_reduce", "commit_weights", "commit_maps", "transfer")
PARTS = ENGINE_PARTS + ("gil_probe",) + CONTROLLER_PARTS + ("controller_other",)
WORST = 3   # the worst steps the breakdown averages over


def noop() -> None:
    """Nothing: timing a call of it measures how long the calling thread waits to run Python."""


class StepStamps:
    """Accumulates the timed parts of the current step, on the thread that created it."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.current: dict[str, float] = {}
        self.steps: list[dict[str, float]] = []

    def timed(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` that adds its duration to ``part`` when called on the engine thread."""
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != self.thread:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(part, time.perf_counter() - t0)
        return wrapper

    def add(self, part: str, seconds: float) -> None:
        self.current[part] = self.current.get(part, 0.0) + seconds

    def instrument(self, controller: Any) -> None:
        """Time the controller's agreement all-reduce, commits and transfers (after ``add_model``)."""
        coll, mover = controller.collectives, controller.mover
        post = coll.post   # every all-reduce goes through it (a blocking one reads it at once)

        def post_stamped(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                posted = post(*args, **kwargs)
            finally:
                self.add("ready_all_reduce", time.perf_counter() - t0)
            posted.wait = self.timed("ready_all_reduce", posted.wait)   # the read, on this step or the next
            return posted

        coll.post = post_stamped
        mover.transfer = self.timed("transfer", mover.transfer)
        write = self.timed("commit_total", mover.write)

        def write_stamping_maps(new_phy2log: Any, layer: int, pending: Any) -> None:
            # the maps flip: a prepared one (fsm.transfers.PreparedRow) or the entry's commit_row
            prepared = getattr(pending, "prepared", None)
            if prepared is not None:
                prepared.remapped_window = self.timed("commit_maps", prepared.remapped_window)
                prepared.install = self.timed("commit_maps", prepared.install)
            write(new_phy2log, layer, pending)

        mover.write = write_stamping_maps
        for entry in mover.models:
            entry.commit_row = self.timed("commit_maps", entry.commit_row)

    def close_step(self, engine_parts: dict[str, float], gil_probe: float, controller_s: float) -> None:
        """End a step: the engine's parts, the probe, and the controller calls' wall time."""
        cur = self.current
        commit_total = cur.pop("commit_total", 0.0)
        cur["commit_weights"] = max(0.0, commit_total - cur.get("commit_maps", 0.0))
        inner = sum(cur.get(p, 0.0) for p in CONTROLLER_PARTS)
        row = {p: engine_parts.get(p, 0.0) for p in ENGINE_PARTS}
        row["gil_probe"] = gil_probe
        for p in CONTROLLER_PARTS:
            row[p] = cur.get(p, 0.0)
        row["controller_other"] = max(0.0, controller_s - inner)
        self.steps.append(row)
        self.current = {}


def breakdown(times: list[float], parts: list[dict[str, float]], skip: int, trigger: int, end: int) -> dict:
    """Each part's extra time over its baseline (steps ``skip:trigger``), seconds.

    ``times``: (T,) the job's step times; ``parts``: (T,) the parts of the rank that ended each step;
    the rearrangement is steps ``trigger..end`` inclusive. ``worst``: the mean over the
    :data:`WORST` longest steps of the rearrangement of each part's extra (and of the step's);
    ``total``: each part's extra summed over the rearrangement. Worst steps are taken over
    each baseline's median (the typical step), totals over its mean (a sum's baseline).
    ``baseline``: the medians.
    """
    base = {p: statistics.median(row[p] for row in parts[skip:trigger]) for p in PARTS}
    base_step = statistics.median(times[skip:trigger])
    mean = {p: statistics.fmean(row[p] for row in parts[skip:trigger]) for p in PARTS}
    mean_step = statistics.fmean(times[skip:trigger])
    during = list(range(trigger, end + 1))
    worst = sorted(during, key=lambda i: times[i], reverse=True)[:WORST]
    out_worst = {f"{p}_s": statistics.fmean(parts[i][p] - base[p] for i in worst) for p in PARTS}
    out_worst["step_extra_s"] = statistics.fmean(times[i] - base_step for i in worst)
    # the step minus every stamped part: the loop's own Python between stamps, and timer noise
    out_worst["unstamped_s"] = out_worst["step_extra_s"] - sum(out_worst[f"{p}_s"] for p in PARTS)
    out_total = {f"{p}_s": sum(parts[i][p] - mean[p] for i in during) for p in PARTS}
    out_total["step_extra_s"] = sum(times[i] - mean_step for i in during)
    out_total["unstamped_s"] = out_total["step_extra_s"] - sum(out_total[f"{p}_s"] for p in PARTS)
    return {"worst_steps": out_worst, "total": out_total, "baseline": {f"{p}_s": base[p] for p in PARTS}}


def breakdown_flat(run: dict) -> dict[str, float]:
    """:func:`breakdown` of a merged ``bench stall`` run, as flat ``where.part_s`` keys (for medians)."""
    parts = breakdown(run["times"], run["parts"], run["skip"], run["trigger"], run["commit"])
    return {f"{where}.{k}": v for where, d in parts.items() for k, v in d.items()}


def unflatten(flat: dict) -> dict:
    """``{"where.key": v}`` back to ``{"where": {"key": v}}``."""
    out: dict = {}
    for key, v in flat.items():
        where, k = key.split(".", 1)
        out.setdefault(where, {})[k] = v
    return out


def cpu_marks() -> tuple[float, float, float]:
    """(wall, engine-thread CPU, whole-process CPU) seconds now; call it on the engine thread."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), time.thread_time(), usage.ru_utime + usage.ru_stime


def cpu_span(start: tuple, end: tuple) -> dict[str, float]:
    """The seconds between two :func:`cpu_marks`, each clock apart."""
    wall, engine, process = (b - a for a, b in zip(start, end))
    return {"wall_s": wall, "engine_cpu_s": engine, "process_cpu_s": process}
