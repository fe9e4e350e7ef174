"""Plain-text forms of a replay: the report (verdict line first) and a per-rank timeline."""

from __future__ import annotations

from typing import Iterable

from eplb_fsm.inspect.elastic import scale_text
from eplb_fsm.inspect.replay import Finding, Report, ranks_text


def _grouped(positions: list[dict]) -> list[tuple[str, str]]:
    """Ranks with the same note share a line (64 ranks waiting in one collective are one line).

    A participant an elastic job needs more than a rank number for (``label``: a joiner, a
    rank that left) is named by its label."""
    groups: dict[str, list[dict]] = {}
    for p in positions:
        groups.setdefault(p["note"] or p["status"], []).append(p)
    rows = []
    for note, ps in groups.items():
        plain = sorted({p["rank"] for p in ps if not p.get("label")})
        named = sorted({(p["rank"], p.get("session", 0), p["label"]) for p in ps if p.get("label")})
        who = ", ".join(([ranks_text(plain)] if plain else []) + [n[2].removeprefix("rank ") for n in named])
        first = min([(r, 0) for r in plain] + [n[:2] for n in named])
        rows.append((first, who, note))
    return [(who, note) for _, who, note in sorted(rows)]


def _where(f: Finding | Report) -> str:
    parts = [f"step {f.step if f.step is not None else '-'}",
             f"state {f.state or '-'}",
             f"layer {f.layer if f.layer is not None else '-'}"]
    return ", ".join(parts)


def format_report(report: Report, max_rank_lines: int = 40) -> str:
    """The verdict on the first line, then where, who, what every rank was doing, the rest."""
    culprits = report.culprit_ranks
    lines = [f"{report.verdict}: {report.summary}"]
    if not report.healthy:
        lines.append(f"  where:      {_where(report)}; culprit {'rank' if len(culprits) == 1 else 'ranks'} "
                     f"{ranks_text(culprits)}")
        if report.collective:
            c = report.collective
            lines.append(f"  collective: {c.get('op')} group={c.get('group')} cseq={c.get('cseq')} "
                         f"shape={c.get('shape')} dtype={c.get('dtype')}")
        if report.at_divergence:
            lines.append("  ranks at this point:")
            rows = _grouped(report.at_divergence)
            for who, note in rows[:max_rank_lines]:
                lines.append(f"    {who:<12} {note}")
            if len(rows) > max_rank_lines:
                lines.append(f"    ... {len(rows) - max_rank_lines} more")
        first = report.findings[0] if report.findings else None
        for d in (first.details if first else []):
            lines.append(f"  - {d}")
        if report.consequences:
            lines.append(f"  consequences (not culprits) ({len(report.consequences)}):")
            lines += [f"    {c}" for c in report.consequences[:max_rank_lines]]
        rest = report.findings[1:]
        if rest:
            lines.append(f"  later findings ({len(rest) + report.more_findings}):")
            for f in rest:
                lines.append(f"    {f.kind} at {_where(f)}: {f.summary}")
            if report.more_findings:
                lines.append(f"    ... {report.more_findings} more")
    if report.handled:
        lines.append(f"  handled (every rank aborted that rearrangement with a fault) ({len(report.handled)}):")
        for f in report.handled:
            lines.append(f"    {f.kind} at {_where(f)}: {f.summary}")
    if report.aborted:
        lines.append(f"  aborted rearrangements ({len(report.aborted)}):")
        lines += [f"    {a['text']}" for a in report.aborted[:max_rank_lines]]
    if report.injected:
        lines.append("  injected (simulator; not used for the verdict): " + "; ".join(
            f"{i.get('kind')} on rank {i.get('target_rank', i.get('rank'))} at step {i.get('at_step')}"
            for i in report.injected))
    if report.scales:
        lines.append(f"  scales ({len(report.scales)}):")
        lines += [f"    {scale_text(n)}" for n in report.scales]
    if report.illegal_transitions:
        lines.append(f"  illegal transitions ({len(report.illegal_transitions)}):")
        for i in report.illegal_transitions[:20]:
            session = f" (session {i['session']})" if i.get("session") else ""
            lines.append(f"    rank {i['rank']}{session} seq {i['seq']} step {i['step']}: {i['trigger']} "
                         f"{i['source']}->{i['dest']}: {i['reason']}")
        if len(report.illegal_transitions) > 20:
            lines.append(f"    ... {len(report.illegal_transitions) - 20} more")
    else:
        lines.append("  illegal transitions: none")
    if report.warnings:
        lines.append(f"  warnings ({len(report.warnings)}):")
        lines += [f"    {w}" for w in report.warnings]
    ranks = report.ranks
    n_records = sum(r["records"] for r in ranks)
    lasts = [r["last_step"] for r in ranks if isinstance(r["last_step"], int)]
    files = len({r["rank"] for r in ranks})
    # an elastic job's files are counted against the largest world it switched to, not its first one
    worlds = [report.world] + [n.get("to_ranks") for n in report.scales if n.get("outcome") == "switched"]
    lines.append(
        f"  traces: {files} of world {max((w for w in worlds if type(w) is int), default=report.world)}"
        + (f" ({len(ranks)} sessions)" if len(ranks) != files else "")
        + (f" (missing {ranks_text(report.missing_ranks)})" if report.missing_ranks else "")
        + f", {n_records} records, last steps {min(lasts) if lasts else '-'}..{max(lasts) if lasts else '-'}"
    )
    unended = report.unended_ranks
    if report.healthy and unended:
        # the ranks agree up to where their traces stop, which says nothing of why they stop
        torn = all(r.get("truncated") for r in ranks if not r.get("end"))
        lines.append(f"  no end record on {'rank' if len(unended) == 1 else 'ranks'} {ranks_text(unended)}: "
                     + ("each trace ends in a half-written line: the writers stopped (a full disk? a file-size "
                        "limit?) or the job was killed as a whole" if torn else "still running when read, or "
                        "stopped together (killed; frozen with no rank left to compare; or stopped by a "
                        "launcher's SIGTERM that no rank traced: eplb_fsm.stop_signals.end_traces_on_signal)"))
    return "\n".join(lines)


def timeline_rows(records: Iterable[dict]) -> list[dict]:
    """One compact row per record: seq, t (s since the first record), step, state, what, layer, collective, dur."""
    rows = []
    t0 = None
    for rec in records:
        ts = rec.get("ts")
        if isinstance(ts, (int, float)):
            t0 = ts if t0 is None else t0
        ev = rec.get("event")
        what = ev
        coll = None
        layer = rec.get("layer")
        if ev == "transition":
            if "transferring" not in (rec.get("source"), rec.get("dest")):
                layer = None  # the machine's layer counter only means something around transferring
            what = f"{rec.get('trigger')}: {rec.get('source')}->{rec.get('dest')}"
            extras = [f"{k}={rec[k]}" for k in ("due", "moves", "worth", "recoverable") if k in rec]
            if extras:
                what += " (" + " ".join(extras) + ")"
        elif isinstance(ev, str) and ev.startswith("collective_"):
            what = ev
            coll = f"{rec.get('op')} {rec.get('group')}#{rec.get('cseq')}"
            if ev == "collective_start" and rec.get("shape") is not None:
                coll += f" {rec.get('shape')}"
            if ev == "collective_error":
                coll += f" {rec.get('error')}"
        elif ev == "stuck":
            what = f"stuck {rec.get('seconds')}s (last {rec.get('last_collective')})"
        elif ev == "group_switch":
            what = (f"group_switch {rec.get('old_group')}->{rec.get('new_group')} ({rec.get('role')}, "
                    f"rank {rec.get('old_rank')}->{rec.get('new_rank')}, world {rec.get('new_world')})")
        elif ev == "steps" and type(rec.get("step")) is int and type(rec.get("count")) is int:
            what = f"steps {rec['step']}..{rec['step'] + rec['count'] - 1} ({rec['count']}, {rec.get('dummy')} dummy)"
        elif ev == "header" and rec.get("continued") is True:
            what = f"header (continued: segment {rec.get('segment')} of a rotated file)"
        elif ev == "header" and rec.get("role") == "joiner":
            what = f"header (joiner of generation {rec.get('generation')}, a new session)"
        rows.append({
            "seq": rec.get("seq"),
            "t": round(ts - t0, 6) if isinstance(ts, (int, float)) and t0 is not None else None,
            "step": rec.get("step"),
            "state": rec.get("state"),
            "what": what,
            "layer": layer,
            "collective": coll,
            "duration_s": rec.get("duration_s"),
        })
    return rows


def format_timeline(records: Iterable[dict], rank: int | None = None) -> str:
    """The per-rank timeline as aligned text, one line per record."""
    rows = timeline_rows(records)
    head = f"{'seq':>7} {'t(s)':>10} {'step':>7}  {'state':<13} {'event':<52} {'layer':>5}  {'collective':<32} dur(s)"
    lines = [f"rank {rank}: {len(rows)} records" if rank is not None else f"{len(rows)} records", head]
    for r in rows:
        t = f"{r['t']:.4f}" if r["t"] is not None else "-"
        layer = "-" if r["layer"] is None else str(r["layer"])
        d = r["duration_s"]
        # a field of the wrong type (a damaged or hand-edited line) is shown as it is, never a crash
        dur = f"{d:.6f}" if type(d) in (int, float) else "" if d is None else repr(d)
        lines.append(f"{str(r['seq']):>7} {t:>10} {str(r['step']):>7}  {str(r['state']):<13} {str(r['what']):<52} "
                     f"{layer:>5}  {r['collective'] or '':<32} {dur}".rstrip())
    return "\n".join(lines)
