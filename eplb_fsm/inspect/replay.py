"""Replay per-rank traces and name the first divergence (docs/design.md §7).

Stage 1 (``eplb_fsm.inspect.summary``) walks each rank file once: its transitions are
re-driven through the machine definition and its collectives indexed by group and sequence
number (a joiner that took number N after a rank left is rank N's second session, in
``rank<N>.g<g>.jsonl`` or, in older traces, ``rank<N>.jsonl``). Stage 2, ``diagnose(traces)``,
a pure function over loaded records (or their summaries), turns the sessions into participants
with their group memberships across generations (``elastic``), runs the checks (``checks``):
the n-th state change must be the same event at the same step everywhere, and every group's
collectives must line up by sequence number among its members. It returns a ``Report``
(``findings``) whose verdict is the first divergence, with what every rank was doing there.

``replay_dir(logdir)`` reads the ``rank*.jsonl`` files (tolerating missing ranks and
unreadable lines), summarising one file at a time, and diagnoses. Unknown record kinds
are counted and otherwise ignored.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from eplb_fsm.inspect.checks import (DIED_SLACK_STEPS, align_transitions, check_ends, check_failed, check_headers,
                                    check_illegal, check_stuck, kept_transitions, step_count_mismatch, world_groups)
from eplb_fsm.inspect.collective_checks import check_collectives, handled_by_fault
from eplb_fsm.inspect.endings import failed_waits
from eplb_fsm.inspect.elastic import build_cast, renumbered, scale_context, scale_notes, scale_text, transition_offsets
from eplb_fsm.inspect.frozen import passed_last
from eplb_fsm.inspect.findings import (HEALTHY, KINDS, MAX_FINDINGS, UNREAD, Finding, NoTraces, Report, majority,
                                       ranks_text)
from eplb_fsm.inspect.blocks import TemplateStore
from eplb_fsm.inspect.identity import MixedRuns, assign, mark_unreadable
from eplb_fsm.inspect.late import CLOCK_NOISE_S, aborted_rearrangements, add_late, signalled_in_hang
from eplb_fsm.inspect.liveness import check_liveness
from eplb_fsm.inspect.records import trace_items
from eplb_fsm.inspect.pauses import paused_late
from eplb_fsm.inspect.signal_death import in_flight
from eplb_fsm.inspect.torn import qualify_torn
from eplb_fsm.inspect.summary import (Collective, MachineOracle, RankSummary, Transition, find_all_trace_files,
                                     find_trace_files, load_rank_file, load_rank_file_in_worker, read_records,
                                     summarize_rank, summarize_text)

__all__ = [
    "KINDS", "HEALTHY", "NoTraces", "MixedRuns", "Finding", "Report", "Loaded", "diagnose", "load_dir", "replay_dir",
    "default_jobs", "ranks_text", "world_groups", "DIED_SLACK_STEPS", "MAX_FINDINGS",
    # stage 1, re-exported
    "Collective", "MachineOracle", "RankSummary", "Transition", "find_trace_files", "read_records",
    "summarize_rank", "summarize_text",
]


# ---------------------------------------------------------------------------------------
# reading a folder


@dataclass
class Loaded:
    """Per-rank summaries read from a directory, with what was wrong with the input."""

    summaries: dict[int, RankSummary]
    warnings: list[str]
    files: dict[int, str]
    findings: list[Finding] = field(default_factory=list)   # problems of the files (``identity``)
    unreadable: dict[int, str] = field(default_factory=dict)  # rank -> why its file gave no record


def default_jobs() -> int:
    """Worker processes ``replay_dir`` uses when asked for ``jobs=0`` (auto): the CPUs, at most 8."""
    return max(1, min(8, os.cpu_count() or 1))


def load_dir(logdir: str | os.PathLike, oracle: MachineOracle | None = None, jobs: int = 1,
             run_id: str | None = None) -> Loaded:
    """Read and summarise every rank file of ``logdir``.

    ``jobs > 1`` spreads the files over that many worker processes (``0``: one per CPU,
    at most 8); each process holds one file's records at a time either way. Files of
    different runs are refused (``identity.MixedRuns``) unless ``run_id`` picks one (in a file
    other runs appended to, too: ``identity.run_text``); files that claim one rank, or carry
    another rank's records, become findings (``identity``); a file that gives no record is in
    ``unreadable``, with why. A folder that cannot be listed is ``NoTraces``.
    """
    if type(jobs) is not int or jobs < 0:
        raise ValueError(f"jobs must be an integer >= 1 (or 0: one per CPU), got {jobs!r}")
    logdir = Path(logdir)
    try:
        if not logdir.is_dir():
            raise NoTraces(f"{logdir} is not a directory")
        found = find_all_trace_files(logdir)
    except OSError as exc:
        raise NoTraces(f"cannot list the trace files of {logdir}: {exc}") from None
    if not found:
        raise NoTraces(f"no rank*.jsonl trace files in {logdir}")
    files = found
    jobs = default_jobs() if jobs == 0 else max(1, int(jobs))
    jobs = min(jobs, len(files))
    oracle = oracle or MachineOracle()
    results: list[tuple[int, RankSummary | None, list[str]]] = []
    if jobs > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        methods = multiprocessing.get_all_start_methods()
        ctx = multiprocessing.get_context("fork" if "fork" in methods else None)
        with ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
            results = list(pool.map(load_rank_file_in_worker, [(r, p, run_id) for r, p in files],
                                    chunksize=max(1, len(files) // (4 * jobs))))
    else:
        enabled = gc.isenabled()
        gc.disable()
        try:
            templates = TemplateStore()
            results = [load_rank_file(r, path, oracle, templates, run_id) for r, path in files]
        finally:
            if enabled:
                gc.enable()
    readable, warnings, unreadable = [], [], {}
    for (r, path), (_, summary, notes) in zip(files, results):
        warnings += notes
        if summary is not None:
            readable.append((r, path, summary))
        elif notes:
            unreadable.setdefault(r, notes[0].removeprefix(f"rank {r}: "))
    if not readable:
        more = f" (and {len(files) - 1} more file(s) without a readable record)" if len(files) > 1 else ""
        raise NoTraces(f"no readable records in the trace files of {logdir}: {warnings[0]}{more}")
    summaries, paths, findings = assign(readable, run_id)
    return Loaded(summaries, warnings, paths, findings, unreadable)


def _as_summaries(traces: Any, oracle: MachineOracle) -> dict[int, RankSummary]:
    out: dict[int, RankSummary] = {}
    for r, t in trace_items(traces):
        s = t if isinstance(t, RankSummary) else summarize_rank(t, r, oracle=oracle)
        out[s.rank if r is None else int(r)] = s
    return dict(sorted(out.items()))


def diagnose(
    traces: Mapping[int, Iterable[dict] | RankSummary] | Iterable[RankSummary],
    *,
    world: int | None = None,
    warnings: Iterable[str] = (),
    oracle: MachineOracle | None = None,
    input_findings: Iterable[Finding] = (),
) -> Report:
    """The replay verdict over already-loaded traces (rank -> records, or summaries).

    ``world`` overrides the world size read from the records (ranks ``0..world-1`` are
    expected in the first generation). The findings are sorted by step (configuration
    problems first, missing ranks last; at equal steps the more causal kind first) and the
    first is the verdict. A cause the liveness records show (a rank that died, froze,
    crashed or lagged; ``liveness``) comes before everything it led to, and the ranks that
    only reacted to it are listed as consequences, never as culprits. ``input_findings``:
    problems of the files themselves found while reading them (``load_dir``). Any other input (a key
    that is not a rank, ``read_trace``'s ``(records, bad_lines)`` as a value) is a ValueError naming the
    rank, before any work (``records.trace_items``).
    """
    if world is not None and (type(world) is not int or world < 1):
        raise ValueError(f"world must be an integer >= 1, got {world!r}")
    oracle = oracle or MachineOracle()
    summaries = _as_summaries(traces, oracle)
    warnings = list(warnings)
    for r in [r for r, s in summaries.items() if s.records == 0 and not s.previous]:
        warnings.append(f"rank {r}: no records; treated as missing")
        del summaries[r]
    if not summaries:
        raise NoTraces("no rank has any record")
    later: list[str] = []
    cast = build_cast(summaries, world, later)
    for k, s in cast.parts.items():
        warnings.extend(f"{cast.label(k)}: {w}" for w in s.warnings)
        if s.write_errors:   # failures its own writer counted: lines it dropped, or a file lost with its lines
            warnings.append(f"{cast.label(k)}'s writer reported {s.write_errors} trace write failure(s) "
                            "(`write_errors` on its alive/end records): records may be lost")
    for r, s in summaries.items():
        if s.truncated and not any(w.startswith(f"rank {r}: last line") for w in warnings):
            warnings.append(f"rank {r}: last line truncated; skipped it")
    warnings += later
    world = cast.world

    findings: list[Finding] = []
    findings += check_headers(cast, warnings)
    findings += check_illegal(cast)
    kept = kept_transitions(cast)   # from where every kept history starts (rotated segments deleted)
    findings += align_transitions(cast, transition_offsets(cast, warnings, kept), kept)
    coll = check_collectives(cast)
    handled = [f for f in coll if handled_by_fault(f, cast)]
    coll = [f for f in coll if f not in handled]
    findings += coll
    # a participant whose trace stops inside or before a hang is reported as that hang's culprit
    hang_culprits = {k for f in coll if f.kind == "hang" for k in f.keys()}
    live = check_liveness(cast)
    warnings += live.pauses + live.held_back   # a pause of the whole job; a lag or deadlock too short to name
    # a rank the liveness rules found dead or frozen (for good: its trace stops too) is not found dead again
    died = {k for f in live.findings if f.kind in ("rank_died", "frozen") for k in f.keys()}
    findings += check_ends(cast, hang_culprits | died)
    findings += step_count_mismatch(cast)
    findings += check_failed(cast)
    findings += check_stuck(cast)
    findings += live.lost + list(input_findings)
    findings += _disorder(cast)
    findings += _world_mismatch(cast, world, summaries)
    missing = sorted(cast.missing)
    if missing:
        findings.append(Finding.of(
            "missing_ranks", None, missing,
            f"no trace for {cast.who(missing)} of a world of {world}: what they did is unknown"
            if all(m[0] in cast.world_ranks and cast.missing[m] == f"rank {m[0]}" for m in missing) else
            f"no trace for {cast.who(missing)}: what they did is unknown",
            ranks=[cast.position(k, "no_trace", "no trace file") for k in missing],
        ))
    findings.sort(key=Finding.sort_key)
    add_late(cast, live, findings, handled)   # a rank late to a collective that failed everywhere: cause or note
    live.findings = [f for f in live.findings if not paused_late(f, cast, live.paused, CLOCK_NOISE_S)]   # late: paused
    # cause first: a configuration that differs, then what the liveness records show, then the rest
    config = [f for f in findings if f.kind == "config_mismatch"]
    rest = [f for f in findings if f.kind != "config_mismatch"]
    # a signal ends a hang only where its ranks had waited; a collective in flight stays in the signalled cause;
    # a freeze the job got past explains no later hang or divergence (frozen.passed_last)
    causes, rest = passed_last([f for f in live.findings if not (_died_waiting(f, rest, cast, live.findings) or (
        signalled_in_hang(f, in_flight(f, rest, cast), cast, live)))], rest, live.passed)
    findings = qualify_torn(cast, config + [_with_collective(f, rest, cast) for f in causes] + rest, warnings)
    if findings and findings[0].kind == "failed" and not causes and (why := failed_waits(cast, findings[0].keys(),
                                                                                   findings[0].step)):
        findings[0].summary += "; " + why   # nothing late, gone or frozen: say which wait failed, and how
    if not findings and live.unexplained is not None:   # a rank ended with an exception and nothing else explains it
        findings = [live.unexplained]
    scales = scale_notes(cast)
    for f in findings:  # what a culprit's stop or number means in an elastic job
        if f.kind in ("hang", "rank_died", "collective_mismatch"):
            f.details += [n for k in f.keys() if (n := scale_context(cast, k, f.step, scales))]
        if f.collective and isinstance(f.collective.get("group"), str):
            f.details += [n for k in f.keys() if (n := renumbered(cast, k, f.collective["group"]))]
    more = max(0, len(findings) - MAX_FINDINGS)
    findings = findings[:MAX_FINDINGS]

    illegal = [dict(i, session=k[1]) if k[1] else i for k, s in cast.parts.items() for i in s.illegal]
    ranks = [s.to_dict() for s in cast.parts.values()]
    missing_ranks = sorted({k[0] for k in missing})
    aborted = aborted_rearrangements(cast, handled, live.findings, [g for g in coll if g.kind == "hang"])
    injected = [dict(i, rank=k[0]) for k, s in cast.parts.items() for i in s.injected]
    run_ids = sorted({str(s.header.get("run_id")) for s in cast.parts.values() if s.header and s.header.get("run_id")})
    extra = dict(aborted=aborted, injected=injected, run_id=run_ids[0] if len(run_ids) == 1 else None)
    if findings:
        f = findings[0]
        # what happened to the other ranks afterwards, as the text report lists it: the verdict's culprits are not
        # their own consequence, and the later findings (input problems among them) stay under ``findings``
        consequences = [text for k, text in live.consequences if k[0] not in f.culprits]
        return Report(f.kind, f.summary, f.culprits, f.step, f.state, f.layer, f.collective, f.ranks,
                      findings, illegal, ranks, warnings, world, missing_ranks, more, handled, scales,
                      consequences=consequences, **extra)
    return Report(HEALTHY, _healthy_summary(cast, summaries, scales, handled, aborted), [], None, None, None, None,
                  [], [], illegal, ranks, warnings, world, missing_ranks, 0, handled, scales, **extra)


def _died_waiting(cause: Finding, rest: list[Finding], cast, causes: list[Finding]) -> bool:
    """A rank that died inside a collective another member never joined (gloo aborts a process
    whose peer issued a different collective) died of that hang: the hang's culprit is the cause.
    The death becomes the hang's first detail; True when it was folded so. Not when the liveness
    records explain the culprit's absence themselves (it froze, died, crashed: ``causes``): then
    two things went wrong, and the death stays a finding of its own."""
    if cause.kind != "rank_died":
        return False
    opened = {(c.group, c.cseq) for k in cause.keys() if k in cast.parts for c in cast.parts[k].open_collectives()}
    explained = {k for c in causes if c is not cause for k in c.keys()}
    for f in rest:
        if f.kind in ("hang", "collective_mismatch") and f.collective and not set(f.culprits) & set(cause.culprits) \
                and not set(f.keys()) & explained \
                and (f.collective.get("group"), f.collective.get("cseq")) in opened:
            f.details.insert(0, f"{cause.summary} (inside this collective, which the culprit never joined)")
            return True
    return False


def _with_collective(cause: Finding, rest: list[Finding], cast) -> Finding:
    """A death the collectives show too (the rank never joined one the others waited in) is told
    by that collective finding, richer (op, group, cseq, who waited), with the death as its first
    detail; the collective finding leaves ``rest``. Any other cause stays as it is."""
    if cause.kind != "rank_died" or type(cause.step) is not int:
        return cause
    for f in rest:   # not a posted collective the others finished: the dead rank waited in nothing there
        if f.kind in ("hang", "collective_mismatch") and f.culprits == cause.culprits and type(f.step) is int \
                and UNREAD not in f.summary \
                and (cause.step - 2 <= f.step <= cause.step + 2 or _died_before(cause, f, cast)):
            rest.remove(f)
            f.details.insert(0, cause.summary)
            return f
    return cause


def _died_before(cause: Finding, f: Finding, cast) -> bool:
    """The dead rank's trace stops at or before the collective's step, and before any waiter started it.

    A killed rank loses the steps it counted and had not yet written (up to a flush interval, many
    steps at a fast engine), so its last step can lie well before the collective it never joined.
    """
    coll = f.collective or {}
    g, c = coll.get("group"), coll.get("cseq")
    last = [cast.parts[k].last_ts for k in cause.keys() if k in cast.parts]
    starts = [e.ts for k, s in cast.parts.items() if k not in cause.keys()
              and (e := s.collectives.get(g, {}).get(c)) is not None and type(e.ts) in (int, float)]
    return cause.step <= f.step and bool(starts) and None not in last and bool(last) and max(last) <= min(starts)


def _disorder(cast) -> list[Finding]:
    """Records out of order by ``seq``: one finding per participant, with file and line."""
    found = []
    for k, s in cast.parts.items():
        if not s.disorder:
            continue
        d = s.disorder[0]
        more = f" ({len(s.disorder) - 1} more)" if len(s.disorder) > 1 else ""
        found.append(Finding.of(
            "out_of_order", None, [k],
            f"{d['where']}: {cast.label(k)}'s record {d['event']} has seq {d['seq']} where seq {d['expected']} "
            f"was due: records out of order{more}",
            ranks=[cast.position(k, "out_of_order", f"{x['where']}: seq {x['seq']}, expected {x['expected']}")
                   for x in s.disorder[:5]],
        ))
    return found


def _world_mismatch(cast, world: int | None, summaries: dict[int, RankSummary]) -> list[Finding]:
    """``--ranks`` given and different from the world the first ranks' headers were written with."""
    if world is None:
        return []
    by_world: dict[Any, list] = {}
    for r, s in summaries.items():
        first = s.previous[0] if s.previous else s
        w = (first.header or {}).get("world", first.world)
        if type(w) is int:
            by_world.setdefault(w, []).append((r, 0))
    if not by_world:
        return []
    traced = majority(by_world)
    if traced == world:
        return []
    outside = sorted(r for r in summaries if r >= world)
    return [Finding.of(
        "world_mismatch", None, by_world[traced],
        f"--ranks {world} was given but the traces were written by a world of {traced} "
        f"(rank files {ranks_text(summaries)})"
        + (f"; rank files {ranks_text(outside)} lie outside --ranks" if outside else ""),
    )]


def _healthy_summary(cast, summaries: dict[int, RankSummary], scales: list[dict], handled: list[Finding],
                     rollbacks: list[dict] = ()) -> str:
    parts = cast.parts.values()
    n_records = sum(s.records for s in parts)
    steps = [s.last_step for s in parts if isinstance(s.last_step, int)]
    rearr = max((s.rearrangements() for s in parts), default=0)
    tail = (f"{n_records} records, steps up to {max(steps) if steps else '-'}, {rearr} rearrangements, "
            "0 illegal transitions, no divergence")
    if not cast.elastic and not scales:
        summary = f"{len(summaries)} of {cast.world} ranks agree: {tail}"
    else:
        worlds = [str(cast.world)] + [str(n["to_ranks"]) for n in scales if n["outcome"] == "switched"]
        sessions = f" ({len(cast.parts)} sessions)" if len(cast.parts) != len(summaries) else ""
        summary = (f"{len(summaries)} ranks{sessions} agree across {len(scales)} scale(s), "
                   f"world {' -> '.join(worlds)}: {tail}")
        # a scale that did not switch, or switched part-way, is worth its line even when healthy
        noted = [n for n in scales if n["outcome"] != "switched" or n.get("partial")]
        if noted:
            summary += "; " + "; ".join("scale " + scale_text(n) for n in noted)
    if handled:
        summary += f" ({len(handled)} collective failure(s) handled by a fault on every rank)"
    if rollbacks:
        summary += f"; {len(rollbacks)} aborted rearrangement(s): " + "; ".join(a["text"] for a in rollbacks[:3])
    return summary


def replay_dir(logdir: str | os.PathLike, world: int | None = None, jobs: int = 1,
               run_id: str | None = None) -> Report:
    """Read every rank's trace in ``logdir`` and diagnose; raises NoTraces on unusable input
    (``identity.MixedRuns`` when the folder holds several runs and ``run_id`` picks none).

    ``jobs``: worker processes for reading (1: in this process; 0: one per CPU).
    """
    if world is not None and (type(world) is not int or world < 1):
        raise ValueError(f"world must be an integer >= 1, got {world!r}")
    oracle = MachineOracle()
    # the summaries hold ~10^5 small objects and nothing here makes cycles worth collecting: a full
    # collection triggered while diagnosing would walk them all (a fifth of a large replay's time)
    enabled = gc.isenabled()
    gc.disable()
    try:
        loaded = load_dir(logdir, oracle, jobs=jobs, run_id=run_id)
        report = diagnose(loaded.summaries, world=world, warnings=loaded.warnings, oracle=oracle,
                          input_findings=loaded.findings)
        mark_unreadable(report, loaded.unreadable)
        return report
    finally:
        if enabled:
            gc.enable()
