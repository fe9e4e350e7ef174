"""Stage 1 of the replay: one rank file, re-driven through the machine and indexed.

``summarize_rank(records)`` walks one rank file's records once (``walker.Walker``). Every
``transition`` record is re-driven through the machine definition (``MachineOracle``: a
real ``EplbMachine`` per distinct (state, layer, counters, event) context, memoised, since
guards read only event data and shared counters); a compact ``step`` record is the
internal ``step`` transition of its ``state`` and goes through the same oracle; every other
record is checked against the replayed state. An illegal transition is recorded with its
reason and the walk resynchronises on what a transition record claims (not on a step record
the machine keeps in the replayed state), so one bad record is reported once.

The result, ``RankSummary``, keeps only what the cross-rank stage (``replay.diagnose``) needs:
the state-changing transitions, the collectives per group and sequence number, the first and
last records, illegal transitions, watchdog and fault records, and the elastic-EP records
(``group_switch``, scale outcomes). A joiner that took number N after a process left is rank
N's later session (the earlier one in ``previous``), read from its ``rank<N>.g<g>.jsonl``
(``identity.assign``) or, in older traces, from the end of ``rank<N>.jsonl``.

``summarize_text(text)`` is the same walk over a JSONL file's text, with the runs of
compact step lines (most of a long trace) checked in bulk.
"""

from __future__ import annotations

import gc
import json
import operator
import os
import re
from itertools import compress, repeat
from pathlib import Path
from typing import Iterable

from eplb_fsm.inspect.model import PER_RANK_SHAPE, WORLD_GROUP, Collective, MachineOracle, RankSummary, Transition
from eplb_fsm.inspect.blocks import MIN_BLOCK_LINES, BlockReader, TemplateStore
from eplb_fsm.inspect.bulk import feed_units, periodic_stretches
from eplb_fsm.inspect.identity import TRACE_NAME, joiner_generation, run_text
from eplb_fsm.inspect.stepruns import StepLines, feed_run
from eplb_fsm.inspect.records import SILENCE_S, runs_note
from eplb_fsm.inspect.walker import parse_line, Walker
from eplb_fsm.trace_segments import read_rank_segments, read_rank_text

__all__ = [
    "PER_RANK_SHAPE", "WORLD_GROUP", "Collective", "MachineOracle", "RankSummary", "Transition",
    "summarize_rank", "summarize_text", "find_trace_files", "find_all_trace_files", "read_records",
    "parse_records", "load_rank_file", "load_rank_file_in_worker",
]

MIN_KNOWN_LINES = 1000    # smaller files check their step runs by regex alone (StepLines costs more there)
_ROTATED_NAME = re.compile(r"^(rank\d+(?:\.g\d+)?\.jsonl)\.\d+$")
_STEP_KEYS = frozenset(("ts", "rank", "world", "event", "state", "step", "seq", "dummy", "due"))  # of a step record


def summarize_rank(
    records: Iterable[dict],
    rank: int | None = None,
    *,
    path: str | None = None,
    bad_lines: int = 0,
    truncated: bool = False,
    oracle: MachineOracle | None = None,
) -> RankSummary:
    """Walk one rank's records once: re-drive its transitions, index its collectives.

    ``rank`` defaults to the ``rank`` of the header (or last record). Illegal transitions
    are collected (with the reason) and the replay continues as the module docstring says.
    """
    oracle = oracle or MachineOracle()
    w = Walker(rank, oracle, path, bad_lines, truncated)
    last = mux = None
    due = None   # the seq the next record must carry, while no jump is open (``seqcheck``), else None
    for n, rec in enumerate(records):
        last = rec
        w.line = n + 1
        if mux is not None:
            mux.feed(rec)
            continue
        # hot path: the compact record of a step that kept the state, with the fields of one and their types (else
        # Walker.record warns about a wrong type and ignores the field, as the text path does), numbered on from the
        # record before it and carrying the seq due (else Walker.step_record checks both: ``stepseq``, ``seqcheck``)
        if w.plain_ok and rec.get("event") == "step" and rec.get("state") == w.state and not rec.get("due") \
                and rec.keys() <= _STEP_KEYS and type(rec.get("step")) is int and type(rec.get("seq")) is int \
                and type(rec.get("ts")) is float and type(rec.get("rank")) is int and type(rec.get("world")) is int \
                and w.last is not None and rec["step"] - 1 == w.last.get("step") and rec["seq"] == due:
            due += 1
            w.n_steps += 1
            w.records += 1
            w.last = rec
            ts, seen = rec.get("ts"), w.seen_at   # its time, as Walker.record keeps it: silences are exact
            if seen is not None and type(ts) is float and ts - seen[0] <= SILENCE_S:
                w.seen_at = (ts, rec.get("step"), rec.get("state"))
            else:
                w.saw(ts, rec.get("step"), rec.get("state"))
            continue
        if _interleaves(w, rec):
            mux = _Interleaved(w, rank, oracle, path)
            mux.feed(rec)
            continue
        w.record(rec)
        due = w.next_seq() if w.seqs.jump is None else None
    return mux.result() if mux is not None else w.result(last)


def _interleaves(w: Walker, rec: dict) -> bool:
    """A joiner's header while the file's current session may still write: both go on in one file."""
    return rec.get("event") == "header" and rec.get("role") == "joiner" and rec.get("continued") is not True \
        and w.live()


class _Interleaved:
    """Sessions of one file that write at the same time.

    In traces written before joiners had their own files, a joiner may take the number of a
    rank whose process goes on serving under another number: both append to the same file.
    Every record goes to the session whose ``seq`` it continues (ties: the one whose current
    rank it carries, then the newest: a session that died never writes again). Nothing is
    read in bulk from here on; this is rare and the files involved are small.
    """

    def __init__(self, first: Walker, rank: int | None, oracle: MachineOracle, path: str | None) -> None:
        self.walkers = [first]
        self.rank, self.oracle, self.path = rank, oracle, path

    def feed(self, rec: dict) -> None:
        if rec.get("event") == "header" and rec.get("continued") is not True:
            w = Walker(self.rank, self.oracle, self.path)
            w.segments = self.walkers[-1].segments if self.walkers else None
            if rec.get("role") != "joiner":  # a new job appended to the file: the earlier runs are stale
                w.s.warnings.append(runs_note(None, rec, self.walkers[-1].s.header if self.walkers else None))
                self.walkers = []
            self.walkers.append(w)
            w.record(rec)
            return
        seq, rank = rec.get("seq"), rec.get("rank")
        target = max(range(len(self.walkers)), key=lambda i: (
            self.walkers[i].next_seq() == seq, (self.walkers[i].last or {}).get("rank") == rank, i))
        self.walkers[target].record(rec)

    def result(self) -> RankSummary:
        sessions: list[RankSummary] = []
        for w in self.walkers:
            sessions += w.done + [w.finish(w.last_record())]
        for i, s in enumerate(sessions):
            s.session = i
            s.previous = []
        sessions[-1].previous = sessions[:-1]
        return sessions[-1]


def summarize_text(text: str, rank: int | None = None, *, path: str | None = None,
                   oracle: MachineOracle | None = None, templates: TemplateStore | None = None,
                   segments: list[tuple[str, int]] | None = None) -> RankSummary:
    """``summarize_rank`` over a JSONL file's text, with runs of compact step lines checked in bulk.

    Gives the same summary as parsing every line and calling ``summarize_rank``
    (unreadable lines are skipped and counted, an unreadable last line marks the file
    truncated), faster: the other lines are parsed by one ``json.loads``, and each run of
    step lines between two of them is matched, in C, against the exact form of a compact
    step record stamped with the replayed state. A run that does not match (another
    state, a ``due`` flag, extra fields, a blank or broken line) is parsed and replayed
    line by line. Stretches where one unit of records repeats every step (a step and an
    all-reduce's start and end) are checked in bulk without parsing them (``bulk``).
    ``templates``: rearrangement blocks learned from the other files of the same replay (``blocks``).
    ``segments``: where each segment of a rotated file begins (``read_rank_segments``), so that a
    warning names the segment file and its own line.
    """
    lines = text.split("\n")
    stretches = periodic_stretches(text, len(lines))
    if stretches:
        other, pos = [], 0
        for b_start, b_end, _ in stretches + [(len(lines), len(lines), 0)]:
            other += [i for i in range(pos, b_start) if '"event":"step"' not in lines[i] and lines[i].strip()]
            pos = b_end
    else:
        other = _not_step_lines(lines)
    # runs of consecutive non-step lines (rearrangement blocks) go through ``blocks`` and are parsed
    # only when they cannot be applied from a template; the other lines are parsed at once
    block_end: dict[int, int] = {}     # position in ``other`` -> end position of its block
    a = 0
    for b in range(1, len(other) + 1):
        if b == len(other) or other[b] != other[b - 1] + 1:
            if b - a >= MIN_BLOCK_LINES:
                block_end[a] = b
            a = b
    eager = [k for a, b in _gaps(block_end, len(other)) for k in range(a, b)]
    parsed: list = [None] * len(other)
    try:
        batch = json.loads("[" + ",".join([lines[other[k]] for k in eager]) + "]") if eager else []
        if not all(type(r) is dict for r in batch):
            raise ValueError("a line is not a JSON object")
    except (ValueError, RecursionError):   # a line nested past json's depth limit is a bad line, as garbage is
        batch = [parse_line(lines[other[k]]) for k in eager]
    for k, rec in zip(eager, batch):
        parsed[k] = rec
    oracle = oracle or MachineOracle()
    w = Walker(rank, oracle, path)
    w.segments = segments
    blocks = BlockReader(lines, parse_line, templates)
    # the shapes of a file's lines pay off when most lines are step lines in long runs (the compact form);
    # a file that all-reduces every step has short runs, read by its periodic stretches
    compact = not stretches and len(lines) >= MIN_KNOWN_LINES and 4 * len(other) < len(lines)
    known = StepLines.of_lines(lines, other) if compact else None
    bad = 0
    prev = -1
    mux = None
    pending = iter(stretches)
    stretch = next(pending, None)

    def feed_stretch(b_start: int, b_end: int, period: int) -> int:
        lost = feed_run(w, lines, prev + 1, b_start, parse_line, known) if b_start > prev + 1 else 0
        if not feed_units(w, lines, b_start, b_end, period, parse_line):
            lost += feed_run(w, lines, b_start, b_end, parse_line, known)
        return lost

    k = 0
    while k < len(other):
        i = other[k]
        while stretch is not None and stretch[0] < i:
            bad += feed_stretch(*stretch)
            prev = stretch[1] - 1
            stretch = next(pending, None)
        if i > prev + 1:
            bad += feed_run(w, lines, prev + 1, i, parse_line, known)
        end = block_end.get(k)
        if end is not None:
            done = blocks.feed(w, i, other[end - 1] + 1)
            if done is True:
                prev = other[end - 1]
                k = end
                continue
            parsed[k:end] = done
        rec = parsed[k]
        w.line = i + 1
        if rec is None:
            bad += 1
        elif _interleaves(w, rec):  # two sessions write at once from here: route line by line
            mux = _Interleaved(w, rank, oracle, path)
            for line in lines[i:]:
                if line.strip():
                    rec = parse_line(line)
                    if rec is None:
                        bad += 1
                    else:
                        mux.feed(rec)
            break
        else:
            w.record(rec)
        prev = i
        k += 1
    while mux is None and stretch is not None:
        bad += feed_stretch(*stretch)
        prev = stretch[1] - 1
        stretch = next(pending, None)
    if mux is None and prev + 1 < len(lines):
        bad += feed_run(w, lines, prev + 1, len(lines), parse_line, known)
    last, last_bad = _ends(text)
    summary = mux.result() if mux is not None else w.result(last)
    summary.bad_lines = bad
    summary.truncated = last_bad
    return summary


def _not_step_lines(lines: list[str]) -> list[int]:
    """Indices of the non-blank lines that are no step record (a C pass over the lines, then the few left)."""
    is_step = map(operator.contains, lines, repeat('"event":"step"'))
    return [i for i in compress(range(len(lines)), map(operator.not_, is_step)) if lines[i].strip()]


def _gaps(block_end: dict[int, int], n: int) -> list[tuple[int, int]]:
    """The position ranges of ``other`` outside the blocks (``block_end``: start -> end)."""
    out, pos = [], 0
    for a in sorted(block_end):
        out.append((pos, a))
        pos = block_end[a]
    out.append((pos, n))
    return out


def _ends(text: str) -> tuple[dict | None, bool]:
    """(last readable record, whether the last non-blank line is unreadable)."""
    last, last_bad, seen = None, False, False
    end = len(text)
    while end > 0 and last is None:
        begin = text.rfind("\n", 0, end - 1) + 1
        line = text[begin:end].strip()
        end = begin
        if not line:
            continue
        rec = parse_line(line)
        if rec is None:
            last_bad = last_bad or not seen
        else:
            last = rec
        seen = True
    return last, last_bad


# ---------------------------------------------------------------------------------------
# reading files


def load_rank_file(r: int, path: Path, oracle: MachineOracle | None = None, templates: TemplateStore | None = None,
                   run_id: str | None = None) -> tuple[int, RankSummary | None, list[str]]:
    """Read and summarise one rank file (only run ``run_id``'s part of it when given, ``identity.run_text``):
    (rank, summary, warnings), or (rank, None, [why there is none]); ``templates``: see ``blocks``."""
    warnings: list[str] = []
    try:
        whole, segments = read_rank_segments(path)   # rotated segments first, oldest first
    except OSError as exc:
        return r, None, [f"rank {r}: cannot read {path}: {exc.strerror or exc}"]
    text = whole if run_id is None else run_text(whole, run_id)
    # lines name their own segment file; not where another run's lines were cut out (the numbers moved)
    segments = segments if len(segments) > 1 and text is whole else None
    summary = summarize_text(text, r, path=str(path), oracle=oracle, templates=templates, segments=segments)
    bad = summary.bad_lines
    if not summary.records:
        return r, None, [f"rank {r}: {path.name} has no readable record" + (f" ({bad} bad lines)" if bad else "")]
    if summary.truncated:
        warnings.append(f"rank {r}: last line of {path.name} is truncated (killed, or a failed write?); skipped it")
        if bad > 1:
            warnings.append(f"rank {r}: {bad - 1} more unreadable line(s) in {path.name} skipped")
    elif bad:
        warnings.append(f"rank {r}: {bad} unreadable line(s) in {path.name} skipped")
    return r, summary, warnings


_WORKER_TEMPLATES = TemplateStore()   # filled only in a worker process (its own copy), by the files it reads


def load_rank_file_in_worker(item: tuple[int, Path, str | None]) -> tuple[int, RankSummary | None, list[str]]:
    """``load_rank_file`` in a worker process of ``replay.load_dir``: item is (rank, path, run id)."""
    gc.disable()  # a worker only allocates records and frees them: the cycle collector is pure cost
    return load_rank_file(item[0], item[1], templates=_WORKER_TEMPLATES, run_id=item[2])


def find_all_trace_files(logdir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(rank, path) for every ``rank<N>.jsonl`` in ``logdir``, sorted; two names may claim one rank
    (``rank2.jsonl`` and ``rank00002.jsonl``). A rank whose live file is missing but whose
    rotated segments are there (a writer killed while it rolled the file) is listed by its
    live file's path, which reads those segments."""
    found = set()
    for path in Path(logdir).iterdir():
        m = TRACE_NAME.match(path.name)
        if m and path.is_file():
            found.add((int(m.group(1)), path))
        elif (rotated := _ROTATED_NAME.match(path.name)) and path.is_file():
            live = path.with_name(rotated.group(1))
            if not live.exists():
                found.add((int(TRACE_NAME.match(live.name).group(1)), live))
    return sorted(found)


def find_trace_files(logdir: str | os.PathLike) -> dict[int, Path]:
    """rank -> path for every ``rank<N>.jsonl`` in ``logdir`` (of two names for one rank, the writer's
    zero-padded one; a joiner's ``rank<N>.g<g>.jsonl`` is a later session of rank N, ``identity.assign``'s)."""
    found: dict[int, Path] = {}
    for r, path in find_all_trace_files(logdir):
        if joiner_generation(path) is None and (r not in found or path.name == f"rank{r:05d}.jsonl"):
            found[r] = path
    return dict(sorted(found.items()))


def read_records(path: str | os.PathLike) -> tuple[list[dict], int, bool]:
    """(records, unreadable lines, whether the last line was the unreadable one).

    ``path`` is a rank's live file; its rotated segments are read first, oldest first
    (``trace_segments``). The whole text is parsed as one JSON array when it is clean
    (twice as fast as a ``json.loads`` per line); a text with a bad line is read line by line.
    """
    return parse_records(read_rank_text(path))


def parse_records(text: str) -> tuple[list[dict], int, bool]:
    """``read_records`` over a rank file's text already read (``trace_segments.read_rank_text``)."""
    body = text.strip()
    if not body:
        return [], 0, False
    try:
        records = json.loads("[" + body.replace("\n", ",") + "]")
        if all(type(r) is dict for r in records):
            return records, 0, False
    except (ValueError, RecursionError):
        pass
    records, bad, last_bad = [], 0, False
    for line in body.split("\n"):
        line = line.strip()
        if not line:
            continue
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):
            rec = None
        if type(rec) is dict:
            records.append(rec)
            last_bad = False
        else:
            bad += 1
            last_bad = True
    return records, bad, last_bad and bad > 0
