"""Stage 2 of the replay: the rank that came late to a collective that then failed on every rank.

A rank that stalls in its own code past ``collective_timeout_s`` (a slow engine step, a
long pause while its liveness thread still writes) leaves no hang and no dead rank: the ranks
that waited for it give up (``collective_error``, a timeout), the late one starts the
collective after they left and fails at once, and every rank ends it in error. Nothing
in the collectives disagrees, so the records that show who was late are:

- the start ``ts`` of that collective: a member that started it more than
  ``CLOCK_NOISE_S`` after the first one did (clocks agree to well under that, see
  docs/debugging-hangs.md) came late;
- the ``alive`` records: a member whose alive records put it at a lower step than a peer's
  that waited in that collective at the same time (within one interval) was behind.

Such a member is reported as ``lagging`` (:func:`late_findings`). :func:`add_late` makes
it the cause when the ranks did not come back (they end ``failed``) and the liveness
records name no other cause, and a handled note when every member rolled back and went on
(``recover()``), so that the aborted rearrangement names it. Waits that timed out are
consequences, never culprits.

The late rank of every rolled-back rearrangement (:func:`aborted_rearrangements`) and a job
stopped from outside while a hang lasted (:func:`signalled_in_hang`) are told here too.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from eplb_fsm.fsm.machine import COLLECTING, FAILED, SCALING
from eplb_fsm.inspect.elastic import Cast, Key
from eplb_fsm.inspect.endings import failed_waits
from eplb_fsm.inspect.findings import Finding, coll_text, short_error
from eplb_fsm.inspect.liveness import DEFAULT_INTERVAL_S, MIN_GAP_S, Liveness
from eplb_fsm.inspect.model import Collective
from eplb_fsm.inspect.signal_death import waiters

__all__ = ["CLOCK_NOISE_S", "aborted_rearrangements", "add_late", "late_findings", "signalled_in_hang"]

CLOCK_NOISE_S = MIN_GAP_S   # start ts further apart than this is lateness, not two clocks disagreeing
# findings that already explain a failed collective at or before their step: no late rank is sought after them
_EXPLAINED_BY = ("illegal_transition", "decision_divergence", "step_divergence", "collective_mismatch", "hang",
                 "lost_records")


def _on(waiting: object, g: str, c: int) -> bool:
    return isinstance(waiting, dict) and waiting.get("group") == g and waiting.get("cseq") == c


def _behind(cast: Cast, g: str, c: int, entries: dict[Key, Collective]) -> dict[Key, tuple[int, Key, int]]:
    """Members alive at a lower step while a peer waited in ``(g, c)``: key -> (its step, the waiter, their step).

    Only a member that started the collective after that waiter counts (it was behind, not ahead), and only its
    alive records from the waiter's start to its own (one from before the waiter started says nothing)."""
    out: dict[Key, tuple[int, Key, int]] = {}
    for w in sorted(entries):
        waits = [(ts, step) for ts, step, _, on, *_ in cast.parts[w].alive
                 if _on(on, g, c) and type(ts) in (int, float) and type(step) is int]
        if not waits:
            continue
        lo, hi, top = waits[0][0], waits[-1][0], max(step for _, step in waits)
        for m in sorted(entries):
            if m == w or m in out or not _later(entries[m], entries[w]):
                continue
            span = cast.parts[m].alive_interval or DEFAULT_INTERVAL_S
            since, until = max(lo - span, entries[w].ts), min(hi + span, entries[m].ts)
            seen = [step for ts, step, _, on, *_ in cast.parts[m].alive
                    if type(ts) in (int, float) and since <= ts < until and type(step) is int
                    and step < top and not _on(on, g, c)]
            if seen:
                out[m] = (min(seen), w, top)
    return out


def _later(a: Collective, b: Collective) -> bool:
    return type(a.ts) in (int, float) and type(b.ts) in (int, float) and a.ts > b.ts


def _late_at(cast: Cast, g: str, c: int, entries: dict[Key, Collective]) -> Finding | None:
    starts = {k: e.ts for k, e in entries.items() if type(e.ts) in (int, float)}
    first = min(starts, key=lambda k: (starts[k], k)) if starts else None
    by_ts = {k: ts - starts[first] for k, ts in starts.items() if ts - starts[first] > CLOCK_NOISE_S}
    behind = _behind(cast, g, c, entries)
    late = sorted(set(by_ts) | set(behind))
    if not late or len(late) == len(entries):
        return None
    waited = sorted(k for k in entries if k not in late)
    ref = entries[first if first is not None else waited[0]]
    evidence = []
    for k in late:
        said = []
        if k in by_ts:
            said.append(f"started it {by_ts[k]:.1f} s after {cast.label(first)}")
        if k in behind:
            step, w, top = behind[k]
            said.append(f"its alive records show it at step {step} while {cast.label(w)} waited in it at step {top}")
        evidence.append(f"{cast.label(k)} " + " and ".join(said))
    gave_up = [k for k in waited if entries[k].status == "error"]
    summary = (f"{cast.who(late)} came late to {coll_text(ref)} at step {ref.step}: " + "; ".join(evidence)
               + (f"; {cast.who(gave_up)} gave up waiting ({short_error(entries[gave_up[0]].error)})" if gave_up
                  else "; the collective failed"))
    return Finding.of(
        "lagging", ref.step if type(ref.step) is int else None, late, summary, state=ref.state, layer=ref.layer,
        collective=ref.describe(), members=sorted(entries),
        ranks=[cast.position(k, "late" if k in late else "waited", _note(k, entries[k], by_ts, behind),
                             entries[k].step, entries[k].state, entries[k].layer) for k in sorted(entries)],
    )


def _note(k: Key, e: Collective, by_ts: dict, behind: dict) -> str:
    if k in by_ts:
        return f"started it {by_ts[k]:.1f} s after the first rank"
    if k in behind:
        return f"alive at step {behind[k][0]} while a peer waited in it"
    return f"waited in it, then it failed: {short_error(e.error)}" if e.status == "error" else "finished it"


def late_findings(cast: Cast, known: Iterable[Finding] = ()) -> list[Finding]:
    """A ``lagging`` finding per collective every member started and none left open, that failed on some
    member, and that a member came late to (see the module docstring); earliest step first.

    ``known``: findings already about a collective (a hang, a mismatch): those collectives are left to them.
    """
    named = {(f.collective.get("group"), f.collective.get("cseq")) for f in known if f.collective}
    out: list[Finding] = []
    erred = {k for k, part in cast.parts.items() if part.events.get("collective_error")}
    if not erred:   # every way a collective is read counts its records: nothing failed, nothing to scan
        return out
    for g in sorted({g for s in cast.parts.values() for g in s.collectives if isinstance(g, str)}):
        members = [k for k in cast.members(g) if k in cast.parts]
        if len(members) < 2:
            continue
        failed = set()
        for k in members:
            if k not in erred:
                continue
            index = cast.parts[k].collectives.get(g, {})
            failed.update(c for c, e in getattr(index, "one", index).items() if e.status == "error")
        for c in sorted(x for x in failed if (g, x) not in named):
            entries = {k: cast.parts[k].collectives.get(g, {}).get(c) for k in members}
            if any(e is None or e.status == "open" for e in entries.values()):
                continue
            f = _late_at(cast, g, c, entries)
            if f is not None:
                out.append(f)
    out.sort(key=lambda f: (f.step if type(f.step) is int else 1 << 62, f.culprits))
    return out


def _came_back(cast: Cast, f: Finding) -> bool:
    """Every member rolled the rearrangement back (``fault``) at or after the step and went on: a fault
    into ``collecting``, or one into ``failed`` that a later transition (``recover()``) left; not one whose
    process then ended with an exception at the fault's step (its engine stopped on the fault, as simulate's
    does: nothing was served after it)."""
    since = f.step if type(f.step) is int else -1
    for k in f.members:
        s = cast.parts[k]
        after = [t for t in s.transitions if type(t.step) is int and t.step >= since]
        fault = next((i for i, t in enumerate(after) if t.trigger == "fault"), None)
        if fault is None:
            return False
        if after[fault].dest == FAILED and not any(t.source == FAILED for t in after[fault + 1:]):
            return False
        end = s.end or {}
        if end.get("how") == "exception" and type(end.get("step")) is int and end["step"] <= after[fault].step:
            return False
    return True


def add_late(cast: Cast, live: Liveness, findings: list[Finding], handled: list[Finding]) -> None:
    """Late ranks into the diagnosis: a cause (``live.findings``, the waiters' failures as consequences) when
    the ranks did not come back and nothing else explains it, else a ``handled`` note when they did.

    A late rank the liveness records already name (it froze, it died) is left to that finding.
    """
    named = {k for f in live.findings for k in f.keys()}
    for f in late_findings(cast, [*findings, *handled]):
        if set(f.keys()) & named:
            continue
        if _came_back(cast, f):
            handled.append(f)
        elif not live.findings and not any(x.kind in _EXPLAINED_BY and type(x.step) is int
                                           and (f.step is None or x.step <= f.step) for x in findings):
            live.findings.append(f)
            coll = f.collective or {}
            for k in f.members:
                e = cast.parts[k].collectives.get(coll.get("group"), {}).get(coll.get("cseq"))
                if k in f.keys() or k in live.consequence_keys or e is None or e.status != "error":
                    continue
                live.consequences.append((k, f"{cast.label(k)} gave up waiting in {coll_text(coll)} at step "
                                             f"{e.step}, {cast.who(f.keys())} not there yet: {short_error(e.error)}"))
                live.consequence_keys.add(k)


def aborted_rearrangements(cast: Cast, handled: list[Finding], causes: list[Finding],
                           hangs: Sequence[Finding] = ()) -> list[dict]:
    """Every rearrangement the ranks rolled back (a ``fault`` out of planning, transferring or committing: one out
    of collecting rolled nothing back), with the rank that was late.

    The late rank is the member of the collective problem the rollback handled that never
    joined it, or else the one that started it last, if over ``CLOCK_NOISE_S`` after the first (late by the
    spread of the start ``ts``; a few ms is every collective's); a freeze, death or signal the liveness records
    found at or before that step is named too. The problem is the
    latest since the previous rollback: a handled one (a late rank's note, ``late``), else an unhandled
    ``hang`` (its culprit died or hangs) or a cause about a collective (a late rank in a run left
    ``failed``). A fault in ``scaling``, or one naming a ``scale`` (the scale's own transfer failed), is a
    scale abort, listed with the scales, not here.
    """
    parts = cast.parts
    by_step: dict[int, list[Key]] = {}
    for k, s in parts.items():
        of_scales = {f.get("seq") for f in s.faults if f.get("scale") is not None}
        for t in s.transitions:
            if t.trigger == "fault" and t.source not in (SCALING, COLLECTING) and t.seq not in of_scales \
                    and type(t.step) is int \
                    and k not in by_step.get(t.step, []):
                by_step.setdefault(t.step, []).append(k)
    out, before = [], None   # before: the previous rollback's step (a hang at or before it is that one's)
    for step, keys in sorted(by_step.items()):
        previous = before   # the rollback before this one: a wait failed since then belongs to this one
        entry: dict = {"step": step, "ranks": sorted({k[0] for k in keys}), "late_ranks": [], "late_by_s": None,
                       "collective": None, "text": ""}
        since = [h for h in [*handled, *hangs, *causes] if h.collective and type(h.step) is int and h.step <= step
                 and (before is None or h.step > before)]
        f = max(since, key=lambda h: h.step, default=None)   # a handled one first at equal steps
        before, late_text = step, "no rank was late by the records"
        if f is not None and f.collective:
            g, c = f.collective.get("group"), f.collective.get("cseq")
            entry["collective"] = f.collective
            members = f.members or sorted(parts)
            starts = {k: e.ts for k in members if k in parts
                      and (e := parts[k].collectives.get(g, {}).get(c)) is not None and type(e.ts) in (int, float)}
            absent = [k for k in members if k in parts and parts[k].collectives.get(g, {}).get(c) is None]
            where = coll_text(f.collective)
            if absent:
                entry["late_ranks"] = sorted({k[0] for k in absent})
                late_text = f"{cast.who(absent)} never joined {where}"
            elif len(starts) > 1:   # a lagging finding weighed the alive records too: its culprits are the late ones
                lagging = [k for k in f.keys() if k in starts] if f.kind == "lagging" else []
                late = max(lagging or starts, key=starts.get)
                # a start a few ms after the others' is every collective's, not lateness (clocks, the scheduler)
                if lagging or starts[late] - min(starts.values()) > CLOCK_NOISE_S:
                    entry["late_ranks"] = sorted({k[0] for k in lagging}) or [late[0]]
                    entry["late_by_s"] = round(starts[late] - min(starts.values()), 3)
                    late_text = f"{cast.label(late)} started {where} {entry['late_by_s']:.1f} s after the first rank"
        # a rank that froze, died or was signalled at or before that step is why the others gave up
        gone = [x for x in causes if x.kind in ("frozen", "rank_died", "signalled") and type(x.step) is int
                and x.step <= step]
        if gone:
            said = gone[-1].summary.split(":")[0].split(" (first at")[0]   # a signal: who, and by which
            late_text = ("" if late_text.startswith("no rank") else late_text + "; ") + said
            entry["late_ranks"] = sorted(set(entry["late_ranks"]) | set(gone[-1].culprits))
        after = -1 if previous is None else previous
        if late_text.startswith("no rank") and (failed := failed_waits(cast, keys, step, after)):
            late_text += "; " + failed
        entry["text"] = f"step {step}: {cast.who(keys)} aborted the rearrangement; {late_text}"
        out.append(entry)
    return out


def signalled_in_hang(cause: Finding, rest: list[Finding], cast: Cast, live: Liveness) -> bool:
    """A job stopped from outside (SIGTERM, Ctrl-C, a launcher's deadline) while a hang lasted: the hang is the cause.

    An operator usually ends a hung job before its collective timeout fires, so every rank's
    trace ends with ``signal`` and nothing failed before it. When a rank was waiting inside the
    collective of a ``hang`` (or ``collective_mismatch``) whose culprits were not inside it as the
    signals came (``signal_death.waiters``: still inside at its signal ``end``, or its wait failed
    once the first stopped rank's exit closed the connection), the signal only ended what the hang
    had already stopped. Then the signal goes into that finding's details and the waiters'
    consequences, the finding takes the signal's place at the head of ``rest``, and True says
    ``cause`` was folded. A job stopped while every rank was inside the same collective stays
    ``signalled``, and so does one whose waiters had been inside it for less than one liveness
    interval: replay drops such a hang before this runs (``signal_death.in_flight``: a collective in
    flight).
    """
    if cause.kind != "signalled":
        return False
    for f in rest:
        if f.kind not in ("hang", "collective_mismatch") or not f.collective:
            continue
        coll = (f.collective.get("group"), f.collective.get("cseq"))
        inside = sorted(waiters(cast, cause, coll))
        if not inside or set(inside) & set(f.keys()):
            continue
        f.details.insert(0, cause.summary.split(" while no rank had failed")[0] + ", while this hang lasted: "
                         "stopped from outside, not its cause")
        where = f"{f.collective.get('op')} (group {coll[0]}, cseq {coll[1]})"
        for k in inside:
            if k in live.consequence_keys:   # it gave up waiting: its own line says so
                continue
            end = cast.parts[k].end or {}
            ts = end.get("ts")
            when = f" at t+{ts - live.t0:.1f} s" if type(ts) in (int, float) and live.t0 is not None else ""
            how = (f"while waiting inside {where}" if any((c.group, c.cseq) == coll
                                                          for c in cast.parts[k].open_collectives())
                   else f"after its wait inside {where} failed as the first rank was stopped")
            live.consequences.append((k, f"{cast.label(k)} was stopped by {end.get('signal') or 'a signal'}{when} "
                                         f"{how}, which the hang's culprit never joined"))
            live.consequence_keys.add(k)
        rest.remove(f)
        rest.insert(0, f)   # the hang takes the signal's place as the cause
        return True
    return False
