"""``eplb-fsm bench movement``: the default policy against the movement-aware one, side by side.

Three parts, all measured in one run:

``synthetic``
    For every shape of ``scenarios.json`` (or ``--shapes``) and every drift sigma (or
    ``--sigmas``): the zipf load of the scenario spec is planned with the default policy
    (the placement in use), then drifted (load x lognormal(0, sigma) per layer and
    expert) and planned again by both policies, the movement-aware one starting from the
    placement in use. Reported per policy: ``balancedness`` on the drifted load (the
    window planned on), ``next_balancedness`` on one more drift step (the next window),
    ``moved`` (fraction of all slots whose expert is new to their rank) and the policy
    time (median and best of ``--repeats`` interleaved runs); then the ratios
    movement-aware / default and whether the issue's targets hold: quality (sigma <= 0.1:
    balancedness ratio >= 0.99 and moved ratio <= 0.10; sigma >= 1: balancedness ratio
    >= 0.98) and, at every sigma, time (median time ratio <= 5). Ratios and verdicts are
    taken on the unrounded figures; the JSON rounds them for display only. A sigma must
    be finite, and small enough that every drifted layer's total load stays below 2**126
    (what the policies take): checked on the drawn loads before anything is timed.
``esft``
    Real routing traces (ESFT, DeepSeek-V2-Lite, bundled with the package) on the v2lite
    shape (a ``--esft-dir`` without them is refused; ``$EPLB_FSM_ESFT_DIR`` without them
    skips this part): consecutive batches of ``--sequences`` sequences are the windows. Each policy
    keeps its own placement and re-plans on every window i; scored on window i and
    i + 1, moves counted against its own previous placement. ``intent`` uses all 26
    layers; ``intent->law`` starts from a plan on intent (layers 1, 13, 26, the only ones
    law has) and then follows the law windows: the domain switch. ``--sequences`` must leave
    at least 3 intent and 2 law windows (one re-plan, and the window after it to score it).
``estimators``
    How the window becomes the planning load (``EplbConfig.load_estimator``): plan with
    the default policy on an estimate over the last ``--history`` windows, score on the
    next window (``--history`` must be below the intent windows, so one is left to score).
    ``window_sum``, ``decayed_sum`` (several decays) and ``subwindow_max`` follow
    :meth:`eplb_fsm.stats.LoadWindow.estimate`, applied here to logical loads
    (bench/movement_traces.py holds the trace parts).
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from eplb_fsm.bench.movement_traces import (
    BUNDLED,
    SHAPE_FOR_TRACES,
    TIME_RATIO_TARGET,
    Timer,
    estimate_logical,
    load_trace_windows,
    policy_ratios,
    rounded,
    rounded_ratios,
    trace_parts,
    verdicts,
)
from eplb_fsm.bench.options import refuse, seed_rule

#: estimate_logical lives in bench/movement_traces.py and is part of this module's API too
__all__ = ["ESFT_DIR_ENV", "TIME_RATIO_TARGET", "add_arguments", "estimate_logical", "run"]

#: default location of the ESFT routing traces (next to the repository)
ESFT_DIR_ENV = "EPLB_FSM_ESFT_DIR"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", default=None, metavar="A,B", help="comma-separated shape names (default: all)")
    parser.add_argument(
        "--sigmas",
        default=None,
        metavar="S,T",
        help="comma-separated drift sigmas, finite and >= 0, small enough that every drifted layer's total load "
        "stays below 2**126 (default: scenarios.json drift sigmas)",
    )
    parser.add_argument(
        "--scenarios", default=None, metavar="FILE", help="scenarios.json to use (default: the bundled one)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic loads and drifts, >= 0 (default 0)")
    parser.add_argument(
        "--repeats", type=int, default=5, metavar="N", help="timed runs per policy and case (default 5)"
    )
    parser.add_argument(
        "--target",
        type=float,
        default=0.99,
        help="movement-aware target fraction of the default's balancedness (default 0.99)",
    )
    parser.add_argument(
        "--esft-dir",
        default=None,
        metavar="DIR",
        help="directory of ESFT routing trace folders intent/ and law/, refused if it has none (default: "
        "$EPLB_FSM_ESFT_DIR, skipped if it has none, else the traces bundled with the package); 'none' skips the "
        "trace parts",
    )
    parser.add_argument("--sequences", type=int, default=2, metavar="N",
                        help="sequences per trace window; the traces must make 3 intent and 2 law windows (default 2)")
    parser.add_argument(
        "--history", type=int, default=8, metavar="W",
        help="windows the load estimators look back over, >= 1 and below the intent windows (default 8)",
    )


# --------------------------------------------------------------------------- helpers


def _parse_list(text: str | None, cast: Callable[[str], Any], name: str) -> list | None:
    if text is None:
        return None
    try:
        values = [cast(part.strip()) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SystemExit(f"eplb-fsm bench movement: {name}: cannot parse {text!r}") from None
    if not values:
        raise SystemExit(f"eplb-fsm bench movement: {name}: empty list")
    return values


def _esft_dir(arg: str | None) -> Path | str | None:
    """Where the traces come from: a directory, :data:`BUNDLED`, or None ('none': skip them)."""
    if arg is not None:
        if arg.lower() == "none":
            return None
        return BUNDLED if arg == BUNDLED else Path(arg)
    env = os.environ.get(ESFT_DIR_ENV)
    return Path(env) if env else BUNDLED


def _has_traces(directory: Path | str) -> bool:
    return directory == BUNDLED or all((Path(directory) / t).is_dir() for t in ("intent", "law"))


def _drifted(seed: int, scenarios: dict, names: list[str], sigmas: list[float]) -> dict[str, tuple]:
    """Per shape: (base load (L, N), [(load, next_load) per sigma]), float64, checked before anything is timed.

    ``load`` is the base drifted once (the window planned on), ``next_load`` drifted again
    (the next window). Both must be loads the policies take (each layer's total finite
    and below 2**126, float32's range); a sigma that drifts past it is refused by name.
    """
    from eplb_fsm.policy.base import checked_float32
    from eplb_fsm.sim.loads import drift, scenario_load

    out = {}
    for index, name in enumerate(names):
        base = scenario_load(name, scenarios, rng=seed + index)
        drifted = []
        for sigma_index, sigma in enumerate(sigmas):
            rng = np.random.default_rng([seed, index, sigma_index])
            try:
                with np.errstate(over="ignore", invalid="ignore"):  # an overflow is what the check reports
                    load = drift(base, sigma, rng)
                    next_load = drift(load, sigma, rng)
                    checked_float32(load)
                    checked_float32(next_load)
            except ValueError:
                raise SystemExit(
                    f"eplb-fsm bench movement: --sigmas: sigma {sigma:g} drifts {name}'s load (seed {seed}) past what "
                    "the policies take: each layer's total load must be finite and below 2**126 (float32's range); "
                    "use a smaller sigma"
                ) from None
            drifted.append((load, next_load))
        out[name] = (base, drifted)
    return out


# --------------------------------------------------------------------------- parts


def _synthetic(args: argparse.Namespace, scenarios: dict, cases: dict[str, tuple], sigmas: list[float]) -> dict:
    """The synthetic part on :func:`_drifted`'s ``cases``: figures, ratios and verdicts per shape and sigma."""
    import torch

    from eplb_fsm.policy.bounds import placement_balancedness
    from eplb_fsm.policy.default import DefaultEplbPolicy
    from eplb_fsm.policy.movement import MovementAwarePolicy, moved_mask

    policy = MovementAwarePolicy(target=args.target)
    out: dict[str, Any] = {}
    for name, (base, drifted) in cases.items():
        shape = scenarios["shapes"][name]
        call = (shape["replicas"], shape["groups"], shape["nodes"], shape["ranks"])
        ranks = shape["ranks"]
        old = DefaultEplbPolicy.rebalance_experts(torch.from_numpy(base), *call)[0]
        per_sigma = {}
        for sigma, (load, next_load) in zip(sigmas, drifted):
            weight = torch.from_numpy(load)
            timer = Timer()
            DefaultEplbPolicy.rebalance_experts(weight, *call)  # warm-up
            policy.rebalance_experts(weight, *call, old)
            for _ in range(max(args.repeats, 1)):
                d = timer("default", lambda: DefaultEplbPolicy.rebalance_experts(weight, *call))
                m = timer("movement_aware", lambda: policy.rebalance_experts(weight, *call, old))
            raw = {
                key: {
                    "balancedness": placement_balancedness(placement, load, ranks),
                    "next_balancedness": placement_balancedness(placement, next_load, ranks),
                    "moved": float(moved_mask(old.numpy(), placement.numpy(), ranks).mean()),
                    "ms": timer.median(key) * 1e3,
                    "best_ms": timer.best(key) * 1e3,
                }
                for key, placement in (("default", d[0]), ("movement_aware", m[0]))
            }
            # ratios and verdicts on the unrounded figures (a printed 0.99 may be 0.98996, a miss); rounded to print
            row: dict[str, Any] = {
                key: {figure: rounded(value, 3 if figure.endswith("ms") else 4) for figure, value in figures.items()}
                for key, figures in raw.items()
            }
            row["old_balancedness"] = rounded(placement_balancedness(old, load, ranks))
            ratios = policy_ratios(raw["default"], raw["movement_aware"])
            ratios["time_ratio_best"] = raw["movement_aware"]["best_ms"] / raw["default"]["best_ms"]
            row.update(rounded_ratios(ratios))
            row.update(verdicts(sigma, ratios))
            per_sigma[str(sigma)] = row
        out[name] = {"shape": {k: shape[k] for k in ("layers", "experts", "replicas", "ranks", "nodes", "groups")},
                     "sigmas": per_sigma}
    return out


# --------------------------------------------------------------------------- entry point


def run(args: argparse.Namespace) -> dict:
    from eplb_fsm.sim.loads import load_scenarios

    if args.repeats < 1:
        raise SystemExit("eplb-fsm bench movement: --repeats must be >= 1")
    if not 0.0 < args.target <= 1.0:
        raise SystemExit("eplb-fsm bench movement: --target must be in (0, 1]")
    if args.sequences < 1:
        raise SystemExit("eplb-fsm bench movement: --sequences must be >= 1")
    if args.history < 1:
        raise SystemExit(f"eplb-fsm bench movement: --history must be >= 1 (windows), got {args.history}")
    refuse("movement", [seed_rule(args.seed)])
    try:
        scenarios = load_scenarios(args.scenarios)
    except ValueError as exc:
        raise SystemExit(f"eplb-fsm bench movement: --scenarios: {exc}") from None
    names = _parse_list(args.shapes, str, "--shapes") or list(scenarios["shapes"])
    unknown = [n for n in names if n not in scenarios["shapes"]]
    if unknown:
        raise SystemExit(
            f"eplb-fsm bench movement: --shapes: unknown shape(s) {unknown}; known: {', '.join(scenarios['shapes'])}"
        )
    sigmas = _parse_list(args.sigmas, float, "--sigmas") or [
        float(s) for s in scenarios.get("drift", {}).get("sigmas", [0.1])
    ]
    bad = [s for s in sigmas if not (s >= 0 and math.isfinite(s))]
    if bad:  # inf drifted every load to inf or NaN
        raise SystemExit(f"eplb-fsm bench movement: --sigmas must be finite and >= 0, got {bad[0]}")
    directory = _esft_dir(args.esft_dir)
    if args.esft_dir is not None and directory is not None and not _has_traces(directory):
        # asked for by name: a missing or mistyped folder must not pass as a run without its trace parts
        raise SystemExit(f"eplb-fsm bench movement: --esft-dir: {args.esft_dir} is not a folder of ESFT traces (it "
                         "needs intent/ and law/ folders); pass --esft-dir none to skip the trace parts")
    # every input checked before anything is timed: the drifted loads, then the trace windows
    cases = _drifted(args.seed, scenarios, names, sigmas)
    skipped = None
    if directory is None:
        skipped = "--esft-dir none"
    elif not _has_traces(directory):
        skipped = f"no ESFT traces at {directory}"
    elif SHAPE_FOR_TRACES not in scenarios["shapes"]:
        skipped = f"scenarios have no {SHAPE_FOR_TRACES} shape"
    else:
        trace_shape = scenarios["shapes"][SHAPE_FOR_TRACES]
        windows = load_trace_windows(directory, args.sequences, args.history, trace_shape["experts"])

    started = time.perf_counter()
    result: dict[str, Any] = {
        "benchmark": "movement",
        "baseline": "DefaultEplbPolicy (re-plans from scratch), same run",
        "scenarios": scenarios["path"],
        "seed": args.seed,
        "repeats": args.repeats,
        "target": args.target,
        "synthetic": _synthetic(args, scenarios, cases, sigmas),
    }
    if skipped is not None:
        result["esft"] = {"skipped": skipped}
    else:
        result["esft"], result["estimators"] = trace_parts(windows, trace_shape, args.target, args.sequences,
                                                           args.history)
    rows = [row for shape in result["synthetic"].values() for row in shape["sigmas"].values()]
    quality = [row["quality_met"] for row in rows if "quality_met" in row]
    met = [row["target_met"] for row in rows]
    result["summary"] = {
        "targets_met": f"{sum(met)}/{len(met)}",
        "quality_targets_met": f"{sum(quality)}/{len(quality)}",
        "time_targets_met": f"{sum(row['time_met'] for row in rows)}/{len(rows)} (time ratio <= {TIME_RATIO_TARGET:g})",
        "max_time_ratio": max(row["time_ratio"] for row in rows),
        "seconds": rounded(time.perf_counter() - started, 1),
    }
    return result
