"""The ``eplb-fsm`` command.

Each verb lives in its own module that exposes ``add_arguments(parser)`` and
``run(args) -> int``; this file only wires them up, importing a verb's module
when the verb is parsed so ``eplb-fsm --help`` stays fast (torch is not imported).

One command-line language for every verb: ``--ranks`` is the number of EP ranks,
``--slots`` the physical slots per layer (experts + redundant), ``--redundant`` the
slots beyond one per expert, ``--repeats`` timed repetitions, ``--trace-dir`` where
traces go, ``--json`` one JSON object on stdout instead of text. Older spellings
(``--world``, ``--replicas``, ``--repeat``, ``--log-dir``) are accepted as hidden
aliases. Usage errors print one ``eplb-fsm VERB: error: ...`` line and exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# verb -> (module, one-line help). Bench verbs are dispatched by eplb_fsm.bench.
VERBS: dict[str, tuple[str, str]] = {
    "plan": ("eplb_fsm.commands.plan", "plan a placement for a load file and report its quality"),
    "bench": ("eplb_fsm.bench.cli", "run a benchmark and report ratios against a baseline"),
    "simulate": ("eplb_fsm.commands.simulate", "run the toy MoE engine on local gloo ranks"),
    "diagram": ("eplb_fsm.commands.diagram", "write the state machine as mermaid / DOT (/ SVG, PNG)"),
    "replay": ("eplb_fsm.commands.replay", "replay per-rank traces and name the first divergence"),
}



class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps descriptions and epilogs as written and shows every option's default.

    An option whose help text does not already say its default gets ``(default: X)``;
    flags and options without a default value are left alone (their help says what
    leaving them out means).
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (action.option_strings and action.nargs != 0 and "default" not in text.lower()
                and action.default not in (None, argparse.SUPPRESS) and not action.required):
            text += " (default: %(default)s)"
        return text


class Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line (``PROG: error: ...; see PROG --help``), exit 2.

    Every parser here refuses the arguments it does not know itself, even through
    ``parse_known_args``: argparse runs a verb's parser that way and would hand its leftovers
    up to the top parser, whose error would then read ``eplb-fsm: error:`` and not name the verb.
    """

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        namespace, extra = super().parse_known_args(args, namespace)
        if extra:  # the innermost parser that saw them says so: `eplb-fsm bench policy: error: ...`
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        return namespace, extra


def hidden_alias(parser, *names: str, dest: str, **kwargs) -> None:
    """An old spelling of an option: parsed into ``dest``, not shown in --help."""
    parser.add_argument(*names, dest=dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)


def package_version() -> str:
    from eplb_fsm import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="eplb-fsm",
        description="Expert-parallelism load balancer as an explicit state machine.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"eplb-fsm {package_version()}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    sub.required = True
    for verb, (module_name, help_text) in VERBS.items():
        p = sub.add_parser(verb, help=help_text, description=help_text, formatter_class=HelpFormatter)
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


def print_stdout(text: str) -> None:
    """Print ``text`` to stdout, tolerating a reader that stops early (``eplb-fsm plan ... | head -1``).

    A closed pipe ends the output quietly: stdout is pointed at /dev/null so that later prints
    and the interpreter's final flush do not raise ``BrokenPipeError`` (Python's documented recipe).
    """
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_missing", False):
        parser.error(f"verb {args.verb!r} is not available in this build")
    module = importlib.import_module(args.command_module)
    return int(module.run(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
