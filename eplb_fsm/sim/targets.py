"""The load targets of ``eplb-fsm simulate``: the routing every rank's gate follows, step by step.

The parent builds them once (:func:`load_targets`, into ``SimOptions.targets``, an
(phases, L, N) float64 array of routing probabilities) so that every rank sees the same
numbers; :func:`target_at` gives a step's (L, N) row. A drifting load (zipf, a load file,
``esft:TASK``) changes phase once per ``--interval``; at most :data:`MAX_DRIFT_PHASES`
distinct phases are built and a longer run reuses them in a cycle, so the targets stay
small whatever ``--steps`` / ``--interval`` ask for. :func:`check_targets_size` refuses,
before anything is built, targets over :data:`MAX_TARGET_BYTES` (each rank holds a copy).
numpy only: the command checks these without importing torch's rank code.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["MAX_DRIFT_PHASES", "MAX_TARGET_BYTES", "check_targets_size", "default_esft_dir", "drift_phases",
           "load_targets", "target_at"]

#: distinct drift phases built at most; a run with more reuses them in a cycle (phase k is phase k mod this)
MAX_DRIFT_PHASES = 1024
#: largest load targets a run may build (phases x layers x experts x 8 bytes): the launcher holds them
#: and every rank gets a copy
MAX_TARGET_BYTES = 256 << 20


def default_esft_dir() -> Path | str:
    """Where the ESFT 'intent' traces are: ``$EPLB_FSM_ESFT_DIR``, else ``"esft:intent"`` (bundled with the package)."""
    env = os.environ.get("EPLB_FSM_ESFT_DIR")
    return Path(env) if env else "esft:intent"


def _fit(matrix: np.ndarray, layers: int, experts: int) -> np.ndarray:
    """Adapt a (L', N') load to (layers, experts): layers cycle, experts fold (e mod N) or repeat."""
    m = np.asarray(matrix, dtype=np.float64)
    m = m[np.arange(layers) % m.shape[0]]
    n = m.shape[1]
    if n >= experts:
        out = np.zeros((layers, experts))
        for e in range(n):
            out[:, e % experts] += m[:, e]
    else:
        out = m[:, np.arange(experts) % n]
        with np.errstate(over="ignore"):  # repeated loads can overflow where the file's own sums did not
            if not np.isfinite(out.sum(axis=1)).all():
                raise ValueError(f"repeated to {experts} experts, a layer's loads sum past the largest float; "
                                 "scale them down")
    return out


def _normalise(p: np.ndarray) -> np.ndarray:
    p = np.asarray(p, dtype=np.float64) + 1e-12
    return p / p.sum(axis=-1, keepdims=True)


def drift_phases(steps: int, interval: int) -> tuple[int, int]:
    """``(phases the run goes through, phases built)`` of a drifting load: the first phase, then one more per
    ``interval`` from mid-way through the first interval; built: at most :data:`MAX_DRIFT_PHASES`."""
    first = max(1, interval // 4)
    phases = 1 + max(0, (steps - first - interval // 2) // interval + 1)
    return phases, min(phases, MAX_DRIFT_PHASES)


def check_targets_size(layers: int, experts: int, phases: int, what: str) -> None:
    """ValueError naming the options when ``phases`` (L, N) float64 targets would pass :data:`MAX_TARGET_BYTES`;
    ``what`` says where the phases come from."""
    size = phases * layers * experts * 8
    if size > MAX_TARGET_BYTES:
        raise ValueError(f"--layers x --experts: {what}, of {layers} layers x {experts} experts each, would take "
                         f"{size / 2**20:.0f} MiB of load targets (in the launcher and again in each rank), over the "
                         f"limit of {MAX_TARGET_BYTES >> 20} MiB; use fewer layers or experts")


def load_targets(opts: Any) -> Any:
    """Fill ``opts.targets`` / ``phase_*`` from ``opts.load`` (run once, in the parent); ``opts``: a ``SimOptions``.

    ``zipf``: a zipf skew that drifts (lognormal, sigma = ``drift``) once per interval, at
    mid-interval so each rearrangement plans on one phase. ``esft``: real per-batch routing of the
    ESFT 'intent' traces (4 sequences per batch), one batch per step, cycling. A file path, ``example``
    or ``esft:<task>`` (the task's whole-trace token counts, not per batch): that (L, N) load, drifting.
    A drifting load builds at most :data:`MAX_DRIFT_PHASES` phases (:func:`target_at` cycles them).
    ValueError (:func:`check_targets_size`) when the targets would be too large, before they are built.
    """
    from eplb_fsm.sim import loads

    rng = np.random.default_rng(opts.seed)
    first = max(1, opts.interval // 4)
    if opts.load == "esft":
        directory = default_esft_dir()
        if isinstance(directory, Path) and not directory.is_dir():
            raise ValueError(f"--load esft: ESFT traces not found at {directory} (EPLB_FSM_ESFT_DIR)")
        available = loads.esft_layers(directory)
        chosen = [available[i % len(available)] for i in range(min(opts.layers, len(available)))]
        windows = loads.esft_load_windows(directory, 4, num_experts=64, layers=chosen)
        check_targets_size(opts.layers, opts.experts, len(windows), f"--load esft's {len(windows)} batches")
        targets = np.stack([_normalise(_fit(w, opts.layers, opts.experts)) for w in windows])
        opts.targets, opts.phase_start, opts.phase_steps = targets, 1, 1
        return opts
    _, built = drift_phases(opts.steps, opts.interval)
    check_targets_size(opts.layers, opts.experts, built,
                       f"{built} drift phases (one per --interval, at most {MAX_DRIFT_PHASES}, then reused)")
    if opts.load == "zipf":
        base = loads.zipf_load(opts.layers, opts.experts, exponent=opts.zipf_exponent,
                               tokens_per_layer=1_000_000, rng=rng)
    else:
        base = _fit(loads.load_matrix(opts.load), opts.layers, opts.experts)
    current = _normalise(base)
    targets = [current]
    for _ in range(built - 1):
        current = _normalise(loads.drift(current, opts.drift, rng))
        targets.append(current)
    opts.targets = np.stack(targets)
    opts.phase_start = first + opts.interval // 2
    opts.phase_steps = opts.interval
    return opts


def target_at(opts: Any, step: int) -> np.ndarray:
    """The routing target of ``step``: (L, N); past the last phase built, the phases repeat in a cycle."""
    targets = opts.targets
    if step < opts.phase_start:
        return targets[0]
    phase = 1 + (step - opts.phase_start) // opts.phase_steps
    return targets[phase % len(targets)]
