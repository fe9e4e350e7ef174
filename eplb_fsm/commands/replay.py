"""``eplb-fsm replay LOGDIR``: replay per-rank traces and name the first divergence.

    eplb-fsm replay LOGDIR [--json] [--rank R] [--world N] [--jobs N]

Prints the verdict on the first line and the detail below it (``--json``: one JSON
object). Exit status: 0 healthy, 1 a problem was found, 2 the input is unusable (no
such folder, no ``rank*.jsonl`` file, nothing readable). ``--rank R`` prints that rank's
timeline instead, one line per record, with the records the machine refuses marked.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("logdir", help="folder holding rank<N>.jsonl traces (one per rank)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--rank", type=int, default=None, metavar="R",
                        help="print rank R's timeline (one line per record) instead of the report")
    parser.add_argument("--world", type=int, default=None, metavar="N",
                        help="expected world size (default: read from the traces)")
    parser.add_argument("--jobs", type=int, default=1, metavar="N",
                        help="worker processes reading the files (default 1; 0: one per CPU)")


def _out(text: str) -> None:
    """Print, tolerating a reader that stops early (``eplb-fsm replay DIR --rank 3 | head``)."""
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:
        # the documented recipe: point stdout at devnull so the interpreter's final flush is quiet
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def _timeline(args: argparse.Namespace) -> int:
    from eplb_fsm.inspect.render import format_timeline, timeline_rows
    from eplb_fsm.inspect.replay import find_trace_files, read_records, summarize_rank

    try:
        files = find_trace_files(args.logdir)
    except OSError as exc:
        print(f"eplb-fsm replay: {exc}", file=sys.stderr)
        return 2
    path = files.get(args.rank)
    if path is None:
        have = ", ".join(str(r) for r in files) or "none"
        print(f"eplb-fsm replay: no trace for rank {args.rank} in {args.logdir} (ranks with a trace: {have})",
              file=sys.stderr)
        return 2
    records, bad, truncated = read_records(path)
    summary = summarize_rank(records, args.rank, path=str(path), bad_lines=bad, truncated=truncated)
    refused = {i["seq"]: i["reason"] for i in summary.illegal}
    if args.json:
        rows = timeline_rows(records)
        for row in rows:
            if row["seq"] in refused:
                row["illegal"] = refused[row["seq"]]
        _out(json.dumps({"rank": args.rank, "path": str(path), "bad_lines": bad, "truncated": truncated,
                         "illegal_transitions": summary.illegal, "timeline": rows}))
        return 0
    text = format_timeline(records, args.rank).split("\n")
    out = text[:2]
    for rec, line in zip(records, text[2:]):
        out.append(("!! " if rec.get("seq") in refused and rec.get("event") in ("transition", "step") else "   ")
                   + line)
    out[1] = "   " + out[1]
    if bad:
        out.append(f"({bad} unreadable line(s) skipped" + ("; the last line is truncated)" if truncated else ")"))
    for i in summary.illegal:
        out.append(f"!! seq {i['seq']} step {i['step']}: {i['trigger']} {i['source']}->{i['dest']}: {i['reason']}")
    _out("\n".join(out))
    return 0


def run(args: argparse.Namespace) -> int:
    if args.rank is not None:
        return _timeline(args)
    from eplb_fsm.inspect.render import format_report
    from eplb_fsm.inspect.replay import NoTraces, replay_dir

    try:
        report = replay_dir(args.logdir, world=args.world, jobs=args.jobs)
    except NoTraces as exc:
        if args.json:
            print(json.dumps({"verdict": "unusable_input", "error": str(exc)}))
        print(f"eplb-fsm replay: {exc}", file=sys.stderr)
        return 2
    _out(json.dumps(report.to_dict(), default=str) if args.json else format_report(report))
    return report.exit_code
