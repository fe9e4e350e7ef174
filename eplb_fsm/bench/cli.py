"""``eplb-fsm bench KIND``: dispatch to one benchmark module per kind.

A benchmark module exposes ``add_arguments(parser)`` and ``run(args) -> dict``; the
dict is printed as JSON with ``--json`` and as an indented summary otherwise.
"""

from __future__ import annotations

import argparse
import importlib
import json

KINDS: dict[str, tuple[str, str]] = {
    "policy": ("eplb_fsm.bench.policy", "policy time and balancedness per scenario shape"),
    "transfer": ("eplb_fsm.bench.transfer", "rearrangement throughput vs raw isend/irecv on gloo"),
    "step": ("eplb_fsm.bench.step", "per-step overhead while collecting (trace on) vs a bare window update"),
    "replay": ("eplb_fsm.bench.replay", "time to a replay verdict on synthetic 64-rank traces"),
    "movement": ("eplb_fsm.bench.movement", "default vs movement-aware: balancedness and moved slots"),
    "stall": ("eplb_fsm.bench.stall", "engine step stall of one rearrangement, sync vs async, on gloo"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="kind", metavar="KIND")
    sub.required = True
    for kind, (module_name, help_text) in KINDS.items():
        p = sub.add_parser(kind, help=help_text, description=help_text)
        p.set_defaults(bench_module=module_name)
        p.add_argument("--json", action="store_true", help="print the result as one JSON object")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            p.set_defaults(_bench_missing=True)
            continue
        module.add_arguments(p)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "_bench_missing", False):
        raise SystemExit(f"eplb-fsm bench: benchmark {args.kind!r} is not available in this build")
    module = importlib.import_module(args.bench_module)
    result = module.run(args)
    if args.json:
        print(json.dumps(result, sort_keys=False))
    else:
        print(json.dumps(result, indent=2, sort_keys=False))
    return 0
