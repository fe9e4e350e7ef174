"""``eplb-fsm diagram``: write the state machine as mermaid / DOT (/ SVG, PNG with pygraphviz).

    eplb-fsm diagram [--out diagrams/] [--format mermaid,dot,svg,png] [--doc docs/machine.md] [--check]

Text formats are generated from the live machine definition without any Graphviz
install; SVG/PNG are skipped with a message when pygraphviz is missing. ``--doc``
refreshes the mermaid block embedded in a markdown page; ``--check`` writes nothing and
exits 1 when a file (or the embedded block) is stale.

``--out`` (a folder, created if missing) and ``--doc`` (an existing markdown file with
the generated block) are checked before anything is written: a bad one prints one
``eplb-fsm diagram: error: ...`` line and exits 2. So does ``--check`` with nothing to
compare: no mermaid or dot in ``--format`` and no ``--doc`` (images are not compared), and
a folder where an output file goes. Every ``--out`` file is written to a temporary file
beside it first, and all are renamed over their targets at the end: a write that fails (a
full disk) is one ``eplb-fsm diagram: error: --out: cannot write ...`` line, exit 2, and
leaves the files already there as they were. The ``--doc`` page, computed in full before,
is rewritten in place last (it keeps its owner, mode and hard links; its folder need not
accept new files).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import stat
import sys
import tempfile
from pathlib import Path

from eplb_fsm.cli import print_stdout


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


def _check_paths(out: Path, doc: str | None, check: bool, formats: list[str]) -> str | None:
    """Why ``--out`` / ``--doc`` cannot be used (one line, naming the option), or None."""
    from eplb_fsm.inspect.diagrams import BASENAME, EXTENSIONS

    if out.exists() and not out.is_dir():
        return f"--out: {out} exists and is not a folder"
    for fmt in formats:  # a folder where a file goes: found before anything is written
        target = out / f"{BASENAME}.{EXTENSIONS[fmt]}"
        if target.exists() and not target.is_file():
            return f"--out: {target} exists and is not a file (move or remove it)"
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
        problem = _check_paths(out, args.doc, args.check, args.formats)
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
            print_stdout(f"stale: {item}")
        if stale:
            hint = ["eplb-fsm", "diagram", "--out", args.out]  # the folder checked, so the hint rewrites it
            if text_formats and text_formats != ["mermaid", "dot"]:
                hint += ["--format", ",".join(text_formats)]
            hint += ["--doc", args.doc] if args.doc else []
            print_stdout("regenerate with: " + shlex.join(hint))
            return 1
        print_stdout("diagrams are up to date")
        return 0

    try:  # the checks above cannot foresee every refusal (a read-only or virtual file system)
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"eplb-fsm diagram: error: --out: cannot create {out}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    # (temp file, file it replaces, option, path as given): renamed over the targets at the end
    staged: list[tuple[Path, Path, str, Path]] = []
    try:
        for path, text in diagrams.expected_files(out, text_formats).items():
            _stage(staged, path, "--out", lambda temp, text=text: temp.write_text(text, encoding="utf-8"))
        dot_text = diagrams.render_dot()
        for fmt in image_formats:
            path = out / f"{diagrams.BASENAME}.{diagrams.EXTENSIONS[fmt]}"
            try:
                _stage(staged, path, "--out", lambda temp, fmt=fmt: diagrams.render_image(fmt, temp, dot_text))
            except diagrams.GraphvizUnavailable as exc:
                print(f"skipped {fmt}: {exc}", file=sys.stderr)
        if args.doc:
            doc = Path(args.doc)
            try:
                page = diagrams.embed_in_markdown(doc.read_text(encoding="utf-8"))
            except OSError as exc:  # read fine a moment ago, in the checks: still one line, not a traceback
                raise _WriteError("--doc", doc, exc, "read") from None
        while staged:  # every file was written in full: only now is any target replaced
            temp, real, option, path = staged[0]
            try:
                os.replace(temp, real)
            except OSError as exc:
                raise _WriteError(option, path, exc) from None
            staged.pop(0)
            print_stdout(f"wrote {path}")
        if args.doc:   # in place, last: the page keeps its owner, mode and hard links (a rename would not)
            try:
                doc.write_text(page, encoding="utf-8")
            except OSError as exc:
                raise _WriteError("--doc", doc, exc) from None
            print_stdout(f"updated {doc}")
    except _WriteError as exc:
        print(f"eplb-fsm diagram: error: {exc}", file=sys.stderr)
        return 2
    finally:
        for temp, *_ in staged:  # whatever was not renamed: no temp file is left behind
            with contextlib.suppress(FileNotFoundError):
                temp.unlink()
    return 0


class _WriteError(Exception):
    """A file of the run could not be written (or the page re-read): ``OPTION: cannot write PATH: why``, one line."""

    def __init__(self, option: str, path: Path, exc: OSError, doing: str = "write") -> None:
        super().__init__(f"{option}: cannot {doing} {path}: {exc.strerror or exc}")


def _stage(staged: list[tuple[Path, Path, str, Path]], target: Path, option: str, write) -> None:
    """Write ``target``'s new content with ``write(temp)`` into a temp file beside it, recorded in ``staged``.

    Beside the file ``target`` names (through a symlink: the file it points to is replaced, not
    the link), so that the final rename stays on one file system; with the mode that file has (or a
    new file would get). An OSError becomes a :class:`_WriteError` naming ``option`` and ``target``.
    """
    real = Path(os.path.realpath(target))
    try:
        fd, name = tempfile.mkstemp(prefix=f".{real.name}.", suffix=f".tmp{real.suffix}", dir=real.parent)
        staged.append((Path(name), real, option, target))
        try:
            mode = stat.S_IMODE(os.stat(real).st_mode)
        except FileNotFoundError:
            mask = os.umask(0o022)
            os.umask(mask)
            mode = 0o666 & ~mask
        try:
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
        try:
            write(Path(name))
        except BaseException:  # pygraphviz missing, an OSError, Ctrl-C: this temp file is not to be renamed
            staged.pop()
            Path(name).unlink(missing_ok=True)
            raise
    except OSError as exc:
        raise _WriteError(option, target, exc) from None
