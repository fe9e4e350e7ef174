"""Which files make one run: run ids, files that claim the same rank, files named for another rank.

``assign(loaded)`` takes every ``rank<N>.jsonl`` read from a folder, each with its summary,
and decides what the replay works on:

- **run id**: every rank of a run writes the run id agreed at construction in its header
  (``run_id``). Files of different runs (or files with a run id next to files without one)
  are refused with ``MixedRuns``, naming which files belong to which run, unless one run is
  chosen (``run_id=``).
- **swapped**: a file whose records carry another rank than its name (a renamed or swapped
  file) is a ``swapped_rank_file`` finding; when the ranks the records carry are distinct
  across files, the replay keys each file by them (so the culprit named is the real rank).
- **duplicate**: two files that claim one rank (``rank2.jsonl`` and ``rank00002.jsonl``)
  are a ``duplicate_rank_file`` finding; the replay keeps the writer's zero-padded name, or
  the one whose records carry that rank.
- **older runs in a file**: a file that several controllers appended to holds one job per
  header; ``run_text(text, run_id)`` keeps the job(s) of the chosen run, so ``--run-id``
  can pick an older run than the file's last.
- **unreadable files**: ``mark_unreadable(report, unreadable)`` says so where the report
  would say a rank has no trace file.
"""

from __future__ import annotations

import re
from pathlib import Path

from eplb_fsm.inspect.findings import Finding, NoTraces, Report, ranks_text
from eplb_fsm.inspect.model import RankSummary
from eplb_fsm.inspect.records import parse_line

NO_RUN_ID = "(no run id)"
# a rank's trace file, as ``trace.trace_path`` names it: rank<N>.jsonl, a joiner's rank<N>.g<generation>.jsonl
TRACE_NAME = re.compile(r"^rank(\d+)(?:\.g(\d+))?\.jsonl$")


def joiner_generation(path: Path | str) -> int | None:
    """The generation in a joiner's file name (``rank<N>.g<generation>.jsonl``), None for a first rank's file."""
    m = TRACE_NAME.match(Path(path).name)
    return int(m.group(2)) if m and m.group(2) is not None else None


class MixedRuns(NoTraces):
    """The folder holds the traces of more than one run; the message says which files belong to which."""


def run_id_of(s: RankSummary) -> str | None:
    """The run id in the header of the file's first session (a joiner's later session shares the file)."""
    first = s.previous[0] if s.previous else s
    rid = (first.header or {}).get("run_id")
    return str(rid) if rid is not None else None


def _said_rank(s: RankSummary) -> object:
    """The ``rank`` field of the header of the file's first session, as written."""
    return ((s.previous[0] if s.previous else s).header or {}).get("rank")


def _header_rank(s: RankSummary) -> int | None:
    r = _said_rank(s)
    return r if type(r) is int and r >= 0 else None


def _names(paths: list[Path], limit: int = 4) -> str:
    names = [p.name for p in paths]
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def assign(loaded: list[tuple[int, Path, RankSummary]], run_id: str | None = None
           ) -> tuple[dict[int, RankSummary], dict[int, str], list[Finding]]:
    """(rank -> summary, rank -> file, findings about the files); raises ``MixedRuns``."""
    runs: dict[str, list[tuple[int, Path, RankSummary]]] = {}
    for item in loaded:
        runs.setdefault(run_id_of(item[2]) or NO_RUN_ID, []).append(item)
    if run_id is not None:
        if run_id not in runs:
            raise NoTraces(f"no trace of run {run_id!r}; the folder holds runs {', '.join(_every_run_id(loaded))}: "
                           + _runs_text(_every_run(loaded, runs)))
        loaded = runs[run_id]
    elif len(runs) > 1:
        every = _every_run(loaded, runs)
        raise MixedRuns("the folder holds the traces of " + str(len(every)) + " runs, replay one at a time "
                        "(--run-id ID): " + _runs_text(every))
    findings: list[Finding] = []
    # a joiner writes its own file (rank<N>.g<generation>.jsonl): its sessions follow rank N's, in generation order
    joiners = sorted((item for item in loaded if joiner_generation(item[1]) is not None),
                     key=lambda it: (it[0], joiner_generation(it[1])))
    loaded = [item for item in loaded if joiner_generation(item[1]) is None]
    claimed = [_header_rank(s) for _, _, s in loaded]
    for (r, p, s), h in zip(loaded, claimed):
        if h is None and type(said := _said_rank(s)) is int:   # a negative rank is no rank: the file name's is used
            s.warnings.append(f"{p.name}: the header's field 'rank' is {said}, not a rank (an integer >= 0); "
                              f"replayed as rank {r}, the file's name")
    swapped = [(r, p, h) for (r, p, _), h in zip(loaded, claimed) if h is not None and h != r]
    by_records = len(swapped) > 0 and len({h if h is not None else r for (r, _, _), h in zip(loaded, claimed)}) \
        == len(loaded)
    if swapped:
        findings.append(Finding.of(
            "swapped_rank_file", None,
            [(h, 0) for _, _, h in swapped] if by_records else [(r, 0) for r, _, _ in swapped],
            "; ".join(f"{p.name} holds the records of rank {h}" for _, p, h in swapped)
            + (": files renamed or swapped; replayed by the rank the records carry" if by_records else
               ": files renamed or swapped; the ranks the records carry collide, replayed by the file names"),
        ))
    by_rank: dict[int, list[tuple[Path, RankSummary]]] = {}
    for (r, p, s), h in zip(loaded, claimed):
        key = h if by_records and h is not None else r
        by_rank.setdefault(key, []).append((p, s))
    summaries: dict[int, RankSummary] = {}
    files: dict[int, str] = {}
    for r, items in sorted(by_rank.items()):
        keep = min(items, key=lambda it: (it[0].name != f"rank{r:05d}.jsonl", _header_rank(it[1]) != r,
                                          it[0].name))
        if len(items) > 1:
            findings.append(Finding.of(
                "duplicate_rank_file", None, [(r, 0)],
                f"{len(items)} files claim rank {r}: " + "; ".join(
                    f"{p.name} ({s.records} records, last step {s.last_step}, run {run_id_of(s) or NO_RUN_ID})"
                    for p, s in items) + f"; replayed {keep[0].name}",
            ))
        s = keep[1]
        for part in list(s.previous) + [s]:
            part.rank = r
        summaries[r] = s
        files[r] = str(keep[0])
    for r, path, s in joiners:
        before = summaries.get(r)
        parts = ([*before.previous, before] if before is not None else []) + [*s.previous, s]
        for i, part in enumerate(parts):
            part.rank, part.session, part.previous = r, i, []
        s.previous = parts[:-1]
        summaries[r] = s
        files.setdefault(r, str(path))
    return dict(sorted(summaries.items())), files, findings


def _every_run_id(loaded: list[tuple[int, Path, RankSummary]]) -> list[str]:
    """Each run id the files' jobs carry, sorted: an earlier job appended over is in no summary, so the
    files' headers are read again (only on this error path)."""
    found = set()
    for _, path, _ in loaded:
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        found.update(rid for _, rid in _jobs(text) if rid is not None)
    return sorted(found) or [NO_RUN_ID]


def _every_run(loaded: list[tuple[int, Path, RankSummary]], runs: dict[str, list]) -> dict[str, list]:
    """``runs`` (run id -> the files whose last job it is) with each file also under every earlier job's run id
    it holds: a file appended over by a later run still holds the earlier run's sessions (error path only)."""
    every = {rid: list(items) for rid, items in runs.items()}
    for item in loaded:
        try:
            text = item[1].read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        for rid in dict.fromkeys(rid for _, rid in _jobs(text) if rid is not None):
            if item not in every.setdefault(rid, []):
                every[rid].append(item)
    return {rid: sorted(items, key=lambda it: (it[0], it[1].name)) for rid, items in every.items()}


def _runs_text(runs: dict[str, list[tuple[int, Path, RankSummary]]]) -> str:
    return "; ".join(f"run {rid}: rank files {ranks_text(r for r, _, _ in items)} ({_names([p for _, p, _ in items])})"
                     for rid, items in sorted(runs.items(), key=lambda kv: min(r for r, _, _ in kv[1])))


def run_text(text: str, run_id: str) -> str:
    """The part of a file's text that run ``run_id`` wrote.

    A later header that is neither a joiner's (elastic EP: the same job goes on) nor a rotated
    segment's (``continued``) starts another job appended to the file. The text of the jobs whose
    header carries ``run_id`` is returned; the whole text when the file holds one job, or when no
    job of it has that run id (``assign`` then sets the file aside as another run's).
    """
    jobs = _jobs(text)
    if len(jobs) < 2:
        return text
    ends = [start for start, _ in jobs[1:]] + [len(text)]
    kept = [text[start:stop] for (start, rid), stop in zip(jobs, ends) if rid == run_id]
    return "".join(kept) if kept else text


def _jobs(text: str) -> list[list]:
    """[offset where the job starts, its run id or None] of each job appended to a file's text."""
    jobs: list[list] = []
    at = text.find('"header"')
    while at != -1:
        begin = text.rfind("\n", 0, at) + 1
        end = text.find("\n", at)
        end = len(text) if end == -1 else end
        rec = parse_line(text[begin:end])
        if rec is not None and rec.get("event") == "header":
            if not jobs or (rec.get("continued") is not True and rec.get("role") != "joiner"
                            and text[jobs[-1][0]:begin].strip()):
                jobs.append([0 if not jobs else begin, None])
            if jobs[-1][1] is None and rec.get("run_id") is not None:
                jobs[-1][1] = str(rec["run_id"])
        at = text.find('"header"', end)
    return jobs


def mark_unreadable(report: Report, unreadable: dict[int, str]) -> None:
    """Where ``report`` says a rank has no trace file but its file exists and could not be read
    (``unreadable``: rank -> why), say so: the rank's positions, details and ``missing_ranks`` summary."""
    plain = {f"rank {r}: no trace file": f"rank {r}: unreadable file: {why}" for r, why in unreadable.items()}
    for f in report.findings:
        for pos in f.ranks:
            if pos.get("status") == "no_trace" and pos.get("rank") in unreadable:
                pos["note"] = f"unreadable file: {unreadable[pos['rank']]}"
        f.details = [plain.get(d, d) for d in f.details]
        hit = [r for r in f.culprits if r in unreadable]
        if f.kind == "missing_ranks" and hit:
            f.summary += "; " + "; ".join(f"rank {r}'s file is unreadable: {unreadable[r]}" for r in hit)
    if report.findings and report.findings[0].kind == report.verdict:
        report.summary = report.findings[0].summary
