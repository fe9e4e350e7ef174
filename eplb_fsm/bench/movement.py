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
    >= 0.98) and, at every sigma, time (median time ratio <= 5).
``esft``
    Real routing traces (ESFT, DeepSeek-V2-Lite, bundled with the package) on the v2lite
    shape: consecutive batches of ``--sequences`` sequences are the windows. Each policy
    keeps its own placement and re-plans on every window i; scored on window i and
    i + 1, moves counted against its own previous placement. ``intent`` uses all 26
    layers; ``intent->law`` starts from a plan on intent (layers 1, 13, 26, the only ones
    law has) and then follows the law windows: the domain switch.
``estimators``
    How the window becomes the planning load (``EplbConfig.load_estimator``): plan with
    the default policy on an estimate over the last ``--history`` windows, score on the
    next window. ``window_sum``, ``decayed_sum`` (several decays) and ``subwindow_max``
    follow :meth:`eplb_fsm.stats.LoadWindow.estimate`, applied here to logical loads.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

#: default location of the ESFT routing traces (next to the repository)
ESFT_DIR_ENV = "EPLB_FSM_ESFT_DIR"
#: the issue's limit on movement-aware time / default time (medians, same run), every case
TIME_RATIO_TARGET = 5.0
_SHAPE_FOR_TRACES = "v2lite_ep8"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", default=None, metavar="A,B", help="comma-separated shape names (default: all)")
    parser.add_argument(
        "--sigmas",
        default=None,
        metavar="S,T",
        help="comma-separated drift sigmas (default: scenarios.json drift sigmas)",
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
        help="directory of ESFT routing trace folders intent/ and law/ (default: $EPLB_FSM_ESFT_DIR, else the "
        "traces bundled with the package); 'none' skips the trace parts",
    )
    parser.add_argument("--sequences", type=int, default=2, metavar="N", help="sequences per trace window (default 2)")
    parser.add_argument(
        "--history", type=int, default=8, metavar="W",
        help="windows the load estimators look back over, >= 1 (default 8)",
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


#: ``--esft-dir`` value (and default) meaning the traces bundled with the package
BUNDLED = "bundled"


def _esft_dir(arg: str | None) -> Path | str | None:
    """Where the traces come from: a directory, :data:`BUNDLED`, or None ('none': skip them)."""
    if arg is not None:
        if arg.lower() == "none":
            return None
        return BUNDLED if arg == BUNDLED else Path(arg)
    env = os.environ.get(ESFT_DIR_ENV)
    return Path(env) if env else BUNDLED


def _task(directory: Path | str, task: str) -> Path | str:
    """One task's trace source: ``"esft:<task>"`` for the bundled traces, else ``directory/<task>``."""
    return f"esft:{task}" if directory == BUNDLED else Path(directory) / task


def _has_traces(directory: Path | str) -> bool:
    return directory == BUNDLED or all((Path(directory) / t).is_dir() for t in ("intent", "law"))


def _round(x: float, digits: int = 4) -> float:
    return float(round(float(x), digits))


def estimate_logical(history: np.ndarray, estimator: str, decay: float = 0.9, subwindows: int = 4) -> np.ndarray:
    """Planning load (L, N) from a history of windows (W, L, N), oldest first.

    Same semantics as :meth:`eplb_fsm.stats.LoadWindow.estimate`, applied to logical
    loads: ``window_sum`` sums; ``decayed_sum`` weighs a window of age a (0 = newest) by
    ``decay ** a``; ``subwindow_max`` splits the history into ``subwindows`` consecutive
    parts and takes, per expert, the largest part's mean per window times the windows held.
    """
    history = np.asarray(history, dtype=np.float64)
    if history.ndim != 3 or history.shape[0] == 0:
        raise ValueError(f"history must be (W >= 1, L, N), got shape {history.shape}")
    if estimator == "window_sum":
        return history.sum(0)
    if estimator == "decayed_sum":
        ages = np.arange(history.shape[0] - 1, -1, -1, dtype=np.float64)
        return np.einsum("w,wln->ln", decay**ages, history)
    if estimator == "subwindow_max":
        parts = np.array_split(history, min(subwindows, history.shape[0]), axis=0)
        # per-window means scaled to the history, as LoadWindow does: parts may differ in length by one
        return np.max([part.sum(0) * (history.shape[0] / part.shape[0]) for part in parts], axis=0)
    raise ValueError(f"unknown estimator {estimator!r}")


class _Timer:
    """Interleaved timing of several callables: median and best seconds per name."""

    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = {}

    def __call__(self, name: str, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        out = fn()
        self.samples.setdefault(name, []).append(time.perf_counter() - start)
        return out

    def median(self, name: str) -> float:
        return statistics.median(self.samples[name])

    def best(self, name: str) -> float:
        return min(self.samples[name])


# --------------------------------------------------------------------------- parts


def _synthetic(args: argparse.Namespace, scenarios: dict, names: list[str], sigmas: list[float]) -> dict:
    import torch

    from eplb_fsm.policy.bounds import placement_balancedness
    from eplb_fsm.policy.default import DefaultEplbPolicy
    from eplb_fsm.policy.movement import MovementAwarePolicy, moved_mask
    from eplb_fsm.sim.loads import drift, scenario_load

    policy = MovementAwarePolicy(target=args.target)
    out: dict[str, Any] = {}
    for index, name in enumerate(names):
        shape = scenarios["shapes"][name]
        call = (shape["replicas"], shape["groups"], shape["nodes"], shape["ranks"])
        ranks = shape["ranks"]
        base = scenario_load(name, scenarios, rng=args.seed + index)
        old = DefaultEplbPolicy.rebalance_experts(torch.from_numpy(base), *call)[0]
        per_sigma = {}
        for sigma_index, sigma in enumerate(sigmas):
            rng = np.random.default_rng([args.seed, index, sigma_index])
            load = drift(base, sigma, rng)
            next_load = drift(load, sigma, rng)
            weight = torch.from_numpy(load)
            timer = _Timer()
            DefaultEplbPolicy.rebalance_experts(weight, *call)  # warm-up
            policy.rebalance_experts(weight, *call, old)
            for _ in range(max(args.repeats, 1)):
                d = timer("default", lambda: DefaultEplbPolicy.rebalance_experts(weight, *call))
                m = timer("movement_aware", lambda: policy.rebalance_experts(weight, *call, old))
            row: dict[str, Any] = {}
            for key, placement in (("default", d[0]), ("movement_aware", m[0])):
                row[key] = {
                    "balancedness": _round(placement_balancedness(placement, load, ranks)),
                    "next_balancedness": _round(placement_balancedness(placement, next_load, ranks)),
                    "moved": _round(moved_mask(old.numpy(), placement.numpy(), ranks).mean()),
                    "ms": _round(timer.median(key) * 1e3, 3),
                    "best_ms": _round(timer.best(key) * 1e3, 3),
                }
            dflt, mv = row["default"], row["movement_aware"]
            row["old_balancedness"] = _round(placement_balancedness(old, load, ranks))
            row["balancedness_ratio"] = _round(mv["balancedness"] / dflt["balancedness"])
            row["next_balancedness_ratio"] = _round(mv["next_balancedness"] / dflt["next_balancedness"])
            row["moved_ratio"] = _round(mv["moved"] / dflt["moved"]) if dflt["moved"] > 0 else 0.0
            row["time_ratio"] = _round(timer.median("movement_aware") / timer.median("default"), 2)
            row["time_ratio_best"] = _round(timer.best("movement_aware") / timer.best("default"), 2)
            if sigma <= 0.1:
                row["quality_met"] = bool(row["balancedness_ratio"] >= 0.99 and row["moved_ratio"] <= 0.10)
            elif sigma >= 1.0:
                row["quality_met"] = bool(row["balancedness_ratio"] >= 0.98)
            row["time_met"] = bool(row["time_ratio"] <= TIME_RATIO_TARGET)
            row["target_met"] = bool(row.get("quality_met", True) and row["time_met"])
            per_sigma[str(sigma)] = row
        out[name] = {"shape": {k: shape[k] for k in ("layers", "experts", "replicas", "ranks", "nodes", "groups")},
                     "sigmas": per_sigma}
    return out


def _rolling(windows: np.ndarray, call: tuple, target: float, start: np.ndarray | None = None) -> dict:
    """Both policies re-plan on every window, each from its own previous placement."""
    import torch

    from eplb_fsm.policy.bounds import placement_balancedness
    from eplb_fsm.policy.default import DefaultEplbPolicy
    from eplb_fsm.policy.movement import MovementAwarePolicy, moved_mask

    ranks = call[3]
    policies = {"default": DefaultEplbPolicy, "movement_aware": MovementAwarePolicy(target=target)}
    first_window = 1 if start is None else 0  # without a start, window 0 plans the first placement
    if start is None:
        start = DefaultEplbPolicy.rebalance_experts(torch.from_numpy(windows[0]), *call)[0].numpy()
    placement = {key: start.copy() for key in policies}
    stats: dict[str, dict[str, list[float]]] = {key: {"same": [], "next": [], "moved": []} for key in policies}
    timer = _Timer()
    last = windows.shape[0] - 1
    for i in range(first_window, last):
        weight = torch.from_numpy(windows[i])
        for key, pol in policies.items():
            old = placement[key]
            new = timer(key, lambda: pol.rebalance_experts(weight, *call, torch.from_numpy(old)))[0].numpy()
            stats[key]["same"].append(placement_balancedness(new, windows[i], ranks))
            stats[key]["next"].append(placement_balancedness(new, windows[i + 1], ranks))
            stats[key]["moved"].append(float(moved_mask(old, new, ranks).mean()))
            placement[key] = new
    result: dict[str, Any] = {"rearrangements": len(stats["default"]["same"])}
    for key in policies:
        result[key] = {
            "balancedness": _round(np.mean(stats[key]["same"])),
            "next_balancedness": _round(np.mean(stats[key]["next"])),
            "moved": _round(np.mean(stats[key]["moved"])),
            "first_moved": _round(stats[key]["moved"][0]) if stats[key]["moved"] else 0.0,
            "ms": _round(timer.median(key) * 1e3, 3),
        }
    d, m = result["default"], result["movement_aware"]
    result["balancedness_ratio"] = _round(m["balancedness"] / d["balancedness"])
    result["next_balancedness_ratio"] = _round(m["next_balancedness"] / d["next_balancedness"])
    result["moved_ratio"] = _round(m["moved"] / d["moved"]) if d["moved"] > 0 else 0.0
    result["time_ratio"] = _round(m["ms"] / d["ms"], 2)
    return result


def _traces(args: argparse.Namespace, scenarios: dict, directory: Path | str) -> tuple[dict, dict]:
    import torch

    from eplb_fsm.policy.default import DefaultEplbPolicy
    from eplb_fsm.sim.loads import esft_load_windows

    shape = scenarios["shapes"][_SHAPE_FOR_TRACES]
    call = (shape["replicas"], 1, 1, shape["ranks"])
    per = args.sequences
    intent = esft_load_windows(_task(directory, "intent"), per).astype(np.float64)
    intent3 = esft_load_windows(_task(directory, "intent"), per, layers=[1, 13, 26]).astype(np.float64)
    law = esft_load_windows(_task(directory, "law"), per, layers=[1, 13, 26]).astype(np.float64)
    if intent.shape[2] != shape["experts"]:
        raise SystemExit(
            f"eplb-fsm bench movement: traces have {intent.shape[2]} experts, shape has {shape['experts']}"
        )
    before_switch = DefaultEplbPolicy.rebalance_experts(torch.from_numpy(intent3.sum(0)), *call)[0].numpy()
    esft = {
        "shape": _SHAPE_FOR_TRACES,
        "sequences_per_window": per,
        "intent": _rolling(intent, call, args.target),
        "intent->law": _rolling(law, call, args.target, start=before_switch),
    }
    # load estimators, planned with the default policy
    choices = {
        "window_sum": ("window_sum", {}),
        "decayed_sum(0.9)": ("decayed_sum", {"decay": 0.9}),
        "decayed_sum(0.7)": ("decayed_sum", {"decay": 0.7}),
        "decayed_sum(0.5)": ("decayed_sum", {"decay": 0.5}),
        "subwindow_max(4)": ("subwindow_max", {"subwindows": 4}),
    }
    history = args.history
    switch = np.concatenate([intent3[-history:], law])
    cases = {
        "intent": (intent, history),
        "intent->law": (switch, history),
        "intent->law first 4": (switch[: history + 4], history),
    }
    estimators: dict[str, Any] = {"history_windows": history, "policy": "default", "cases": {}}
    from eplb_fsm.policy.bounds import placement_balancedness

    for case, (windows, start) in cases.items():
        scores = {name: [] for name in choices}
        for i in range(start, windows.shape[0]):
            hist = windows[max(0, i - history) : i]
            for name, (estimator, kw) in choices.items():
                est = estimate_logical(hist, estimator, **kw)
                phy = DefaultEplbPolicy.rebalance_experts(torch.from_numpy(est), *call)[0]
                scores[name].append(placement_balancedness(phy, windows[i], call[3]))
        means = {name: _round(np.mean(v)) for name, v in scores.items()}
        best = max(means, key=means.get)
        estimators["cases"][case] = {
            "next_balancedness": means,
            "steps": len(scores["window_sum"]),
            "best": best,
            "gain_over_window_sum": _round(means[best] - means["window_sum"]),
        }
    return esft, estimators


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
    if args.seed < 0:  # numpy's generators take no negative seed
        raise SystemExit(f"eplb-fsm bench movement: --seed must be >= 0, got {args.seed}")
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
    if any(not (s >= 0) for s in sigmas):
        raise SystemExit("eplb-fsm bench movement: --sigmas must be >= 0")

    started = time.perf_counter()
    result: dict[str, Any] = {
        "benchmark": "movement",
        "baseline": "DefaultEplbPolicy (re-plans from scratch), same run",
        "scenarios": scenarios["path"],
        "seed": args.seed,
        "repeats": args.repeats,
        "target": args.target,
        "synthetic": _synthetic(args, scenarios, names, sigmas),
    }
    directory = _esft_dir(args.esft_dir)
    if directory is None:
        result["esft"] = {"skipped": "--esft-dir none"}
    elif not _has_traces(directory):
        result["esft"] = {"skipped": f"no ESFT traces at {directory}"}
    elif _SHAPE_FOR_TRACES not in scenarios["shapes"]:
        result["esft"] = {"skipped": f"scenarios have no {_SHAPE_FOR_TRACES} shape"}
    else:
        result["esft"], result["estimators"] = _traces(args, scenarios, directory)
    rows = [row for shape in result["synthetic"].values() for row in shape["sigmas"].values()]
    quality = [row["quality_met"] for row in rows if "quality_met" in row]
    met = [row["target_met"] for row in rows]
    result["summary"] = {
        "targets_met": f"{sum(met)}/{len(met)}",
        "quality_targets_met": f"{sum(quality)}/{len(quality)}",
        "time_targets_met": f"{sum(row['time_met'] for row in rows)}/{len(rows)} (time ratio <= {TIME_RATIO_TARGET:g})",
        "max_time_ratio": max(row["time_ratio"] for row in rows),
        "seconds": _round(time.perf_counter() - started, 1),
    }
    return result
