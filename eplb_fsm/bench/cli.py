"""``eplb-fsm bench KIND``: dispatch to one benchmark module per kind.

A benchmark module exposes ``add_arguments(parser)`` and ``run(args) -> dict``; the
dict is printed as one JSON object with ``--json`` (a NaN or infinite figure as null: JSON
has neither) and as indented ``key: value`` text otherwise (the same choice every verb
offers). A benchmark refuses bad options by raising ``SystemExit("eplb-fsm bench KIND:
...")``; that message goes to stderr on one line and the command exits 2, like every
other usage error (a failed rank of a multi-process benchmark too: bench/ranks.py).

SIGTERM and Ctrl-C unwind the benchmark (``commands.simulate.interruptible``: SIGTERM raises in the
main thread, as Ctrl-C does) instead of ending the process where it stands, so its ``with`` and
``finally`` blocks run: the temporary folders of ``replay`` (hundreds of MB of traces) and ``step`` are
removed and the ranks of ``transfer`` / ``stall`` are stopped. It then says so on stderr and exits
143 / 130, like ``simulate``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import signal
import sys
from typing import Any

KINDS: dict[str, tuple[str, str]] = {
    "policy": ("eplb_fsm.bench.policy", "policy time and balancedness per scenario shape"),
    "transfer": ("eplb_fsm.bench.transfer", "rearrangement throughput vs raw isend/irecv on gloo"),
    "step": ("eplb_fsm.bench.step", "per-step overhead while collecting (trace on) vs a bare window update"),
    "replay": ("eplb_fsm.bench.replay", "time to a replay verdict on synthetic 64-rank traces"),
    "movement": ("eplb_fsm.bench.movement", "default vs movement-aware: balancedness and moved slots"),
    "stall": ("eplb_fsm.bench.stall", "engine step stall of one rearrangement, sync vs async, on gloo"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from eplb_fsm.cli import HelpFormatter

    sub = parser.add_subparsers(dest="kind", metavar="KIND")
    sub.required = True
    for kind, (module_name, help_text) in KINDS.items():
        p = sub.add_parser(kind, help=help_text, description=help_text, formatter_class=HelpFormatter)
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


def format_text(value: Any, indent: int = 0) -> list[str]:
    """A benchmark result as indented ``key: value`` lines (lists of plain values stay on one line)."""
    pad = "  " * indent
    lines: list[str] = []
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(item, dict) and item:
                lines.append(f"{pad}{key}:")
                lines += format_text(item, indent + 1)
            elif isinstance(item, list) and any(isinstance(x, (dict, list)) for x in item):
                lines.append(f"{pad}{key}:")
                for i, x in enumerate(item):
                    lines.append(f"{pad}  [{i}]")
                    lines += format_text(x, indent + 2)
            else:
                lines.append(f"{pad}{key}: {_plain(item)}")
    else:
        lines.append(f"{pad}{_plain(value)}")
    return lines


def _plain(value: Any) -> str:
    if isinstance(value, list):
        return ", ".join(_plain(x) for x in value) or "(none)"
    if isinstance(value, dict):
        return "(none)"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def json_safe(value: Any) -> Any:
    """``value`` with every NaN or infinite float as None: JSON has neither, and ``json.dumps`` would
    print them as the bare words NaN and Infinity, which JSON parsers refuse."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value


def _interrupted(kind: str, name: str) -> int:
    """Say the benchmark was stopped (its clean-up has run); the exit code of ``name`` (143 / 130)."""
    print(f"eplb-fsm bench {kind}: interrupted by {name}; its temporary files were removed", file=sys.stderr)
    return 128 + (signal.SIGTERM if name == "SIGTERM" else signal.SIGINT)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "_bench_missing", False):
        print(f"eplb-fsm bench: error: benchmark {args.kind!r} is not available in this build", file=sys.stderr)
        return 2
    from eplb_fsm.commands.simulate import Interrupted, interruptible

    module = importlib.import_module(args.bench_module)
    try:
        with interruptible() as fired:
            result = module.run(args)
    except KeyboardInterrupt:
        return _interrupted(args.kind, "SIGINT")
    except Interrupted as exc:
        return _interrupted(args.kind, exc.name)
    except SystemExit as exc:
        if not isinstance(exc.code, str):
            raise
        message = exc.code
        prefix = f"eplb-fsm bench {args.kind}: "
        if message.startswith(prefix) and not message.startswith(prefix + "error:"):
            message = prefix + "error: " + message[len(prefix):]
        print(message, file=sys.stderr)
        return 2
    if fired:  # a SIGTERM whose exception something swallowed: still a stopped run, not a result
        return _interrupted(args.kind, signal.Signals(fired[0]).name)
    from eplb_fsm.cli import print_stdout   # a reader that stops early (| head) ends the output quietly

    if args.json:
        print_stdout(json.dumps(json_safe(result), sort_keys=False, allow_nan=False))
    else:
        print_stdout("\n".join(format_text(result)))
    return 0
