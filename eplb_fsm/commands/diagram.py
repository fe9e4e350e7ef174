"""``eplb-fsm diagram``: write the state machine as mermaid / DOT (/ SVG, PNG with pygraphviz).

    eplb-fsm diagram [--out diagrams/] [--format mermaid,dot,svg,png] [--doc docs/machine.md] [--check]

Text formats are generated from the live machine definition without any Graphviz
install; SVG/PNG are skipped with a message when pygraphviz is missing. ``--doc``
refreshes the mermaid block embedded in a markdown page; ``--check`` writes nothing and
exits 1 when a file (or the embedded block) is stale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _formats(text: str) -> list[str]:
    from eplb_fsm.inspect.diagrams import FORMATS

    chosen = [f.strip().lower() for f in text.split(",") if f.strip()]
    unknown = [f for f in chosen if f not in FORMATS]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(
            f"unknown format(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(FORMATS)}"
        )
    return chosen


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="diagrams", help="output folder (default: diagrams)")
    parser.add_argument(
        "--format", dest="formats", type=_formats, default=["mermaid", "dot"],
        help="comma-separated: mermaid, dot, svg, png (default: mermaid,dot)",
    )
    parser.add_argument(
        "--doc", default=None, metavar="MARKDOWN",
        help="also refresh the generated mermaid block in this markdown file (e.g. docs/machine.md)",
    )
    parser.add_argument(
        "--check", action="store_true",
        help="write nothing; exit 1 if the mermaid/DOT files or the --doc block are stale",
    )


def run(args: argparse.Namespace) -> int:
    from eplb_fsm.inspect import diagrams

    out = Path(args.out)
    text_formats = [f for f in args.formats if f in ("mermaid", "dot")]
    image_formats = [f for f in args.formats if f in ("svg", "png")]

    if args.check:
        stale = diagrams.stale_files(out, args.doc, text_formats)
        for item in stale:
            print(f"stale: {item}")
        if stale:
            print("regenerate with: eplb-fsm diagram" + (f" --doc {args.doc}" if args.doc else ""))
            return 1
        print("diagrams are up to date")
        return 0

    out.mkdir(parents=True, exist_ok=True)
    for path, text in diagrams.expected_files(out, text_formats).items():
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path}")
    dot_text = diagrams.render_dot()
    for fmt in image_formats:
        path = out / f"{diagrams.BASENAME}.{diagrams.EXTENSIONS[fmt]}"
        try:
            diagrams.render_image(fmt, path, dot_text)
        except diagrams.GraphvizUnavailable as exc:
            print(f"skipped {fmt}: {exc}", file=sys.stderr)
            continue
        print(f"wrote {path}")
    if args.doc:
        doc = Path(args.doc)
        if not doc.exists():
            print(f"eplb-fsm diagram: {doc} does not exist", file=sys.stderr)
            return 2
        try:
            updated = diagrams.embed_in_markdown(doc.read_text(encoding="utf-8"))
        except ValueError as exc:
            print(f"eplb-fsm diagram: {doc}: {exc}", file=sys.stderr)
            return 2
        doc.write_text(updated, encoding="utf-8")
        print(f"updated {doc}")
    return 0
