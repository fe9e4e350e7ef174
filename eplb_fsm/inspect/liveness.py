"""Stage 2 of the replay, liveness: which rank died, froze, crashed or lagged, and who only waited.

A rank's trace ends with an ``end`` record when the rank stopped in order (``how``: closed,
exception with its message, signal with its name); a background thread writes an ``alive``
record about once per ``interval_s`` with the rank's step, state and the collective it waits
in (docs/events.md). From those, per participant (``elastic.Cast``):

- **died**: no ``end``, and its last record is older than the others' last records by more
  than ``DEAD_FACTOR`` intervals: the process was killed (SIGKILL, a crash of the
  interpreter) or froze for good.
- **frozen**: a silence (no record of any kind) of more than ``FROZEN_FACTOR`` intervals
  while another rank wrote alive records inside it (SIGSTOP, then SIGCONT): a waiting rank writes
  one every interval, the first within 1.5 intervals of its wait's start (eplb_fsm.liveness).
- **crashed**: ``end`` with ``how: exception`` whose error is not a wait that timed out.
- **signalled**: ``end`` with ``how: signal`` before any of the above happened elsewhere.
- **lagging**: alive to the end with a step that no longer advances, at a lower step than
  the other stalled ranks (they wait for it in the engine's own collective).

The earliest of these events (by ``ts``) is the cause. Everything that happened after it to
the other ranks (an exception from a wait that timed out, a SIGTERM from the launcher, alive
records whose step stopped advancing) is a consequence and never a culprit. Traces without
``end`` or ``alive`` records (older writers) give no liveness finding; the step-based checks
(``checks.check_ends``) still apply to them.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from eplb_fsm.fsm.machine import SCALING
from eplb_fsm.inspect.elastic import Cast, Key
from eplb_fsm.inspect.findings import Finding, coll_text, last_seen, short_error
from eplb_fsm.inspect.stepseq import own_steps_broken, step_break_text

DEFAULT_INTERVAL_S = 1.0   # the writer's default rate of alive records
DEAD_FACTOR = 5            # silent for this many intervals before the others' last record: gone
FROZEN_FACTOR = 2.5        # a gap of this many intervals between alive records: frozen
MIN_GAP_S = 2.0            # never less than this (a loaded machine delays a thread by a second or so)
# an exception that ends a wait (a collective or the engine's own) is how a rank notices another's death
_WAIT_ERROR = re.compile(r"GroupBroken|timed? ?out|timeout|connection ?(reset|closed|refused)|closed by peer|"
                         r"read error|gloo|NCCL|broken pipe|TransferError", re.I)
PRIMARY = ("rank_died", "frozen", "crashed", "signalled", "lagging")


@dataclass
class Liveness:
    """What the liveness records say: the cause findings (earliest first) and the consequences."""

    aware: bool                                   # any participant wrote end or alive records
    findings: list[Finding] = field(default_factory=list)
    consequences: list[tuple] = field(default_factory=list)   # (participant, what happened to it)
    consequence_keys: set = field(default_factory=set)   # participants that only reacted
    endings: dict = field(default_factory=dict)   # key -> one line on how it ended
    t0: float | None = None


def _interval(s) -> float:
    return s.alive_interval or DEFAULT_INTERVAL_S


def _limit(s, factor: int) -> float:
    return max(factor * _interval(s), MIN_GAP_S)


def _waiting_text(s) -> str:
    """What the participant was waiting on at its last alive record (or its open collective)."""
    waiting = s.alive[-1][3] if s.alive else None
    if waiting:
        return f"waiting in {waiting.get('op')} (group {waiting.get('group')}, cseq {waiting.get('cseq')})"
    opened = s.open_collectives()
    if opened:
        return f"inside {coll_text(opened[-1])}"
    return "in no controller collective (so in the engine's step or its own work)"


def _ending(s) -> str:
    end = s.end
    if end is None:
        return "no end record"
    how = end.get("how")
    if how == "exception":
        return f"ended with an exception: {end.get('error')}"
    if how == "signal":
        return f"stopped by {end.get('signal') or 'a signal'}"
    return f"ended: {how}"


def _end_ts(s) -> float:
    ts = (s.end or {}).get("ts")
    return ts if type(ts) in (int, float) else (s.last_ts if s.last_ts is not None else float("inf"))


def _gaps(cast: Cast, key: Key) -> list[tuple[float, float, int | None, str | None]]:
    """(from ts, to ts, step, state) for each freeze of ``key``: a silence (no record of any kind)
    longer than the limit while another rank wrote alive records inside it."""
    s = cast.parts[key]
    if not s.alive and s.end is None:
        return []  # a writer without liveness records is silent whenever nothing happens
    limit = _limit(s, FROZEN_FACTOR)
    others = [sorted(a[0] for a in o.alive if type(a[0]) in (int, float))
              for k, o in cast.parts.items() if k != key]
    out = []
    for a, b, step, state in s.silences:
        if b - a <= limit:
            continue
        # somebody else kept writing inside the gap: this rank, not the machine, stood still
        if any(bisect.bisect_right(ts, a) < bisect.bisect_left(ts, b) for ts in others):
            out.append((a, b, step, state))
    return out


def _waits_on_peer(cast: Cast, key: Key) -> bool:
    """Whether the participant sat in a collective some other member had not finished (its error ended a wait).

    A collective every other member finished is no wait: an async rank's posted all-reduce stays
    open from one step to the next, so a rank that raises in its own code in between (a crash)
    leaves one open that its peers had long read.
    """
    s = cast.parts[key]
    opened = [(c.group, c.cseq) for c in s.open_collectives()]
    waiting = s.alive[-1][3] if s.alive else None
    if waiting:
        opened.append((waiting.get("group"), waiting.get("cseq")))
    for g, c in opened:
        for m in cast.members(g) if isinstance(g, str) else []:
            peer = cast.parts.get(m)
            entry = peer.collectives.get(g, {}).get(c) if peer is not None else None
            if m != key and (entry is None or entry.status != "ended"):
                return True
    return False


def check_liveness(cast: Cast) -> Liveness:
    """Cause findings from ``end`` and ``alive`` records, earliest first; see the module docstring."""
    parts = cast.parts
    aware = any(s.end is not None or s.alive for s in parts.values())
    out = Liveness(aware)
    if not aware:
        return out
    starts = [s.header.get("ts") for s in parts.values() if s.header and type(s.header.get("ts")) in (int, float)]
    lasts = {k: s.last_ts for k, s in parts.items() if s.last_ts is not None}
    out.t0 = min(starts) if starts else (min(lasts.values()) if lasts else None)

    def at(ts: float) -> str:
        return f"t+{ts - out.t0:.1f} s" if out.t0 is not None else f"ts {ts}"

    events: list[tuple[float, str, Key, Finding]] = []
    late_exceptions: list[tuple[float, Key]] = []
    signals: list[tuple[float, Key]] = []
    for k, s in sorted(parts.items()):
        out.endings[k] = _ending(s)
        label = cast.label(k)
        # died: no end record and silent well before the others stopped writing
        others_last = max((v for o, v in lasts.items() if o != k), default=None)
        if (s.end is None and not s.ended_on_purpose and k in lasts and others_last is not None
                and others_last - lasts[k] > _limit(s, DEAD_FACTOR)):
            silent = others_last - lasts[k]
            what = "last alive" if s.alive and s.alive[-1][0] == lasts[k] else "last record"
            step = s.last_step
            events.append((lasts[k], "rank_died", k, Finding.of(
                "rank_died", step, [k],
                f"{label} died (SIGKILL?) at step {step} in {s.final_state}: no end record, {what} "
                f"{silent:.1f} s before the others' last record; {_waiting_text(s)}",
                state=s.final_state, layer=s.final_layer,
                ranks=[cast.position(k, "died", last_seen(s), step, s.final_state, s.final_layer)],
                details=[f"{label}: last record at {at(lasts[k])}, the others wrote until {at(others_last)} "
                         "(a process frozen for good looks the same)"],
            )))
        elif (s.end is None and not s.ended_on_purpose and len(parts) > 1 and k in lasts
              and all(o.end is not None for o2, o in parts.items() if o2 != k)
              # killed before the others stopped; one the launcher killed after they had ended is a consequence
              and lasts[k] < min(_end_ts(o) for o2, o in parts.items() if o2 != k)):
            # everyone else stopped in order and this one left no end record: killed near the end
            step = s.last_step
            events.append((lasts.get(k, 0.0), "rank_died", k, Finding.of(
                "rank_died", step, [k],
                f"{label} died (SIGKILL?) at step {step} in {s.final_state}: no end record, while every other "
                "rank wrote its end record",
                state=s.final_state, layer=s.final_layer,
                ranks=[cast.position(k, "died", last_seen(s), step, s.final_state, s.final_layer)],
            )))
        for a, b, step, state in _gaps(cast, k):
            events.append((a, "frozen", k, Finding.of(
                "frozen", step, [k],
                f"{label} froze for {b - a:.1f} s at step {step} in {state} (SIGSTOP?): no record from "
                f"{at(a)} to {at(b)} while the other ranks kept writing",
                state=state, ranks=[cast.position(k, "frozen", f"silent {b - a:.1f} s from {at(a)}", step, state)],
            )))
        end = s.end or {}
        ts = end.get("ts") if type(end.get("ts")) in (int, float) else lasts.get(k)
        if end.get("how") == "exception" and ts is not None:
            waited = _WAIT_ERROR.search(str(end.get("error") or "")) or _waits_on_peer(cast, k)
            if waited:
                late_exceptions.append((ts, k))
            else:
                events.append((ts, "crashed", k, Finding.of(
                    "crashed", end.get("step", s.last_step), [k],
                    f"{label} crashed at step {end.get('step', s.last_step)} in {end.get('state', s.final_state)}: "
                    f"{end.get('error')}",
                    state=end.get("state", s.final_state),
                    ranks=[cast.position(k, "crashed", str(end.get("error")), end.get("step"), end.get("state"))],
                )))
        elif end.get("how") == "signal" and ts is not None:
            signals.append((ts, k))
    events.sort(key=lambda e: (e[0], e[2]))
    # a signal after another rank failed or gave up waiting is the launcher stopping the job
    first_ts = min(([events[0][0]] if events else []) + [ts for ts, _ in late_exceptions], default=None)
    for ts, k in signals:
        s = parts[k]
        if first_ts is not None and ts >= first_ts:
            out.consequences.append((k, f"{cast.label(k)} was stopped by {s.end.get('signal') or 'a signal'} at "
                                    f"{at(ts)}, {ts - first_ts:.1f} s after the cause (step {s.end.get('step')})"))
            out.consequence_keys.add(k)
        else:
            events.append((ts, "signalled", k, None))
    for ts, k in late_exceptions:
        s = parts[k]
        out.consequences.append((k, f"{cast.label(k)} gave up waiting at {at(ts)} (step {s.end.get('step')}, "
                                f"{_waiting_text(s)}): {short_error(s.end.get('error'))}"))
        out.consequence_keys.add(k)
    # signalled without an earlier cause: the job was stopped from outside (one finding for all)
    stopped = sorted((e for e in events if e[1] == "signalled"), key=lambda e: e[0])
    events = [e for e in events if e[1] != "signalled"]
    if stopped:
        keys = [e[2] for e in stopped]
        s = parts[keys[0]]
        sig = s.end.get("signal") or "a signal"
        events.append((stopped[0][0], "signalled", keys[0], Finding.of(
            "signalled", s.end.get("step"), keys,
            f"{cast.who(keys)} {'was' if len(keys) == 1 else 'were'} stopped by {sig} (first at step "
            f"{s.end.get('step')} in {s.end.get('state')}) while no rank had failed before: stopped from outside",
            state=s.end.get("state"),
            ranks=[cast.position(k, "signalled", _ending(parts[k]), parts[k].end.get("step"),
                                 parts[k].end.get("state")) for k in keys],
        )))
    if not events:
        lag = _lagging(cast)
        if lag is not None:
            events.append((0.0, "lagging", lag.keys()[0], lag))
    events.sort(key=lambda e: (e[0], e[2]))
    out.findings = [e[3] for e in events]
    culprits = {k for e in events for k in e[3].keys()}
    # ranks still alive at the end whose step stopped advancing waited for the cause
    for k, s in sorted(parts.items()):
        if k in culprits or k in out.consequence_keys or s.end is not None or len(s.alive) < 2:
            continue
        if s.alive[-1][1] == s.alive[-2][1] and events:
            out.consequences.append((k, f"{cast.label(k)} waited at step {s.alive[-1][1]} in {s.alive[-1][2]} "
                                    f"(alive, its step no longer advancing; {_waiting_text(s)})"))
            out.consequence_keys.add(k)
    return out


def _lagging(cast: Cast) -> Finding | None:
    """Every live rank stalled (alive, step fixed) and some at a lower step: those lag, the others wait."""
    stalled = {}
    for k, s in cast.parts.items():
        if s.end is not None or len(s.alive) < 3:
            continue
        steps = [a[1] for a in s.alive[-3:]]
        if type(steps[-1]) is not int or len(set(steps)) != 1:
            return None  # a live rank still moves: nobody is stuck yet
        stalled[k] = steps[-1]
    if len(stalled) < 2 or len(set(stalled.values())) < 2:
        return None
    low = min(stalled.values())
    behind = sorted(k for k, v in stalled.items() if v == low)
    ahead = sorted(k for k in stalled if k not in behind)
    s = cast.parts[behind[0]]
    top = max(stalled.values())
    return Finding.of(
        "lagging", low, behind,
        f"{cast.who(behind)} {'lags' if len(behind) == 1 else 'lag'} at step {low} in {s.alive[-1][2]} "
        f"({_waiting_text(s)}) while "
        f"{cast.who(ahead)} wait at step {top}: alive, their steps no longer advance",
        state=s.alive[-1][2],
        ranks=[cast.position(k, "lagging" if k in behind else "waiting",
                             f"alive at step {stalled[k]}, {_waiting_text(cast.parts[k])}", stalled[k])
               for k in sorted(stalled)],
    )


def step_count_mismatch(cast: Cast) -> list[Finding]:
    """Every participant closed in order but their final steps differ: the odd ones skipped or added steps.

    The reference is the final step most participants reached; in a tie, the one whose participants' own
    step numbers run on unbroken (``stepseq``), then the higher."""
    parts = {k: s for k, s in cast.parts.items() if not s.ended_on_purpose}
    if len(parts) < 2 or any((s.end or {}).get("how") != "closed" for s in parts.values()):
        return []
    by_step: dict = {}
    for k, s in parts.items():
        by_step.setdefault(s.last_step, []).append(k)
    if len(by_step) < 2:
        return []
    ref = max(by_step, key=lambda v: (len(by_step[v]), not any(own_steps_broken(parts[k]) for k in by_step[v]),
                                      v is not None and v))
    odd = sorted(k for v, ks in by_step.items() if v != ref for k in ks)
    steps = ", ".join(f"{cast.who(ks)} at step {v}" for v, ks in sorted(by_step.items(), key=lambda kv: str(kv[0]))
                      if v != ref)
    first = cast.parts[odd[0]]
    return [Finding.of(
        "step_count_mismatch", first.last_step, odd,
        f"every rank closed in order, but {steps} where {cast.who(by_step[ref])} ended at step {ref}: "
        "a rank skipped or added engine steps",
        state=first.final_state,
        ranks=[cast.position(k, "odd" if k in odd else "reference", f"closed at step {parts[k].last_step}",
                             parts[k].last_step) for k in sorted(parts)],
        details=[f"{cast.label(k)}: {text}" for k in odd if (text := step_break_text(parts[k]))],
    )]


def aborted_rearrangements(cast: Cast, handled: list[Finding], causes: list[Finding],
                           hangs: Sequence[Finding] = ()) -> list[dict]:
    """Every rearrangement the ranks rolled back (a ``fault`` transition), with the rank that was late.

    The late rank is the member of the collective problem the rollback handled that never
    joined it, or else the one that started it last (late by the spread of the start ``ts``);
    a freeze found by the liveness records around that step is named too. The problem is the
    latest since the previous rollback: a handled one (a late rank's note, ``late``), else an unhandled
    ``hang`` (its culprit died or hangs) or a cause about a collective (a late rank in a run left
    ``failed``). A fault in ``scaling`` is a scale abort, listed with the scales, not here.
    """
    parts = cast.parts
    by_step: dict[int, list[Key]] = {}
    for k, s in parts.items():
        for t in s.transitions:
            if t.trigger == "fault" and t.source != SCALING and type(t.step) is int \
                    and k not in by_step.get(t.step, []):
                by_step.setdefault(t.step, []).append(k)
    out, before = [], None   # before: the previous rollback's step (a hang at or before it is that one's)
    for step, keys in sorted(by_step.items()):
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
                entry["late_ranks"] = sorted({k[0] for k in lagging}) or [late[0]]
                entry["late_by_s"] = round(starts[late] - min(starts.values()), 3)
                late_text = f"{cast.label(late)} started {where} {entry['late_by_s']:.1f} s after the first rank"
        # a rank that froze or died at or before that step is why the others gave up
        gone = [x for x in causes if x.kind in ("frozen", "rank_died") and type(x.step) is int and x.step <= step]
        if gone:
            late_text = ("" if late_text.startswith("no rank") else late_text + "; ") + gone[-1].summary.split(":")[0]
            entry["late_ranks"] = sorted(set(entry["late_ranks"]) | set(gone[-1].culprits))
        entry["text"] = f"step {step}: {cast.who(keys)} aborted the rearrangement; {late_text}"
        out.append(entry)
    return out


def signalled_in_hang(cause: Finding, rest: list[Finding], cast: Cast, live: Liveness) -> bool:
    """A job stopped from outside (SIGTERM, Ctrl-C, a launcher's deadline) while a hang lasted: the hang is the cause.

    An operator usually ends a hung job before its collective timeout fires, so every rank's
    trace ends with ``signal`` and nothing failed before it. When a signalled rank was still
    inside the collective of a ``hang`` (or ``collective_mismatch``) whose culprits were not
    inside it, the signal only ended what the hang had already stopped. Then the signal goes
    into that finding's details and the waiters' consequences, and True says ``cause`` was
    folded. A job stopped while every rank was inside the same collective stays ``signalled``.
    """
    if cause.kind != "signalled":
        return False
    for f in rest:
        if f.kind not in ("hang", "collective_mismatch") or not f.collective:
            continue
        coll = (f.collective.get("group"), f.collective.get("cseq"))
        inside = [k for k in cause.keys() if k in cast.parts
                  and coll in {(c.group, c.cseq) for c in cast.parts[k].open_collectives()}]
        if not inside or set(inside) & set(f.keys()):
            continue
        f.details.insert(0, cause.summary.split(" while no rank had failed")[0] + ", while this hang lasted: "
                         "stopped from outside, not its cause")
        for k in inside:
            end = cast.parts[k].end or {}
            ts = end.get("ts")
            when = f" at t+{ts - live.t0:.1f} s" if type(ts) in (int, float) and live.t0 is not None else ""
            live.consequences.append((k, f"{cast.label(k)} was stopped by {end.get('signal') or 'a signal'}{when} "
                                         f"while waiting inside {f.collective.get('op')} (group {coll[0]}, cseq "
                                         f"{coll[1]}), which the hang's culprit never joined"))
            live.consequence_keys.add(k)
        return True
    return False
