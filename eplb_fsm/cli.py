"""The ``eplb-fsm`` command.

Each verb lives in its own module that exposes ``add_arguments(parser)`` and
``run(args) -> int``; this file only wires them up, importing a verb's module
when the verb is parsed so ``eplb-fsm --help`` stays fast (torch is not imported).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# verb -> (module, one-line help). Bench verbs are dispatched by eplb_fsm.bench.
VERBS: dict[str, tuple[str, str]] = {
    "plan": ("eplb_fsm.commands.plan", "plan a placement for a load file and report its quality"),
    "bench": ("eplb_fsm.bench.cli", "run a benchmark and print JSON with ratios against a baseline"),
    "simulate": ("eplb_fsm.commands.simulate", "run the toy MoE engine on local gloo ranks"),
    "diagram": ("eplb_fsm.commands.diagram", "write the state machine as mermaid / DOT (/ SVG, PNG)"),
    "replay": ("eplb_fsm.commands.replay", "replay per-rank traces and name the first divergence"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eplb-fsm",
        description="Expert-parallelism load balancer as an explicit state machine.",
    )
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    sub.required = True
    for verb, (module_name, help_text) in VERBS.items():
        p = sub.add_parser(verb, help=help_text, description=help_text)
        p.set_defaults(command_module=module_name)
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:  # a verb whose module is not written yet
            if exc.name != module_name:
                raise
            p.set_defaults(_missing=True)
            continue
        module.add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_missing", False):
        parser.error(f"verb {args.verb!r} is not available in this build")
    module = importlib.import_module(args.command_module)
    return int(module.run(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
