"""``eplb-fsm bench policy``: the default policy against the per-item reference, per shape.

For every shape of ``scenarios.json`` (or those named by ``--shapes``) with its zipf
synthetic load, measured side by side in one run:

- ``default_ms``: median wall time of ``DefaultEplbPolicy.rebalance_experts`` over
  ``--repeats`` runs (after one warm-up run);
- ``reference_ms``: median of the per-item reference
  (:func:`eplb_fsm.policy.reference.reference_rebalance_experts`) over
  ``--reference-repeats`` runs, and ``speedup`` = reference_ms / default_ms;
- ``*_best_ms`` and ``speedup_best``: the same from the fastest run of each, which is
  steadier when other jobs share the CPU;
- ``balancedness`` of the default placement on that load, the ``bound`` no placement can
  beat, and the ``initial`` placement's balancedness for scale;
- ``identical``: both gave the same ``phy2log``, ``log2phy`` and ``replica_count``.
"""

from __future__ import annotations

import argparse
import statistics
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--repeats", type=int, default=7, metavar="N", help="timed runs of the default policy (default 7)"
    )
    parser.add_argument(
        "--reference-repeats", type=int, default=3, metavar="N", help="timed runs of the per-item reference (default 3)"
    )
    parser.add_argument("--shapes", default=None, metavar="A,B", help="comma-separated shape names (default: all)")
    parser.add_argument(
        "--scenarios", default=None, metavar="FILE", help="scenarios.json to use (default: the shared one)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic loads (default 0)")


def _times(fn, repeats: int) -> tuple[float, float, object]:
    """(median, best) wall time of ``repeats`` calls, and the last result."""
    result = None
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times), result


def run(args: argparse.Namespace) -> dict:
    import torch

    from eplb_fsm.maps import initial_phy2log
    from eplb_fsm.policy.bounds import balancedness_bound, placement_balancedness
    from eplb_fsm.policy.default import DefaultEplbPolicy
    from eplb_fsm.policy.reference import reference_rebalance_experts
    from eplb_fsm.sim.loads import load_scenarios, scenario_load

    if args.repeats < 1 or args.reference_repeats < 1:
        raise SystemExit("eplb-fsm bench policy: --repeats and --reference-repeats must be >= 1")
    try:
        scenarios = load_scenarios(args.scenarios)
    except ValueError as exc:
        raise SystemExit(f"eplb-fsm bench policy: --scenarios: {exc}") from None
    names = list(scenarios["shapes"]) if not args.shapes else [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [n for n in names if n not in scenarios["shapes"]]
    if unknown or not names:
        raise SystemExit(
            f"eplb-fsm bench policy: --shapes: unknown shape(s) {unknown}; known: {', '.join(scenarios['shapes'])}"
        )

    results = {}
    for index, name in enumerate(names):
        shape = scenarios["shapes"][name]
        load = scenario_load(name, scenarios, rng=args.seed + index)
        weight = torch.from_numpy(load)
        call = (shape["replicas"], shape["groups"], shape["nodes"], shape["ranks"])

        DefaultEplbPolicy.rebalance_experts(weight, *call)  # warm-up
        default_s, default_best, fast = _times(
            lambda: DefaultEplbPolicy.rebalance_experts(weight, *call), args.repeats
        )
        reference_s, reference_best, ref = _times(
            lambda: reference_rebalance_experts(weight, *call), args.reference_repeats
        )
        identical = all(torch.equal(a, b) for a, b in zip(fast, ref))
        initial = initial_phy2log(shape["layers"], shape["experts"], shape["replicas"])
        results[name] = {
            **{k: shape[k] for k in ("layers", "experts", "replicas", "ranks", "nodes", "groups")},
            "hierarchical": shape["groups"] % shape["nodes"] == 0 and shape["groups"] > 1,
            "default_ms": round(default_s * 1e3, 3),
            "reference_ms": round(reference_s * 1e3, 3),
            "speedup": round(reference_s / default_s, 2),
            "default_best_ms": round(default_best * 1e3, 3),
            "reference_best_ms": round(reference_best * 1e3, 3),
            "speedup_best": round(reference_best / default_best, 2),
            "balancedness": round(placement_balancedness(fast[0], load, shape["ranks"]), 6),
            "bound": round(balancedness_bound(load, shape["replicas"], shape["ranks"]), 6),
            "initial": round(placement_balancedness(initial, load, shape["ranks"]), 6),
            "identical": identical,
        }

    speedups = [r["speedup"] for r in results.values()]
    return {
        "benchmark": "policy",
        "baseline": "eplb_fsm.policy.reference.reference_rebalance_experts (per-item loops, same run)",
        "scenarios": scenarios["path"],
        "load": "zipf per scenarios.json synthetic_load",
        "seed": args.seed,
        "repeats": args.repeats,
        "reference_repeats": args.reference_repeats,
        "shapes": results,
        "min_speedup": min(speedups),
        "all_identical": all(r["identical"] for r in results.values()),
    }
