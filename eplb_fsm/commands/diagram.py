"""``eplb-fsm diagram``: write the state machine as mermaid / DOT (/ SVG, PNG with pygraphviz).

    eplb-fsm diagram [--out diagrams/] [--format mermaid,dot,svg,png] [--doc docs/machine.md] [--check]

Text formats are generated from the live machine definition without any Graphviz
install; SVG/PNG are skipped with a message when pygraphviz is missing. ``--doc``
refreshes the mermaid block embedded in a markdown page; ``--check`` writes nothing and
exits 1 when a file (or the embedded block) is stale.

``--out`` (a folder, created if missing) and ``--doc`` (an existing markdown file with
the generated block) are checked before anything is written: a bad one prints one
``eplb-fsm diagram: error: ...`` line and exits 2. So does ``--check`` with nothing to
compare: no mermaid or dot in ``--format`` and no ``--doc`` (images are not compared).
"""

from __future__ import annotations

import argparse
import os
import shlex
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
    parser.add_argument("--out", default="diagrams", help="output folder, created if missing (default: diagrams)")
    parser.add_argument(
        "--format", dest="formats", type=_formats, default=["mermaid", "dot"],
        help="comma-separated: mermaid, dot, svg, png (default: mermaid,dot)",
    )
    parser.add_argument(
        "--doc", default=None, metavar="MARKDOWN",
        help="also refresh the generated mermaid block in this markdown file, e.g. docs/machine.md (default: none)",
    )
    parser.add_argument(
        "--check", action="store_true",
        help="write nothing; exit 1 if the mermaid/DOT files or the --doc block are stale",
    )


def _check_paths(out: Path, doc: str | None, check: bool) -> str | None:
    """Why ``--out`` / ``--doc`` cannot be used (one line, naming the option), or None."""
    if out.exists() and not out.is_dir():
        return f"--out: {out} exists and is not a folder"
    if not check:
        probe = out
        while not probe.exists():  # the nearest folder that exists must accept new entries
            probe = probe.parent
        if not probe.is_dir():
            return f"--out: cannot create {out}: {probe} is not a folder"
        if not os.access(probe, os.W_OK | os.X_OK):
            return f"--out: cannot write in {probe}"
    if doc is not None:
        path = Path(doc)
        if not path.exists():
            return f"--doc: {path} does not exist"
        if not path.is_file():
            return f"--doc: {path} is not a file (give the markdown page to refresh)"
        if not check and not os.access(path, os.R_OK | os.W_OK):
            return f"--doc: {path} is not readable and writable"
    return None


def run(args: argparse.Namespace) -> int:
    from eplb_fsm.inspect import diagrams

    out = Path(args.out)
    text_formats = [f for f in args.formats if f in ("mermaid", "dot")]
    image_formats = [f for f in args.formats if f in ("svg", "png")]
    if args.check and not text_formats and not args.doc:  # else it would report "up to date" having compared nothing
        problem = (f"--check compares only mermaid and dot files (and the --doc block); --format "
                   f"{','.join(args.formats)} selects neither: add mermaid or dot, or give --doc")
    else:
        problem = _check_paths(out, args.doc, args.check)
    if problem is None and args.doc:
        try:  # the block must be there before any file is written
            diagrams.embed_in_markdown(Path(args.doc).read_text(encoding="utf-8"))
        except (ValueError, OSError, UnicodeDecodeError) as exc:
            problem = f"--doc: {args.doc}: {' '.join(str(exc).splitlines())}"  # one error line, whatever exc holds
    if problem:
        print(f"eplb-fsm diagram: error: {problem}", file=sys.stderr)
        return 2

    if args.check:
        stale = diagrams.stale_files(out, args.doc, text_formats)
        for item in stale:
            print(f"stale: {item}")
        if stale:
            hint = ["eplb-fsm", "diagram", "--out", args.out]  # the folder checked, so the hint rewrites it
            if text_formats and text_formats != ["mermaid", "dot"]:
                hint += ["--format", ",".join(text_formats)]
            hint += ["--doc", args.doc] if args.doc else []
            print("regenerate with: " + shlex.join(hint))
            return 1
        print("diagrams are up to date")
        return 0

    try:  # the checks above cannot foresee every refusal (a read-only or virtual file system)
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"eplb-fsm diagram: error: --out: cannot create {out}: {exc.strerror or exc}", file=sys.stderr)
        return 2
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
        doc.write_text(diagrams.embed_in_markdown(doc.read_text(encoding="utf-8")), encoding="utf-8")
        print(f"updated {doc}")
    return 0
