"""The run of ``eplb-fsm simulate``: launch the ranks, watch them, then build the report and plot.

:func:`run_simulation` starts every rank (``eplb_fsm.sim.launcher``, or the elastic
launcher with ``--scale``), shows the progress line meanwhile, and returns the report of
``eplb_fsm.commands.simulate_report`` (the failed-run report when ranks fail), with the
replay verdict, the check that every injection fired, and the balancedness PNG.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TextIO

from eplb_fsm.commands.simulate_progress import Progress
from eplb_fsm.commands.simulate_report import build_failed_report, build_report, replay_verdict

__all__ = ["run_simulation", "check_injections_fired"]


def run_simulation(opts, progress: bool = True, stream: TextIO | None = None, timeout: float = 300.0,
                   png: str | None = None, want_png: bool = True) -> dict:
    """Run every rank, then build the report (see :func:`build_report`).

    When ranks fail (a rank raised, died, or missed the deadline ``timeout``) the report is
    :func:`build_failed_report`'s instead, with ``ok`` false; the traces stay in
    ``opts.log_dir``. With injected faults, with ``--scale`` (elastic EP: the replay follows
    the group swaps), or after a failure, the report carries the replay verdict of the
    traces (``report["replay"]``); a failed run's text leads with it when it blames a rank.
    """
    from eplb_fsm.sim.launcher import RankFailedError, RanksTimeoutError, run_ranks
    from eplb_fsm.sim.run import run_rank

    stream = stream if stream is not None else sys.stderr
    scaling = bool(opts.extra.get("scale"))

    def launch() -> list:
        if scaling:  # elastic EP: processes leave and join (eplb_fsm.sim.elastic_launcher)
            from eplb_fsm.sim.elastic_launcher import run_elastic

            return run_elastic(opts, timeout=timeout)
        logs = opts.log_dir if opts.log_dir and opts.redirect_output else None  # each rank's log from its start
        return run_ranks(run_rank, opts.ranks, args=(opts,), timeout=timeout, rank_logs=logs)

    t0 = time.perf_counter()
    try:
        if progress:
            with Progress(opts, stream):
                results = launch()
        else:
            results = launch()
    except (RankFailedError, RanksTimeoutError) as exc:
        report = build_failed_report(opts, exc, time.perf_counter() - t0)
        report["replay"] = replay_verdict(opts.log_dir)
        report["png"], report["png_note"] = None, None
        check_injections_fired(opts, report)
        return report
    wall = time.perf_counter() - t0
    if scaling:
        from eplb_fsm.sim.elastic_report import elastic_report, final_members

        everyone, results = results, final_members(results)
        report = elastic_report(opts, everyone, build_report(opts, results, wall))
    else:
        report = build_report(opts, results, wall)
    if opts.extra.get("inject"):
        report["inject"] = list(opts.extra["inject"])
    if opts.extra.get("inject") or scaling:
        report["replay"] = replay_verdict(opts.log_dir)
        # every rank finished, but traces that diverge (an injected fault, or a group swap the
        # ranks did not make alike) are not ok
        report["ok"] = bool(report["ok"] and report["replay"]["verdict"] == "healthy")
    check_injections_fired(opts, report)
    report["png"], report["png_note"] = None, None
    if want_png:
        report["png"], report["png_note"] = _write_plot(opts, report, results, png)
    return report


def _write_plot(opts, report: dict, results: list[dict], png: str | None) -> tuple[str | None, str | None]:
    """Draw the balancedness PNG; a failure becomes a note, never an exception (the report must come out)."""
    from eplb_fsm.sim.plot import plot_balancedness, rank_timeline

    path = png or str(Path(opts.log_dir) / "balancedness.png")
    timeline = rank_timeline(opts.ranks, report.get("scalings", ()))
    ranks = " -> ".join(str(n) for _, n in timeline) if len(timeline) > 1 else str(opts.ranks)
    load = Path(opts.load).name if opts.load not in ("zipf", "esft") else opts.load
    title = f"{ranks} ranks, {opts.layers} layers, {opts.experts}+{opts.redundant} slots, {opts.mode}, load {load}"
    drifts = opts.load != "esft" and opts.drift > 0
    try:
        return plot_balancedness(results[0]["balancedness"], report["rearrangements"], path, title=title,
                                 phase_start=opts.phase_start if drifts else None, phase_steps=opts.phase_steps,
                                 window=opts.window, scalings=report.get("scalings", ()), ranks=opts.ranks)
    except Exception as exc:  # noqa: BLE001 - a plot problem must not cost the report (a stop request is no Exception)
        return None, f"the plot could not be written to {path}: {type(exc).__name__}: {exc}"


def check_injections_fired(opts, report: dict) -> None:
    """``report["inject_unfired"]``: the ``--inject`` specs no trace shows firing; any makes ``ok`` false."""
    specs = opts.extra.get("inject")
    if not specs:
        return
    from eplb_fsm.sim.inject_report import unfired_injections

    report["inject_unfired"] = unfired_injections(specs, opts.log_dir)
    if report["inject_unfired"]:
        report["ok"] = False
