"""Replay per-rank traces and name the first divergence (design §7).

Stage 1 (``eplb_fsm.inspect.summary``) walks each rank's trace once: its transitions are
re-driven through the machine definition and its collectives indexed by group and
sequence number. Stage 2, ``diagnose(traces)``, a pure function over loaded records (or
their summaries), lines the ranks up by transition ordinal (the n-th state change must be
the same event at the same step on every rank) and by per-group collective sequence
number, and returns a ``Report`` whose verdict is the first divergence, with what every
rank was doing there.

``replay_dir(logdir)`` reads the ``rank*.jsonl`` files (tolerating missing ranks and
unreadable lines), summarising one file at a time, and diagnoses. Unknown record kinds
are counted and otherwise ignored.
"""

from __future__ import annotations

import gc
import json
import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from eplb_fsm.fsm.machine import FAILED
from eplb_fsm.inspect.summary import (
    WORLD_GROUP,
    Collective,
    MachineOracle,
    RankSummary,
    Transition,
    find_trace_files,
    read_records,
    summarize_rank,
    summarize_text,
)

__all__ = [
    "KINDS", "HEALTHY", "NoTraces", "Finding", "Report", "Loaded", "diagnose", "load_dir", "replay_dir",
    "default_jobs", "ranks_text", "world_groups",
    # stage 1, re-exported
    "Collective", "MachineOracle", "RankSummary", "Transition", "find_trace_files", "read_records",
    "summarize_rank", "summarize_text",
]

# verdicts: "healthy" or the kind of the first finding
HEALTHY = "healthy"
KINDS = (
    "illegal_transition",     # a rank's trace has a transition the machine refuses
    "config_mismatch",        # headers (schema, world, config) differ across ranks
    "decision_divergence",    # the n-th state change is a different event/destination on some rank
    "step_divergence",        # the same state change happened at different steps
    "collective_mismatch",    # different op/shape at the same (group, cseq), or a rank skipped one
    "hang",                   # a collective started and never ended on some ranks
    "rank_died",              # a rank's trace stops while the others went on
    "failed",                 # a rank ended in the failed state
    "stuck",                  # the watchdog reported no progress and nothing came after
    "missing_ranks",          # a rank of the world has no trace file
)
# at the same step the more causal kind is the verdict: a decision taken differently (or at
# another step) comes before the collectives it leads to, and those before the hang
_PRIORITY = {k: i for i, k in enumerate(KINDS)}
# ranks are not stopped in lockstep: a trace ending one step before the others is not a death
DIED_SLACK_STEPS = 1
# how many findings a report keeps (the first ones matter; the rest are counted)
MAX_FINDINGS = 50


class NoTraces(ValueError):
    """The input cannot be replayed at all (no directory, no trace files, nothing readable)."""


# ---------------------------------------------------------------------------------------
# reading a folder


@dataclass
class Loaded:
    """Per-rank summaries read from a directory, with what was wrong with the input."""

    summaries: dict[int, RankSummary]
    warnings: list[str]
    files: dict[int, str]


def _load_one(r: int, path: Path, oracle: MachineOracle | None = None) -> tuple[int, RankSummary | None, list[str]]:
    """Read and summarise one rank file: (rank, summary or None, warnings)."""
    warnings: list[str] = []
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            text = fh.read()
    except OSError as exc:
        return r, None, [f"rank {r}: cannot read {path}: {exc}"]
    summary = summarize_text(text, r, path=str(path), oracle=oracle)
    del text
    bad = summary.bad_lines
    if not summary.records:
        return r, None, [f"rank {r}: {path.name} has no readable record" + (f" ({bad} bad lines)" if bad else "")]
    if summary.truncated:
        warnings.append(f"rank {r}: last line of {path.name} is truncated (the rank died mid-write?); skipped it")
        if bad > 1:
            warnings.append(f"rank {r}: {bad - 1} more unreadable line(s) in {path.name} skipped")
    elif bad:
        warnings.append(f"rank {r}: {bad} unreadable line(s) in {path.name} skipped")
    header_rank = (summary.header or {}).get("rank")
    if header_rank is not None and header_rank != r:
        warnings.append(f"rank {r}: {path.name} holds records of rank {header_rank}")
    return r, summary, warnings


def _load_one_unpacked(item: tuple[int, Path]) -> tuple[int, RankSummary | None, list[str]]:
    gc.disable()  # a worker only allocates records and frees them: the cycle collector is pure cost
    return _load_one(*item)


def default_jobs() -> int:
    """Worker processes ``replay_dir`` uses when asked for ``jobs=0`` (auto): the CPUs, at most 8."""
    return max(1, min(8, os.cpu_count() or 1))


def load_dir(logdir: str | os.PathLike, oracle: MachineOracle | None = None, jobs: int = 1) -> Loaded:
    """Read and summarise every rank file of ``logdir``.

    ``jobs > 1`` spreads the files over that many worker processes (``0``: one per CPU,
    at most 8); each process holds one file's records at a time either way.
    """
    logdir = Path(logdir)
    if not logdir.is_dir():
        raise NoTraces(f"{logdir} is not a directory")
    files = find_trace_files(logdir)
    if not files:
        raise NoTraces(f"no rank*.jsonl trace files in {logdir}")
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
            results = list(pool.map(_load_one_unpacked, files.items(), chunksize=max(1, len(files) // (4 * jobs))))
    else:
        enabled = gc.isenabled()
        gc.disable()
        try:
            results = [_load_one(r, path, oracle) for r, path in files.items()]
        finally:
            if enabled:
                gc.enable()
    summaries: dict[int, RankSummary] = {}
    warnings: list[str] = []
    for r, summary, notes in results:
        warnings += notes
        if summary is not None:
            summaries[r] = summary
    if not summaries:
        raise NoTraces(f"no readable records in the trace files of {logdir}")
    return Loaded(summaries, warnings, {r: str(p) for r, p in files.items()})


# ---------------------------------------------------------------------------------------
# stage 2: across ranks


@dataclass
class Finding:
    """One problem: what, where, who, and what every rank was doing there."""

    kind: str
    step: int | None
    culprits: list[int]
    summary: str
    state: str | None = None
    layer: Any = None
    collective: dict | None = None
    ranks: list[dict] = field(default_factory=list)   # per-rank position at this point
    details: list[str] = field(default_factory=list)

    def sort_key(self) -> tuple:
        tier = 0 if self.kind == "config_mismatch" else 2 if self.kind == "missing_ranks" else 1
        step = self.step if isinstance(self.step, (int, float)) else math.inf
        return (tier, step, _PRIORITY.get(self.kind, len(KINDS)), self.culprits[:1])

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Report:
    """The replay's answer: a verdict (``healthy`` or the first finding's kind) and the detail."""

    verdict: str
    summary: str
    culprit_ranks: list[int]
    step: int | None
    state: str | None
    layer: Any
    collective: dict | None
    at_divergence: list[dict]
    findings: list[Finding]
    illegal_transitions: list[dict]
    ranks: list[dict]
    warnings: list[str]
    world: int | None
    missing_ranks: list[int]
    more_findings: int = 0
    handled: list[Finding] = field(default_factory=list)

    @property
    def healthy(self) -> bool:
        return self.verdict == HEALTHY

    @property
    def exit_code(self) -> int:
        return 0 if self.healthy else 1

    def to_dict(self) -> dict:
        return {
            "verdict": self.verdict,
            "summary": self.summary,
            "culprit_ranks": self.culprit_ranks,
            "step": self.step,
            "state": self.state,
            "layer": self.layer,
            "collective": self.collective,
            "at_divergence": self.at_divergence,
            "findings": [f.to_dict() for f in self.findings],
            "more_findings": self.more_findings,
            "handled": [f.to_dict() for f in self.handled],
            "illegal_transitions": self.illegal_transitions,
            "ranks": self.ranks,
            "warnings": self.warnings,
            "world": self.world,
            "missing_ranks": self.missing_ranks,
        }


def ranks_text(ranks: Iterable[int]) -> str:
    """0,1,2,3,7 -> '0-3,7'."""
    ranks = sorted(set(ranks))
    if not ranks:
        return "-"
    parts = []
    start = prev = ranks[0]
    for r in ranks[1:] + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ",".join(parts)


def _who(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ranks_text(ranks)


def _coll_text(c: dict | Collective) -> str:
    d = c.describe() if isinstance(c, Collective) else c
    shape = f", shape {d['shape']}" if d.get("shape") is not None else ""
    layer = f", layer {c.layer}" if isinstance(c, Collective) and c.layer is not None else ""
    return f"{d['op']} (group {d['group']}, cseq {d['cseq']}{shape}{layer})"


def _last_seen(s: RankSummary) -> str:
    last = s.last or {}
    what = last.get("event", "?")
    if what == "transition":
        what = f"{last.get('trigger')} {last.get('source')}->{last.get('dest')}"
    elif str(what).startswith("collective"):
        what = f"{what} {last.get('op')} {last.get('group')}#{last.get('cseq')}"
    text = f"last record at step {last.get('step')} in {last.get('state')} ({what})"
    if s.stuck and not s.progress_after_stuck:
        st = s.stuck[-1]
        text += f"; watchdog: stuck {st.get('seconds')} s in {st.get('state')}"
    if s.truncated:
        text += "; last line truncated"
    return text


def _position(rank: int, status: str, note: str, step=None, state=None, layer=None) -> dict:
    return {"rank": rank, "status": status, "step": step, "state": state, "layer": layer, "note": note}


def _majority(groups: dict[Any, list[int]]) -> Any:
    """The key held by most ranks (ties: the one that includes the lowest rank)."""
    return max(groups, key=lambda k: (len(groups[k]), -min(groups[k])))


def _break_tie(summaries: dict[int, RankSummary], g: str, c: int, by_sig: dict[tuple, list[int]],
               default: tuple) -> tuple[tuple, str | None]:
    """Equal numbers of ranks issued different collectives at (g, c) (e.g. one rank against one).

    The expected one is the signature whose op the group also runs at its other sequence
    numbers; an op seen nowhere else in the group is the odd one. Returns (reference
    signature, a note for the finding), or (``default``, None) when that does not decide.
    """
    top = max(len(rs) for rs in by_sig.values())
    tied = [k for k, rs in by_sig.items() if len(rs) == top]
    seen: dict[Any, int] = {}
    for s in summaries.values():
        for cseq, e in s.collectives.get(g, {}).items():
            if cseq != c:
                seen[e.op] = seen.get(e.op, 0) + 1
    familiar = [k for k in tied if seen.get(k[0], 0) > 0]
    if len(familiar) != 1:
        return default, None
    ref = familiar[0]
    odd = sorted({k[0] for k in tied if k != ref})
    return ref, (f"as many ranks issued one collective as the other; {ref[0]} is what group {g} runs at its "
                 f"other sequence numbers, {', '.join(map(str, odd))} appears nowhere else in it")


def _canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _check_headers(summaries: dict[int, RankSummary], warnings: list[str]) -> list[Finding]:
    found: list[Finding] = []
    groups: dict[str, list[int]] = {}
    payload = {}
    for r, s in summaries.items():
        if s.header is None:
            warnings.append(f"rank {r}: no header record (the trace may have lost its beginning)")
            continue
        h = s.header
        obj = {"schema": h.get("schema"), "world": h.get("world"), "mode": h.get("mode"), "config": h.get("config")}
        payload[r] = obj
        groups.setdefault(_canon(obj), []).append(r)
    if len(groups) > 1:
        ref_key = _majority(groups)
        ref = json.loads(ref_key)
        culprits = sorted(r for k, rs in groups.items() if k != ref_key for r in rs)
        details = []
        for r in culprits:
            diffs = []
            mine = payload[r]
            for top in ("schema", "world", "mode"):
                if mine[top] != ref[top]:
                    diffs.append(f"{top}={mine[top]!r} (others {ref[top]!r})")
            a, b = mine.get("config") or {}, ref.get("config") or {}
            if isinstance(a, dict) and isinstance(b, dict):
                for k in sorted(set(a) | set(b)):
                    if _canon(a.get(k)) != _canon(b.get(k)):
                        diffs.append(f"{k}={a.get(k)!r} (others {b.get(k)!r})")
            details.append(f"rank {r}: " + ", ".join(diffs))
        step = min((summaries[r].header.get("step") or 0) for r in culprits)
        found.append(Finding(
            "config_mismatch", step, culprits,
            f"{_who(culprits)} started with a different configuration than ranks {ranks_text(groups[ref_key])}: "
            + details[0].split(": ", 1)[1],
            state=summaries[culprits[0]].header.get("state"),
            ranks=[_position(r, "different_config", details[culprits.index(r)].split(": ", 1)[1], step)
                   if r in culprits else _position(r, "reference", "the majority's configuration", step)
                   for r in sorted(payload)],
        ))
    versions: dict[str, list[int]] = {}
    for r, s in summaries.items():
        if s.header is not None:
            versions.setdefault(json.dumps(s.header.get("versions"), sort_keys=True), []).append(r)
    if len(versions) > 1:
        warnings.append("ranks run different package versions: " + "; ".join(
            f"{_who(rs)}: {json.loads(v)}" for v, rs in sorted(versions.items(), key=lambda kv: min(kv[1]))))
    return found


def _check_illegal(summaries: dict[int, RankSummary]) -> list[Finding]:
    found = []
    for r, s in summaries.items():
        if not s.illegal:
            continue
        first = s.illegal[0]
        more = f" ({len(s.illegal) - 1} more on this rank)" if len(s.illegal) > 1 else ""
        found.append(Finding(
            "illegal_transition", first["step"], [r],
            f"rank {r} recorded {first['trigger']} {first['source']}->{first['dest']} at step {first['step']}, "
            f"which the machine does not allow: {first['reason']}{more}",
            state=first["replayed_state"], layer=first["layer"],
            ranks=[_position(r, "illegal", first["reason"], first["step"], first["replayed_state"], first["layer"])],
        ))
    return found


def _align_transitions(summaries: dict[int, RankSummary]) -> list[Finding]:
    """The n-th state change must be the same event at the same step on every rank."""
    ranks = sorted(summaries)
    if len(ranks) < 2:
        return []
    longest = max(len(summaries[r].transitions) for r in ranks)
    # what must agree, per rank and ordinal; most ordinals agree everywhere and are skipped fast
    compare = [[(t.key(), t.step) for t in summaries[r].transitions] for r in ranks]
    for i in range(longest):
        if len({c[i] for c in compare if i < len(c)}) == 1:
            if sum(1 for c in compare if i < len(c)) < 2:
                return []
            continue
        at = {r: summaries[r].transitions[i] for r in ranks if i < len(summaries[r].transitions)}
        if len(at) < 2:
            return []
        by_key: dict[tuple, list[int]] = {}
        for r, t in at.items():
            by_key.setdefault(t.key(), []).append(r)
        ended = [r for r in ranks if r not in at]
        if len(by_key) > 1:
            ref_key = _majority(by_key)
            ref = at[by_key[ref_key][0]]
            culprits = sorted(r for k, rs in by_key.items() if k != ref_key for r in rs)
            positions = [_position(r, "same" if t.key() == ref_key else "different",
                                   f"{t.text()} at step {t.step}", t.step, t.source, t.layer_k) for r, t in at.items()]
            positions += [_position(r, "ended", f"trace ended before: {_last_seen(summaries[r])}",
                                    summaries[r].last_step) for r in ended]
            odd = at[culprits[0]]
            return [Finding(
                "decision_divergence", min(t.step for t in at.values() if t.step is not None), culprits,
                f"{_who(culprits)} took {odd.text()} at step {odd.step} where {_who(by_key[ref_key])} "
                f"took {ref.text()} (state change #{i})",
                state=ref.source, layer=ref.layer_k, ranks=sorted(positions, key=lambda p: p["rank"]),
            )]
        by_step: dict[Any, list[int]] = {}
        for r, t in at.items():
            by_step.setdefault(t.step, []).append(r)
        if len(by_step) > 1:
            ref_step = _majority(by_step)
            ref = at[by_step[ref_step][0]]
            culprits = sorted(r for k, rs in by_step.items() if k != ref_step for r in rs)
            positions = [_position(r, "same" if t.step == ref_step else "different_step",
                                   f"{t.text()} at step {t.step}", t.step, t.source, t.layer_k)
                         for r, t in at.items()]
            positions += [_position(r, "ended", f"trace ended before: {_last_seen(summaries[r])}",
                                    summaries[r].last_step) for r in ended]
            steps = sorted(s for s in by_step if s is not None)
            odd_steps = ", ".join(f"{_who(by_step[s])} at step {s}" for s in steps if s != ref_step)
            return [Finding(
                "step_divergence", steps[0] if steps else None, culprits,
                f"state change #{i} ({ref.text()}) happened at different steps: {_who(by_step[ref_step])} "
                f"at step {ref_step}, {odd_steps}: a skipped or extra step",
                state=ref.source, layer=ref.layer_k, ranks=sorted(positions, key=lambda p: p["rank"]),
            )]
    return []


def world_groups(summaries: dict[int, RankSummary]) -> set[str]:
    """Groups every rank of the world belongs to: ``world``, the groups the headers name
    (the controller's ``group`` and ``transfer_group``) and their re-creations
    (``ep_transfer.1``, named by ``transfer_group_reset`` records), and any group every
    trace uses."""
    wide = {WORLD_GROUP}
    named = set()
    for s in summaries.values():
        if s.header is not None:
            named |= {str(s.header[k]) for k in ("group", "transfer_group") if s.header.get(k) is not None}
        wide |= s.named_groups
    wide |= named
    used = [set(s.collectives) for s in summaries.values()]
    if used:
        wide |= set.intersection(*used)
        wide |= {g for u in used for g in u if g.split(".")[0] in named}
    return wide


def _handled_by_fault(f: Finding, summaries: dict[int, RankSummary]) -> bool:
    """A collective problem after which every rank aborted the rearrangement with ``fault``.

    That is the machine doing its job (design §8): the collective failed or timed out
    somewhere, every rank agreed and rolled back. The finding is kept as a note.
    """
    if f.kind not in ("collective_mismatch", "hang") or not isinstance(f.step, int):
        return False
    for s in summaries.values():
        ends = (t for t in s.transitions
                if isinstance(t.step, int) and t.step >= f.step and t.trigger in ("fault", "committed"))
        first = next(ends, None)
        if first is None or first.trigger != "fault":
            return False
        # a rollback that ends in `failed` did not handle it: the collective problem is the cause
        if any(t.dest == FAILED and t.step == first.step for t in s.transitions):
            return False
    return True


def _check_collectives(summaries: dict[int, RankSummary], world_ranks: list[int],
                       missing: set[int]) -> list[Finding]:
    """Line every group's collectives up by cseq; report the first problem of each group."""
    found: list[Finding] = []
    groups = sorted({g for s in summaries.values() for g in s.collectives})
    wide = world_groups(summaries)
    for g in groups:
        if g in wide:
            members = list(world_ranks)
        else:
            members = sorted(r for r, s in summaries.items() if g in s.collectives)
        top = max(summaries[r].max_cseq(g) for r in members if r in summaries)
        streams = [summaries[r].collectives.get(g, {}) if r in summaries else {} for r in members]
        for c in range(top + 1):
            # fast path: every member ended the same collective at this cseq
            first = streams[0].get(c)
            if first is not None and first.status != "open":
                sig = first.signature()
                if all((e := st.get(c)) is not None and e.status != "open" and e.signature() == sig
                       for st in streams):
                    continue
            finding = _check_one_collective(summaries, g, c, members, missing)
            if finding is not None:
                found.append(finding)
                break
    return found


def _check_one_collective(summaries: dict[int, RankSummary], g: str, c: int, members: list[int],
                          missing: set[int]) -> Finding | None:
    entries: dict[int, Collective] = {}
    absent: list[int] = []
    for r in members:
        s = summaries.get(r)
        e = s.collectives.get(g, {}).get(c) if s is not None else None
        if e is None:
            absent.append(r)
        else:
            entries[r] = e
    if not entries:
        return None
    by_sig: dict[tuple, list[int]] = {}
    for r, e in entries.items():
        by_sig.setdefault(e.signature(), []).append(r)
    ref_sig = _majority(by_sig)
    tie_note = None
    if len(by_sig) > 1 and sorted(map(len, by_sig.values()))[-2:] == [len(by_sig[ref_sig])] * 2:
        ref_sig, tie_note = _break_tie(summaries, g, c, by_sig, ref_sig)
    ref = entries[by_sig[ref_sig][0]]
    start_step = min((e.step for e in entries.values() if e.step is not None), default=None)
    open_ = sorted(r for r, e in entries.items() if e.status == "open")
    left = sorted(r for r, e in entries.items() if e.status != "open")
    # absent ranks: no file, trace ended before this collective, or went on without it
    no_file = [r for r in absent if r in missing]
    ended_before = [r for r in absent if r in summaries and _ended_before(summaries[r], start_step)]
    skipped = [r for r in absent if r in summaries and r not in ended_before]

    def positions() -> list[dict]:
        out = []
        for r in members:
            s = summaries.get(r)
            if s is None:
                out.append(_position(r, "no_trace", "no trace file"))
                continue
            e = entries.get(r)
            if e is None:
                if r in skipped:
                    out.append(_position(r, "skipped", f"never issued it but went on: {_last_seen(s)}",
                                         s.last_step, (s.last or {}).get("state")))
                else:
                    out.append(_position(r, "never_joined", f"never joined; {_last_seen(s)}",
                                         s.last_step, (s.last or {}).get("state")))
            elif e.signature() != ref_sig:
                out.append(_position(r, "different", f"issued {_coll_text(e)} at step {e.step} instead"
                                     + ("" if e.status != "open" else ", never finished"), e.step, e.state, e.layer))
            elif e.status == "open":
                out.append(_position(r, "inside", f"inside since step {e.step} ({e.state}), never finished; "
                                     + _last_seen(s), e.step, e.state, e.layer))
            elif e.status == "error":
                out.append(_position(r, "error", f"left it with an error: {e.error}", e.step, e.state, e.layer))
            else:
                later = s.last_step is not None and e.step is not None and (
                    s.last_step > e.step or s.max_cseq(g) > c)
                note = f"finished it, moved on: {_last_seen(s)}" if later else "finished it"
                out.append(_position(r, "past" if later else "finished", note, e.step, e.state, e.layer))
        return out

    where = dict(state=ref.state, layer=ref.layer, collective=ref.describe())
    if len(by_sig) > 1:
        culprits = sorted(r for k, rs in by_sig.items() if k != ref_sig for r in rs)
        odd = entries[culprits[0]]
        return Finding(
            "collective_mismatch", start_step, culprits,
            f"{_who(culprits)} issued {_coll_text(odd)} where {_who(by_sig[ref_sig])} issued "
            f"{_coll_text(ref)}, at step {start_step} in {ref.state}",
            ranks=positions(), details=[tie_note] if tie_note else [], **where,
        )
    waiting = open_
    if (ended_before or no_file or skipped) and waiting:
        culprits = sorted(ended_before + no_file + skipped)
        details = [f"rank {r}: no trace file" for r in no_file]
        return Finding(
            "hang", start_step, culprits,
            f"{_who(culprits)} never joined {_coll_text(ref)} at step {start_step} in {ref.state}; "
            f"{_who(waiting)} wait inside it" + (f", {_who(left)} left it" if left else ""),
            ranks=positions(), details=details, **where,
        )
    # with bounded waits a hang ends in collective_error: the ranks that gave up had waited for
    # ranks whose traces stop before they ever joined
    gave_up = sorted(r for r, e in entries.items() if e.status == "error")
    if (ended_before or no_file) and gave_up and not skipped:
        culprits = sorted(ended_before + no_file)
        return Finding(
            "hang", start_step, culprits,
            f"{_who(culprits)} never joined {_coll_text(ref)} at step {start_step} in {ref.state}; "
            f"{_who(gave_up)} gave up waiting inside it ({_short_error(entries[gave_up[0]].error)})"
            + (f", {_who([r for r in left if r not in gave_up])} finished it" if len(left) > len(gave_up) else ""),
            ranks=positions(), details=[f"rank {r}: no trace file" for r in no_file], **where,
        )
    if skipped:
        return Finding(
            "collective_mismatch", start_step, sorted(skipped),
            f"{_who(skipped)} never issued {_coll_text(ref)} (step {start_step}) but went on; "
            f"{_who(sorted(entries))} did",
            ranks=positions(), **where,
        )
    if open_ and left:
        return Finding(
            "hang", start_step, open_,
            f"{_who(open_)} started {_coll_text(ref)} at step {start_step} in {ref.state} and never finished; "
            f"{_who(left)} {'finished' if all(entries[r].status == 'ended' for r in left) else 'left'} it",
            ranks=positions(), **where,
        )
    if open_:
        return Finding(
            "hang", start_step, open_,
            f"every rank that joined {_coll_text(ref)} (step {start_step}, {ref.state}) is still inside it"
            + (f"; {_who(no_file)} have no trace" if no_file else ""),
            ranks=positions(), **where,
        )
    return None


def _short_error(text: Any) -> str:
    """An error message without a C++ source location, cut after its first sentence."""
    text = re.sub(r"\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", str(text or "")).strip()
    first = text.split(". ")[0]
    return first if len(first) <= 120 else first[:117] + "..."


def _ended_before(s: RankSummary, step: int | None) -> bool:
    """The rank's trace stops at or before ``step`` (with no records past it)."""
    return step is None or s.last_step is None or s.last_step <= step


def _check_ends(summaries: dict[int, RankSummary], folded: set[int]) -> list[Finding]:
    lasts = {r: s.last_step for r, s in summaries.items() if isinstance(s.last_step, int)}
    if len(lasts) < 2:
        return []
    top = max(lasts.values())
    found = []
    for r, last in sorted(lasts.items()):
        if top - last <= DIED_SLACK_STEPS or r in folded:
            continue
        s = summaries[r]
        others = {o: l for o, l in lasts.items() if o != r}
        positions = [_position(r, "stopped", _last_seen(s), last, s.final_state, s.final_layer)]
        for o, other_last in sorted(others.items()):
            went = other_last > last + DIED_SLACK_STEPS
            positions.append(_position(o, "went_on" if went else "stopped",
                                       f"{'went on to' if went else 'stopped at'} step {other_last} in "
                                       f"{summaries[o].final_state}", other_last, summaries[o].final_state))
        went_on = [o for o, l in others.items() if l > last + DIED_SLACK_STEPS]
        found.append(Finding(
            "rank_died", last, [r],
            f"rank {r}'s trace stops at step {last} in {s.final_state} while {_who(went_on)} went on "
            f"(to step {top})" + ("; its last line is truncated" if s.truncated else ""),
            state=s.final_state, layer=s.final_layer, ranks=positions,
        ))
    return found


def _check_failed(summaries: dict[int, RankSummary]) -> list[Finding]:
    failed = sorted(r for r, s in summaries.items() if s.final_state == FAILED)
    if not failed:
        return []
    steps = {}
    for r in failed:
        into = [t for t in summaries[r].transitions if t.dest == FAILED]
        steps[r] = into[-1].step if into else summaries[r].last_step
    first = min(failed, key=lambda r: (steps[r] is None, steps[r]))
    return [Finding(
        "failed", steps[first], failed,
        f"{_who(failed)} ended in the failed state (first at step {steps[first]}); the engine must recover them",
        state=FAILED, ranks=[_position(r, "failed", _last_seen(summaries[r]), steps[r], FAILED) for r in failed],
    )]


def _check_stuck(summaries: dict[int, RankSummary]) -> list[Finding]:
    stuck = sorted(r for r, s in summaries.items() if s.stuck and not s.progress_after_stuck)
    if not stuck:
        return []
    first = summaries[stuck[0]].stuck[-1]
    return [Finding(
        "stuck", first.get("step"), stuck,
        f"the watchdog of {_who(stuck)} reported no progress in {first.get('state')} "
        f"(layer {first.get('layer')}, {first.get('seconds')} s, last collective {first.get('last_collective')}) "
        "and nothing moved afterwards",
        state=first.get("state"), layer=first.get("layer"),
        collective=first.get("last_collective") if isinstance(first.get("last_collective"), dict) else None,
        ranks=[_position(r, "stuck", _last_seen(summaries[r]), summaries[r].last_step) for r in stuck],
    )]


def _as_summaries(traces: Any, oracle: MachineOracle) -> dict[int, RankSummary]:
    if isinstance(traces, Mapping):
        items = list(traces.items())
    else:
        items = [(None, t) for t in traces]
    out: dict[int, RankSummary] = {}
    for r, t in items:
        s = t if isinstance(t, RankSummary) else summarize_rank(t, r, oracle=oracle)
        out[s.rank if r is None else int(r)] = s
    return dict(sorted(out.items()))


def diagnose(
    traces: Mapping[int, Iterable[dict] | RankSummary] | Iterable[RankSummary],
    *,
    world: int | None = None,
    warnings: Iterable[str] = (),
    oracle: MachineOracle | None = None,
) -> Report:
    """The replay verdict over already-loaded traces (rank -> records, or summaries).

    ``world`` overrides the world size read from the records (ranks ``0..world-1`` are
    expected). The findings are sorted by step (configuration problems first, missing
    ranks last; at equal steps the more causal kind first) and the first is the verdict.
    """
    oracle = oracle or MachineOracle()
    summaries = _as_summaries(traces, oracle)
    warnings = list(warnings)
    for r in [r for r, s in summaries.items() if s.records == 0]:
        warnings.append(f"rank {r}: no records; treated as missing")
        del summaries[r]
    if not summaries:
        raise NoTraces("no rank has any record")
    for r, s in summaries.items():
        warnings.extend(f"rank {r}: {w}" for w in s.warnings)
        if s.truncated and not any(w.startswith(f"rank {r}: last line") for w in warnings):
            warnings.append(f"rank {r}: last line truncated; skipped it")
    worlds = {s.world for s in summaries.values() if isinstance(s.world, int)}
    if len(worlds) > 1:
        warnings.append(f"ranks disagree on the world size: {sorted(worlds)}")
    if world is None:
        world = max(worlds | {max(summaries) + 1})
    world_ranks = list(range(world))
    missing = sorted(set(world_ranks) - set(summaries))
    extra = sorted(set(summaries) - set(world_ranks))
    if extra:
        warnings.append(f"trace files for ranks outside the world of {world}: {ranks_text(extra)}")
        world_ranks = sorted(set(world_ranks) | set(extra))

    findings: list[Finding] = []
    findings += _check_headers(summaries, warnings)
    findings += _check_illegal(summaries)
    findings += _align_transitions(summaries)
    coll = _check_collectives(summaries, world_ranks, set(missing))
    handled = [f for f in coll if _handled_by_fault(f, summaries)]
    coll = [f for f in coll if f not in handled]
    findings += coll
    # a rank whose trace stops inside or before a hang is reported as that hang's culprit
    hang_culprits = {r for f in coll if f.kind == "hang" for r in f.culprits}
    findings += _check_ends(summaries, hang_culprits)
    findings += _check_failed(summaries)
    findings += _check_stuck(summaries)
    if missing:
        findings.append(Finding(
            "missing_ranks", None, missing,
            f"no trace for {_who(missing)} of a world of {world}: what they did is unknown",
            ranks=[_position(r, "no_trace", "no trace file") for r in missing],
        ))
    findings.sort(key=Finding.sort_key)
    more = max(0, len(findings) - MAX_FINDINGS)
    findings = findings[:MAX_FINDINGS]

    illegal = [i for s in summaries.values() for i in s.illegal]
    ranks = [s.to_dict() for s in summaries.values()]
    if findings:
        f = findings[0]
        return Report(f.kind, f.summary, f.culprits, f.step, f.state, f.layer, f.collective, f.ranks,
                      findings, illegal, ranks, warnings, world, missing, more, handled)
    n_records = sum(s.records for s in summaries.values())
    steps = [s.last_step for s in summaries.values() if isinstance(s.last_step, int)]
    rearr = max((s.rearrangements() for s in summaries.values()), default=0)
    summary = (f"{len(summaries)} of {world} ranks agree: {n_records} records, steps up to "
               f"{max(steps) if steps else '-'}, {rearr} rearrangements, 0 illegal transitions, no divergence")
    if handled:
        summary += f" ({len(handled)} collective failure(s) handled by a fault on every rank)"
    return Report(HEALTHY, summary, [], None, None, None, None, [], [], illegal, ranks, warnings, world, missing,
                  0, handled)


def replay_dir(logdir: str | os.PathLike, world: int | None = None, jobs: int = 1) -> Report:
    """Read every rank's trace in ``logdir`` and diagnose; raises NoTraces on unusable input.

    ``jobs``: worker processes for reading (1: in this process; 0: one per CPU).
    """
    oracle = MachineOracle()
    loaded = load_dir(logdir, oracle, jobs=jobs)
    return diagnose(loaded.summaries, world=world, warnings=loaded.warnings, oracle=oracle)
