"""Balancedness over steps as a PNG (matplotlib is the optional ``plot`` extra).

``plot_balancedness`` returns ``(path, None)`` when it wrote the file, or
``(None, reason)`` when it could not (matplotlib missing, nothing to plot), so callers
can say why there is no picture instead of failing.
"""

from __future__ import annotations

import os
from typing import Sequence


def matplotlib_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot_balancedness(
    series: Sequence[tuple[int, float]],
    rearrangements: Sequence[dict],
    path: str | os.PathLike,
    title: str = "balancedness per step",
    smooth: int = 10,
) -> tuple[str | None, str | None]:
    """Plot per-step balancedness (thin) and its ``smooth``-step moving mean (thick).

    Committed rearrangements are drawn as solid vertical lines, skipped or aborted ones
    dashed. Returns ``(path, None)`` or ``(None, reason)``.
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
    fig, ax = plt.subplots(figsize=(9, 3.6), dpi=110)
    try:
        ax.plot(steps, values, linewidth=0.6, alpha=0.45, color="tab:blue", label="per step")
        if smooth > 1 and len(values) >= smooth:
            mean = []
            acc = 0.0
            for i, v in enumerate(values):
                acc += v
                if i >= smooth:
                    acc -= values[i - smooth]
                mean.append(acc / min(i + 1, smooth))
            ax.plot(steps, mean, linewidth=1.8, color="tab:blue", label=f"{smooth}-step mean")
        labelled = set()
        for r in rearrangements:
            committed = r.get("outcome") == "committed"
            kind = "rearrangement" if committed else f"{r.get('outcome', 'skipped')}"
            ax.axvline(r["step"], color="tab:green" if committed else "tab:gray",
                       linestyle="-" if committed else "--", linewidth=1.0,
                       label=None if kind in labelled else kind)
            labelled.add(kind)
        ax.set_xlabel("engine step")
        ax.set_ylabel("mean / max rank load")
        ax.set_ylim(0.0, 1.05)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize="small")
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)
    return str(path), None
