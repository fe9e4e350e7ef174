"""``eplb-fsm replay LOGDIR``: replay per-rank traces and name the first divergence.

    eplb-fsm replay LOGDIR [--json] [--rank R] [--ranks N] [--jobs N] [--run-id ID]

Prints the verdict on the first line and the detail below it (``--json``: one JSON
object, with the structured verdict under ``verdict_detail``). Exit status: 0 healthy,
1 a problem was found, 2 a usage error or unusable input (no such folder, no
``rank*.jsonl`` file, nothing readable, traces of several runs without ``--run-id``,
``--ranks`` < 1, ``--jobs`` < 0); with ``--json``, unusable input also prints
``{"verdict": "unusable_input", "error": ...}``. ``--rank R`` prints that rank's timeline instead, one
line per record, with the records the machine refuses marked: rank R is the file the report
replays as rank R (the rank its records carry; of the run ``--run-id`` picks), named when its
file name says another rank, followed by the files of the joiners that took number R later
(``rank<R>.g<g>.jsonl``, in generation order) as the later sessions of one timeline; no
record for R, or ``--ranks`` beside it, exits 2.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from eplb_fsm.cli import hidden_alias, print_stdout


EXIT_CODES = """exit status:
  0  healthy: every rank agrees, up to where its trace stops (aborted rearrangements are
     listed; a last line says when no rank wrote an end record)
  1  a problem was found: the first line names the culprit (the rank that died, froze,
     crashed, lagged or issued the odd collective, or whose trace lost the lines a finding
     rests on), then what followed from it
  2  usage error or unusable input: bad --ranks/--jobs, --ranks with --rank, no folder, no
     rank*.jsonl file, nothing readable (with --rank R: in R's files), or traces of several
     runs (pick one with --run-id); with --json, unusable input also prints
     {"verdict": "unusable_input", "error": ...} (--rank R too)"""


def _at_least(low: int, what: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{what} must be >= {low}, got {value}")
        return value
    return parse



def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EXIT_CODES
    parser.add_argument("logdir", help="folder holding the rank<NNNNN>.jsonl traces (one per rank, zero-padded: "
                                         "rank00003.jsonl; joiners' rank<NNNNN>.g<g>.jsonl too)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--rank", type=int, default=None, metavar="R",
                        help="print rank R's timeline (one line per record, joiners that took number R "
                             "included) instead of the report")
    parser.add_argument("--ranks", dest="world", type=_at_least(1, "--ranks"), default=None, metavar="N",
                        help="expected number of ranks, >= 1 (default: read from the traces; a mismatch is reported)")
    hidden_alias(parser, "--world", dest="world", type=_at_least(1, "--world"))
    parser.add_argument("--jobs", type=_at_least(0, "--jobs"), default=1, metavar="N",
                        help="worker processes reading the files (default 1; 0: one per CPU)")
    parser.add_argument("--run-id", default=None, metavar="ID",
                        help="replay only the files of this run (when the folder holds several runs)")


def _out(text: str) -> None:
    """Print, tolerating a reader that stops early (``eplb-fsm replay DIR --rank 3 | head``)."""
    print_stdout(text)


def _unusable(args: argparse.Namespace, error: str) -> int:
    """Exit 2 for input that cannot be replayed: the error on stderr and, with ``--json`` (report or ``--rank``),
    ``{"verdict": "unusable_input", "error": ...}`` on stdout, so a reader of the JSON always gets an object."""
    if args.json:
        _out(json.dumps({"verdict": "unusable_input", "error": error}))
    print(f"eplb-fsm replay: error: {error}", file=sys.stderr)
    return 2


def _timeline(args: argparse.Namespace) -> int:
    """Rank R's timeline: R is found as the report finds it (the rank the records carry, of the run
    ``--run-id`` picks), so a renamed or swapped file shows the right rank; exit 2 when it has none."""
    from eplb_fsm.inspect.identity import run_text
    from eplb_fsm.inspect.render import format_timeline, timeline_rows
    from eplb_fsm.inspect.replay import NoTraces, load_dir, ranks_text, summarize_rank
    from eplb_fsm.inspect.summary import parse_records
    from eplb_fsm.trace_segments import read_rank_text

    if args.world is not None:
        print("eplb-fsm replay: error: --ranks is not allowed with --rank: --ranks N sets the world the report "
              "expects; with --rank R it has no effect: drop one of them", file=sys.stderr)
        return 2
    try:
        loaded = load_dir(args.logdir, jobs=args.jobs, run_id=args.run_id)
        path = loaded.files.get(args.rank)
        if path is None:
            why = loaded.unreadable.get(args.rank)
            raise NoTraces(f"rank {args.rank}: {why}" if why else f"no trace for rank {args.rank} in {args.logdir} "
                           f"(ranks with a trace: {ranks_text(loaded.files) or 'none'})")
        paths = _session_files(loaded.summaries.get(args.rank), path)
        raws = [read_rank_text(p) for p in paths]
    except (NoTraces, OSError) as exc:
        return _unusable(args, str(exc))
    # one timeline, file after file: a joiner's file starts with its header, which opens the next session
    # just as it did when the joiner appended to the first rank's file
    records, bad, cut = [], 0, []
    for p, raw in zip(paths, raws):
        recs, lost, torn = parse_records(raw if args.run_id is None else run_text(raw, args.run_id))
        records += recs
        bad += lost
        if torn:
            cut.append(Path(p).name)
    truncated = bool(cut)
    if not records:
        return _unusable(args, f"rank {args.rank}: {', '.join(map(str, paths))} has no readable record")
    summary = summarize_rank(records, args.rank, path=str(path), bad_lines=bad, truncated=truncated)
    sessions = list(summary.previous) + [summary]
    illegal = [dict(i, session=n) if len(sessions) > 1 else i for n, s in enumerate(sessions) for i in s.illegal]
    refused = {(i.get("session", 0), i["seq"]): i["reason"] for i in illegal}
    where = _sessions_of(records)
    if args.json:
        rows = timeline_rows(records)
        for row, at in zip(rows, where):
            if at is not None and type(row["seq"]) is int and (at, row["seq"]) in refused:
                row["illegal"] = refused[(at, row["seq"])]
        _out(json.dumps({"rank": args.rank, "path": str(path), "paths": [str(p) for p in paths], "bad_lines": bad,
                         "truncated": truncated, "sessions": len(sessions), "illegal_transitions": illegal,
                         "timeline": rows}))
        return 0
    text = format_timeline(records, args.rank).split("\n")
    out = text[:2]
    named = re.fullmatch(r"rank(\d+)\.jsonl", Path(path).name)
    if named and int(named.group(1)) != args.rank:   # a renamed or swapped file: say which one was read
        out[0] += f" (read from {Path(path).name}, a file named for rank {int(named.group(1))})"
    if len(paths) > 1:
        out[0] += " (files " + ", then ".join(Path(p).name for p in paths) + ")"
    for rec, at, line in zip(records, where, text[2:]):
        seq = rec.get("seq")   # an unhashable seq (a list in a damaged line) names no refused transition
        marked = type(seq) is int and (at, seq) in refused and rec.get("event") in ("transition", "step", "steps")
        out.append(("!! " if marked else "   ") + line)
    out[1] = "   " + out[1]
    if bad:
        last = "the last line" if len(paths) == 1 else f"the last line of {', '.join(cut)}"
        out.append(f"({bad} unreadable line(s) skipped" + (f"; {last} is truncated)" if truncated else ")"))
    for i in illegal:
        session = f"session {i['session']} " if "session" in i else ""
        out.append(f"!! {session}seq {i['seq']} step {i['step']}: {i['trigger']} {i['source']}->{i['dest']}: "
                   f"{i['reason']}")
    _out("\n".join(out))
    return 0


def _session_files(summary: Any, first: str) -> list[str]:
    """The files rank R's sessions were read from, in session order: its first file, then each joiner's
    ``rank<R>.g<g>.jsonl`` in generation order (``identity.assign`` chains the summaries so)."""
    paths: list[str] = []
    for part in [*summary.previous, summary] if summary is not None else []:
        if part.path and part.path not in paths:
            paths.append(part.path)
    return paths or [first]


def _sessions_of(records: list[dict]) -> list[int | None]:
    """Which replayed session each record belongs to (None: an earlier run the replay dropped).

    Sessions are numbered as the replay numbers them: a joiner's header (elastic EP) starts
    the next session of the same job, any other later header starts the job over.
    """
    marks: list[tuple[int, int]] = []
    run, session, seen = 0, 0, False
    for rec in records:
        if rec.get("event") == "header" and seen and rec.get("continued") is not True:
            if rec.get("role") == "joiner":
                session += 1
            else:
                run, session = run + 1, 0
        seen = True
        marks.append((run, session))
    return [session if r == run else None for r, session in marks]


def run(args: argparse.Namespace) -> int:
    if args.rank is not None:
        return _timeline(args)
    from eplb_fsm.inspect.render import format_report
    from eplb_fsm.inspect.replay import NoTraces, replay_dir

    try:
        report = replay_dir(args.logdir, world=args.world, jobs=args.jobs, run_id=args.run_id)
    except NoTraces as exc:
        return _unusable(args, str(exc))
    _out(json.dumps(report.to_dict(), default=str) if args.json else format_report(report))
    return report.exit_code
