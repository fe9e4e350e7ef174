"""Stage 2 of the replay, liveness: which rank died, froze, crashed or lagged, and who only waited.

A rank's trace ends with an ``end`` record when the rank stopped in order (``how``: closed,
exception with its message, signal with its name); a background thread writes an ``alive``
record about once per ``interval_s`` with the rank's step, state and the collective it waits
in (docs/events.md). From those, per participant (``elastic.Cast``):

- **died**: no ``end``, and either its last record is older than the others' last records by
  more than ``DEAD_FACTOR`` intervals, or it comes before the first ``end`` of the peers that ended (the
  participants of its current group that did not leave on purpose) in order, giving up a wait (not when that
  first end gave up a wait, its last record is an interval or less before it and no peer lost its connection
  to it: it was alive, and timed out on, then), or by a signal that came after its last record and before
  any crash (``signal_death``: a launcher's SIGTERM to the survivors once a rank is gone; when its own writes
  failed, only once a peer's liveness thread ticked a full interval after that record): the process was
  killed (SIGKILL, a crash of the interpreter) or froze for good. Ranks that died within ``DEAD_FACTOR``
  intervals of each other are one finding (two ranks killed together). On gloo, one that a peer still waited
  on, unbroken, past the frozen limit after its last record was a process then: ``frozen`` for good (``held``).
- **frozen**: a silence (no record of any kind) of more than ``FROZEN_FACTOR`` intervals
  while another rank wrote alive records inside it (SIGSTOP, then SIGCONT): a waiting rank writes
  one every interval, the first within 1.5 intervals of its wait's start (eplb_fsm.liveness). Silences begun
  within 1.5 intervals of the first and overlapping it are one finding (ranks stopped together). A peer silent over
  that window itself (but for one interval) wrote nothing there: after a stop of the whole job the first rank to
  resume writes just inside the others' silences. When every rank that ran over the window was silent over it, the
  whole job was paused (``pauses.all_silent``): a warning (``Liveness.pauses``), no culprit.
  A silence inside lines the rank's own ``seq`` shows lost is no freeze (it wrote, the lines went):
  it is ``lost_records`` (``Liveness.lost``; ``lost.LostRecords.silent``), once per gap.
- **crashed**: ``end`` with ``how: exception`` whose error is not a failed wait (``endings.WAIT_ERROR``:
  the forms gloo, torch and the controller write when a peer is gone or a wait timed out).
- **signalled**: ``end`` with ``how: signal`` before any of the above happened elsewhere.
- **lagging**: alive, in its own work at one step while every other rank waits for it inside the engine's
  collective for a minute or more (``lagging.engine_lag``: signals after it are consequences; shorter, a warning
  in ``Liveness.held_back``, as for ``deadlock.engine_deadlock``); or, in traces that do not name the
  engine's waits, alive to the end with a step that no longer advances, at a lower step than the other stalled
  ranks (``lagging.step_lag``).
- **network**: every rank alive (or signalled since) and inside the engine's collective, none computing:
  the transport stalled (``stalled.network_stall``); or, with no other cause, a connection reset between
  two live ranks (``stalled.lost_together``).
- **collective_mismatch**: every rank alive (or signalled since) and inside a collective of the engine's at one
  step, but not one collective: a deadlock of the engine's (``deadlock.engine_deadlock``).

The earliest of these events (by ``ts``) is the cause. Everything that happened after it to
the other ranks (an exception from a wait that failed, a SIGTERM from the launcher, alive
records whose step stopped advancing) is a consequence and never a culprit. When there is no
cause but a rank ended with an exception, ``Liveness.unexplained`` names the first to go: a rank
that closed in order while a peer still ran and then failed (``left_early``), else the first
exception (``crashed``); the replay reports it when nothing else is found. Traces without
``end`` or ``alive`` records (older writers) give no liveness finding; the step-based checks
(``checks.check_ends``) still apply to them.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from eplb_fsm.fsm.machine import TRANSFERRING
from eplb_fsm.inspect.deadlock import engine_deadlock
from eplb_fsm.inspect.died import died_finding
from eplb_fsm.inspect.dropped import Dropped
from eplb_fsm.inspect.elastic import Cast, Key
from eplb_fsm.inspect.endings import (CONNECTION_LOST, WAIT_ERROR, ended_in_reaction, ending_text, entries,
                                      failed_wait_first, waiting_text, waits_on_peer)
from eplb_fsm.inspect.findings import Finding, coll_text, short_error
from eplb_fsm.inspect.frozen import frozen_findings, survived_last
from eplb_fsm.inspect import engine_runs
from eplb_fsm.inspect.held import held_findings, held_open
from eplb_fsm.inspect.lagging import engine_lag, step_lag
from eplb_fsm.inspect.lost import LostRecords, lost_gap
from eplb_fsm.inspect.peers import group_peers, lone_joiner
from eplb_fsm.inspect.pauses import all_silent, pause_warnings, silent_over
from eplb_fsm.inspect.signal_death import signal_death, stopped_after
from eplb_fsm.inspect.stalled import lost_together, network_stall

DEFAULT_INTERVAL_S = 1.0   # the writer's default rate of alive records
DEAD_FACTOR = 5            # silent for this many intervals before the others' last record: gone
FROZEN_FACTOR = 2.5        # a gap of this many intervals between alive records: frozen
MIN_GAP_S = 2.0            # never less than this (a loaded machine delays a thread by a second or so)


@dataclass
class Liveness:
    """What the liveness records say: the cause findings (earliest first) and the consequences."""

    aware: bool                                   # any participant wrote end or alive records
    findings: list[Finding] = field(default_factory=list)
    consequences: list[tuple] = field(default_factory=list)   # (participant, what happened to it)
    consequence_keys: set = field(default_factory=set)   # participants that only reacted
    endings: dict = field(default_factory=dict)   # key -> one line on how it ended
    t0: float | None = None
    unexplained: Finding | None = None            # no cause, yet a rank ended with an exception: the first to go
    lost: list[Finding] = field(default_factory=list)   # silences in lost lines: lost_records, not causes
    pauses: list[str] = field(default_factory=list)   # windows every rank was silent over: warnings, not causes
    held_back: list[str] = field(default_factory=list)   # a lag or engine deadlock too short to name: warnings
    paused: list[tuple] = field(default_factory=list)   # those windows, (from ts, to ts)
    passed: list[Finding] = field(default_factory=list)   # freezes the job got past (frozen.passed_last)


def _interval(s) -> float:
    return s.alive_interval or DEFAULT_INTERVAL_S


def _limit(s, factor: int) -> float:
    return max(factor * _interval(s), MIN_GAP_S)


def _end_ts(s) -> float:
    ts = (s.end or {}).get("ts")
    return ts if type(ts) in (int, float) else (s.last_ts if s.last_ts is not None else float("inf"))


def _layer_at(s, silence: tuple) -> int | None:
    """The layer in flight when ``silence`` began (``None`` outside transferring).

    A silence that carries it (a fifth field) says so; else the first collective the participant issued
    after the silence at that step in transferring (a stopped process goes on where it stood), else the
    last one before it."""
    if len(silence) > 4:
        return silence[4]
    a, b, step, state = silence[:4]
    if state != TRANSFERRING:
        return None
    seen = sorted((e.ts, e.layer) for e in entries(s) if e.step == step and e.state == TRANSFERRING
                  and type(e.layer) is int and type(e.ts) in (int, float))
    after = [layer for ts, layer in seen if ts >= b]
    before = [layer for ts, layer in seen if ts <= a]
    return after[0] if after else (before[-1] if before else None)


def _gaps(cast: Cast, key: Key) -> tuple[list[tuple], list[tuple]]:
    """The silences of ``key`` (no record at all) over the limit, as (from ts, to ts, step, state, layer, gap):
    those while another rank wrote alive records inside it and was not silent over it itself (a freeze if ``gap``
    is None, else the lost lines s.gaps[gap]), and those the whole job was silent over (``pauses.all_silent``)."""
    s = cast.parts[key]
    if not s.alive and s.end is None:
        return [], []  # a writer without liveness records is silent whenever nothing happens
    limit, margin = _limit(s, FROZEN_FACTOR), _interval(s)
    others = [(o, sorted(a[0] for a in o.alive if type(a[0]) in (int, float)))
              for k, o in cast.parts.items() if k != key]
    out, paused = [], []
    for silence in s.silences:
        a, b, step, state = silence[:4]
        if b - a <= limit:
            continue
        # somebody else kept writing inside the gap: this rank, not the machine, stood still
        if any(bisect.bisect_right(ts, a) < bisect.bisect_left(ts, b) and not silent_over(o, a, b, margin)
               for o, ts in others):
            out.append((a, b, step, state, _layer_at(s, silence), lost_gap(s, a, b)))
        elif all_silent(cast, key, a, b, margin):
            paused.append((a, b, step, state, _layer_at(s, silence)))
    return out, paused


def _death(cast: Cast, key: Key, lasts: dict, at, dropped: Dropped) -> tuple[str, str | None] | None:
    """Why ``key`` died (its reason, without its name, and a detail line), or None: see the module docstring."""
    s = cast.parts[key]
    if s.end is not None or s.ended_on_purpose or key not in lasts:
        return None
    others_last = max((v for o, v in lasts.items() if o != key), default=None)
    if others_last is not None and others_last - lasts[key] > _limit(s, DEAD_FACTOR):
        what = "last alive" if s.alive and s.alive[-1][0] == lasts[key] else "last record"
        return (f"{what} {others_last - lasts[key]:.1f} s before the others' last record; {waiting_text(s)}",
                f"last record at {at(lasts[key])}, the others wrote until {at(others_last)}")
    peers = group_peers(cast, key, before=True)
    # peers that ended because of what happened to others (in order, or giving up a wait): a peer that crashed
    # explains the stop itself, and the ranks a launcher killed after it are its consequences
    ended = [o for o in peers if cast.parts[o].end is not None and ended_in_reaction(cast, o)]
    # and peers stopped by a signal before any crash: a launcher stops the survivors once a rank is gone
    # a joiner alone in its generation kept the ranks before it waiting in the scale (signal_death: ``waited``)
    signalled = stopped_after(cast, key, peers, waited=not group_peers(cast, key))
    ended += signalled
    # killed before those peers stopped; one the launcher killed after they had ended is a consequence
    lost = dropped.first_after(key)
    first_end = min((_end_ts(cast.parts[o]) for o in ended), default=None)
    if lost is not None:
        ts, peer, e = lost
        went_on = _end_ts(cast.parts[peer]) - ts > _interval(cast.parts[peer])   # not an end right after it
        # no peer's end tells it, or one that went on lost its connection to it before any end (dropped.py)
        if first_end is None or lasts[key] >= first_end or (went_on and ts < first_end):
            return (f"{cast.label(peer)} lost its connection to it {ts - lasts[key]:.2f} s after its last record "
                    f"({coll_text(e)} failed at {at(ts)}: {short_error(e.error)}) and went on", None)
    if first_end is None or lasts[key] >= first_end:
        return None
    first = min(ended, key=lambda o: _end_ts(cast.parts[o]))
    end = _end_ts(cast.parts[first])
    if first in signalled:
        return signal_death(cast, key, signalled, lasts[key], at)
    gave_up = cast.parts[first].end.get("how") == "exception"
    if gave_up and s.alive and end - lasts[key] <= _interval(s) and lost is None \
            and not CONNECTION_LOST.search(str(cast.parts[first].end.get("error") or "")):
        # it ticked less than an interval before the first peer gave up, and nobody lost a connection to it (a
        # dead process closes its sockets): alive then, a rank its peers timed out on (stalled in its engine),
        # stopped later by its launcher; the collective it never joined names it
        return None
    if len(ended) == len(peers):
        return "while every other rank wrote its end record", None
    return (f"trace stops {end - lasts[key]:.2f} s before {cast.label(first)} ended "
            f"({cast.parts[first].end.get('how')}, at {at(end)})", None)


def _by_launcher(s) -> bool | None:
    """Whether the signal that ended ``s`` came from its parent (its launcher); None when not recorded."""
    sender = (s.end or {}).get("sender")
    return sender.get("parent") if isinstance(sender, dict) and type(sender.get("parent")) is bool else None


def _held_back_text(kind: str, finding: Finding, what: str, alike: str) -> str:
    """The warning for a reading of a live engine too short to name as a cause (``engine_runs.held_back``)."""
    return (f"not read as a cause ({kind}, {finding.summary}): it lasted under {engine_runs.LAG_MIN_S:.0f} s, or no "
            f"more than twice the longest {what} the job got past; {alike} the same records for that long")


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
    dropped = Dropped(cast)
    dead = sorted((lasts[k], k, why) for k in sorted(parts)
                  if (why := _death(cast, k, lasts, at, dropped)) is not None)
    # a peer's wait on it stayed unbroken past the frozen limit: a process then, silent (on gloo; held.py)
    held = [(*d[:2], h) for d in dead if (h := held_open(cast, d[1], dropped, _limit(parts[d[1]], FROZEN_FACTOR)))]
    events, dead = held_findings(cast, held, dead, dropped, at, _interval)
    while dead:   # ranks that died within the dead limit of the first are one finding: killed together
        limit = _limit(parts[dead[0][1]], DEAD_FACTOR)
        together = [d for d in dead if d[0] - dead[0][0] <= limit]
        events.append((dead[0][0], "rank_died", dead[0][1], died_finding(cast, together)))
        dead = dead[len(together):]
    lost = LostRecords(cast)
    paused: list[tuple] = []
    frozen: list[tuple] = []
    for k, s in sorted(parts.items()):
        out.endings[k] = ending_text(s)
        label = cast.label(k)
        gaps, pauses = _gaps(cast, k)
        paused += [(p, k) for p in pauses]
        for a, b, step, state, layer, gap in gaps:
            if gap is not None:   # it wrote there, the lines went: lost_records, unless a finding told the gap
                out.lost += filter(None, [lost.silent(k, (a, b, step, state, layer), gap, at)])
                continue
            frozen.append((a, k, b, step, state, layer))
        end = s.end or {}
        ts = end.get("ts") if type(end.get("ts")) in (int, float) else lasts.get(k)
        if end.get("how") == "exception" and ts is not None:
            if WAIT_ERROR.search(str(end.get("error") or "")) or waits_on_peer(cast, k) or failed_wait_first(s):
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
    out.pauses, out.paused = pause_warnings(cast, paused, at)
    events += frozen_findings(cast, sorted(frozen), at, _interval)
    # live ranks that stopped in or around the engine's collectives: the signals, failed waits after are consequences
    rules = ((network_stall, "network"), (engine_lag, "lagging"), (engine_deadlock, "collective_mismatch"))
    for rule, kind in rules if not events else ():
        if (found := rule(cast, at)) is not None:   # (ts, first culprit, held back, finding)
            if found[2]:   # too short to name a cause: an idle server, a slow step look the same
                out.held_back.append(_held_back_text(kind, found[3], "wait", "an idle server waiting for requests, a "
                                                     "first checkpoint or a slow step leave"))
            else:
                events.append((found[0], kind, found[1], found[3]))
            break
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
                                f"{waiting_text(s)}): {short_error(s.end.get('error'))}"))
        out.consequence_keys.add(k)
    # signalled without an earlier cause: the job was stopped from outside (one finding for all)
    stopped = sorted((e for e in events if e[1] == "signalled"), key=lambda e: e[0])
    events = [e for e in events if e[1] != "signalled"]
    # signalled over an interval after the first, once a peer had lost its connection to that one: the launcher's
    # reaction to a process gone
    gone = bool(stopped) and (dropped.seen_going(stopped[0][2], stopped[0][0]) or lone_joiner(cast, stopped[0][2]))
    for ts, _, k, _ in (later := [e for e in stopped[1:] if gone and e[0] - stopped[0][0] > _interval(parts[e[2]])]):
        out.consequences.append((k, f"{cast.label(k)} was stopped by {parts[k].end.get('signal') or 'a signal'} at "
                                    f"{at(ts)}, {ts - stopped[0][0]:.1f} s after {cast.label(stopped[0][2])}, whose "
                                    "peers had lost their connection to it"))
        out.consequence_keys.add(k)
    stopped = [e for e in stopped if e not in later]
    # signalled by their own launcher after a rank that something else signalled (an operator's kill of one
    # rank): the launcher's reaction to that rank's exit (the sender comes from eplb_fsm.stop_signals)
    outside = next((e for e in stopped if _by_launcher(parts[e[2]]) is False), None)
    for ts, _, k, _ in (reacted := [e for e in stopped if outside is not None and e[0] > outside[0]
                                    and _by_launcher(parts[e[2]]) is True]):
        out.consequences.append((k, f"{cast.label(k)} was stopped by {parts[k].end.get('signal') or 'a signal'} "
                                    f"from its launcher at {at(ts)}, {ts - outside[0]:.2f} s after "
                                    f"{cast.label(outside[2])}, whose signal came from outside it"))
        out.consequence_keys.add(k)
    stopped = [e for e in stopped if e not in reacted]
    if stopped:
        keys = [e[2] for e in stopped]
        s = parts[keys[0]]
        sig = s.end.get("signal") or "a signal"
        events.append((stopped[0][0], "signalled", keys[0], Finding.of(
            "signalled", s.end.get("step"), keys,
            f"{cast.who(keys)} {'was' if len(keys) == 1 else 'were'} stopped by {sig} (first at step "
            f"{s.end.get('step')} in {s.end.get('state')}) while no rank had failed before: stopped from outside",
            state=s.end.get("state"), layer=s.final_layer if s.end.get("state") == TRANSFERRING else None,
            ranks=[cast.position(k, "signalled", ending_text(parts[k]), parts[k].end.get("step"),
                                 parts[k].end.get("state")) for k in keys],
        )))
    if not events and (lag := step_lag(cast)) is not None:
        if lag[0]:
            out.held_back.append(_held_back_text("lagging", lag[1], "stall", "a slow step or stage leaves"))
        else:
            events.append((0.0, "lagging", lag[1].keys()[0], lag[1]))
    events.sort(key=lambda e: (e[0], e[2]))
    events, out.passed = survived_last(cast, events)   # a freeze the job got past is no cause of a later failure
    out.findings = [e[3] for e in events]
    # a participant alone in its group (a joiner whose group never formed: the scale's note tells it) waited for none
    first = None if events else next((e for e in sorted(late_exceptions) if group_peers(cast, e[1])), None)
    if first is not None:   # nothing explains the failed waits: a connection reset between live ranks, if so
        out.unexplained = lost_together(cast, sorted(late_exceptions), at) or _first_to_go(cast, first, at)
    culprits = {k for e in events for k in e[3].keys()}
    # ranks still alive at the end whose step stopped advancing waited for the cause
    for k, s in sorted(parts.items()):
        if k in culprits or k in out.consequence_keys or s.end is not None or len(s.alive) < 2:
            continue
        if s.alive[-1][1] == s.alive[-2][1] and events:
            out.consequences.append((k, f"{cast.label(k)} waited at step {s.alive[-1][1]} in {s.alive[-1][2]} "
                                    f"(alive, its step no longer advancing; {waiting_text(s)})"))
            out.consequence_keys.add(k)
    return out


def _first_to_go(cast: Cast, first: tuple[float, Key], at) -> Finding:
    """No cause, yet ``first`` (ts, key) ended with an exception from a failed wait: what it waited for is the
    first peer of its group that closed in order before it (returned or exited while the others still needed
    it: ``left_early``), else nobody the traces show, and it is named (``crashed``, the first to fail)."""
    ts, k = first
    s, parts = cast.parts[k], cast.parts
    step = s.end.get("step", s.last_step)
    closed = [o for o in group_peers(cast, k) if (parts[o].end or {}).get("how") == "closed" and _end_ts(parts[o]) < ts
              and not (type(parts[o].last_step) is int and type(step) is int and parts[o].last_step > step)]
    if closed:
        o = min(closed, key=lambda x: (_end_ts(parts[x]), x))
        left = parts[o]
        return Finding.of(
            "left_early", left.last_step, [o],
            f"{cast.label(o)} closed in order at step {left.last_step} in {left.final_state} (at {at(_end_ts(left))}) "
            f"while {cast.label(k)} still ran; {cast.label(k)} then failed waiting at {at(ts)}: "
            f"{short_error(s.end.get('error'))}",
            state=left.final_state,
            ranks=[cast.position(o, "left_early", f"closed at {at(_end_ts(left))}", left.last_step, left.final_state),
                   cast.position(k, "gave_up", f"ended with an exception at {at(ts)}", step, s.end.get("state"))],
            details=[f"{cast.label(o)}'s engine loop stopped early (a return or sys.exit inside the controller's "
                     "`with`) while its peers still needed it"],
        )
    return Finding.of(
        "crashed", step, [k],
        f"{cast.label(k)} was the first rank to end with an exception, at step {step} in {s.end.get('state')} "
        f"({at(ts)}): {short_error(s.end.get('error'))}; it reads as a failed wait, but no trace shows a cause "
        "(a peer without a trace, one outside these groups, or the network)",
        state=s.end.get("state"),
        ranks=[cast.position(k, "crashed", str(s.end.get("error")), step, s.end.get("state"))],
    )
