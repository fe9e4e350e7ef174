"""Balancedness over steps as a PNG (matplotlib is the optional ``plot`` extra).

``plot_balancedness`` returns ``(path, None)`` when it wrote the file, or
``(None, reason)`` when it could not (matplotlib missing, nothing to plot), so callers
can say why there is no picture instead of failing.

What the picture shows, per engine step: the measured balancedness of the live batch
(thin) and its moving mean (thick); each rearrangement (vertical line) with its
*planned* balancedness (before -> after, both scored on the load the planner saw) beside
the *measured* mean over the window after it; the drift phases of the synthetic load
(shaded bands: the load changes at each band edge); and in an elastic run the scale
events and the number of ranks over time (right axis).
"""

from __future__ import annotations

import os
from typing import Sequence

#: the caption under the plot: why planned and measured differ
CAPTION = ("planned: the new placement scored on the load window the planner saw; measured: the live batches "
           "that follow, sampled per step and drifting, so measured stays below planned")


def matplotlib_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def rank_timeline(ranks: int, scalings: Sequence[dict] = ()) -> list[tuple[int, int]]:
    """``[(step, ranks), ...]``: the start size, then each scale that changed the group (aborted ones do not)."""
    timeline = [(0, int(ranks))]
    for sc in scalings:
        to = sc.get("to_ranks")
        if to is not None and to != timeline[-1][1]:
            timeline.append((int(sc["step"]), int(to)))
    return timeline


def _moving_mean(values: Sequence[float], smooth: int) -> list[float]:
    mean, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= smooth:
            acc -= values[i - smooth]
        mean.append(acc / min(i + 1, smooth))
    return mean


def _phases(ax, first: int, last: int, phase_start: int, phase_steps: int) -> None:
    """Shade every other drift phase; the load the ranks serve changes at each band edge."""
    edges = [first]
    edge = phase_start
    while edge < last and phase_steps > 0:
        if edge > first:
            edges.append(edge)
        edge += phase_steps
    edges.append(last)
    for i in range(len(edges) - 1):
        if i % 2 == 1:
            ax.axvspan(edges[i], edges[i + 1], color="0.85", alpha=0.45, linewidth=0,
                       label="drift phase (load changes at each edge)" if i == 1 else None)


def plot_balancedness(
    series: Sequence[tuple[int, float]],
    rearrangements: Sequence[dict],
    path: str | os.PathLike,
    title: str = "balancedness per step",
    smooth: int = 10,
    phase_start: int | None = None,
    phase_steps: int = 1,
    window: int | None = None,
    scalings: Sequence[dict] = (),
    ranks: int | None = None,
) -> tuple[str | None, str | None]:
    """Plot per-step balancedness (thin), its ``smooth``-step moving mean (thick) and what explains it.

    ``series``: (step, balancedness) pairs. ``rearrangements``: the report's entries
    (``step``, ``end_step``, ``outcome``, planned ``balancedness_before`` /
    ``balancedness_after``, ``measured_after``); committed ones are solid lines, skipped
    or aborted ones dashed. ``phase_start`` / ``phase_steps``: the drift phases to shade
    (None: no drift). ``window``: steps the measured mean after a rearrangement covers.
    ``scalings`` (the report's) and ``ranks`` (the start size): scale events and the rank
    count over time. Returns ``(path, None)`` or ``(None, reason)``.
    """
    if not series:
        return None, "no balancedness samples to plot"
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        return None, "matplotlib is not installed (pip install 'eplb-fsm[plot]'); PNG skipped"
    steps = [s for s, _ in series]
    values = [v for _, v in series]
    fig, ax = plt.subplots(figsize=(10, 4.4), dpi=110)
    try:
        if phase_start is not None:
            _phases(ax, steps[0], steps[-1], phase_start, phase_steps)
        ax.plot(steps, values, linewidth=0.6, alpha=0.45, color="tab:blue", label="measured per step")
        if smooth > 1 and len(values) >= smooth:
            ax.plot(steps, _moving_mean(values, smooth), linewidth=1.8, color="tab:blue",
                    label=f"measured, {smooth}-step mean")
        labelled: set[str] = set()

        def once(label: str) -> str | None:
            if label in labelled:
                return None
            labelled.add(label)
            return label

        for r in rearrangements:
            committed = r.get("outcome") == "committed"
            kind = "rearrangement" if committed else f"{r.get('outcome', 'skipped')}"
            ax.axvline(r["step"], color="tab:green" if committed else "tab:gray",
                       linestyle="-" if committed else "--", linewidth=1.0, label=once(kind))
            before, after = r.get("balancedness_before"), r.get("balancedness_after")
            if before is not None and after is not None:
                ax.plot([r["step"]], [before], marker="v", markersize=6, color="tab:orange", fillstyle="none",
                        linestyle="none", label=once("planned, old placement"))
                ax.plot([r["step"]], [after], marker="^", markersize=7, color="tab:orange", linestyle="none",
                        label=once("planned, new placement"))
            measured = r.get("measured_after")
            if committed and measured is not None and window:
                start = r.get("end_step", r["step"])
                ax.hlines(measured, start, min(start + window, steps[-1]), colors="tab:red", linewidth=2.0,
                          label=once(f"measured mean, {window} steps after"))
        timeline = rank_timeline(ranks, scalings) if ranks is not None else []
        for sc in scalings:
            moved = sc.get("to_ranks") is not None and sc.get("from_ranks") is not None
            ax.axvline(sc["step"], color="tab:purple", linestyle="-." if moved else ":", linewidth=1.4,
                       label=once("scale event"))
            text = (f"{sc['from_ranks']}->{sc['to_ranks']}" if moved
                    else f"->{sc.get('requested_ranks')} {sc.get('outcome', '')}".strip())
            ax.annotate(text, (sc["step"], 1.02), xytext=(3, 0), textcoords="offset points", fontsize="small",
                        color="tab:purple", va="top")
        ax.set_xlabel("engine step")
        ax.set_ylabel("balancedness (mean / max rank load)")
        ax.set_ylim(0.0, 1.05)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        if len(timeline) > 1:  # elastic: the rank count on a right-hand axis
            right = ax.twinx()
            xs = [s for s, _ in timeline] + [steps[-1]]
            ys = [n for _, n in timeline] + [timeline[-1][1]]
            right.step(xs, ys, where="post", color="tab:purple", linewidth=1.2, alpha=0.8, label="ranks")
            right.set_ylabel("ranks", color="tab:purple")
            right.set_ylim(0, max(ys) * 1.25)
            right.yaxis.get_major_locator().set_params(integer=True)
            h2, l2 = right.get_legend_handles_labels()
            handles, labels = handles + h2, labels + l2
        ax.legend(handles, labels, loc="lower left", fontsize="x-small", ncol=3, framealpha=0.85)
        fig.text(0.01, 0.01, CAPTION, fontsize="x-small", color="0.3", ha="left", va="bottom")
        fig.tight_layout(rect=(0, 0.04, 1, 1))
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)
    return str(path), None
