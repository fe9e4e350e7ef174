"""A rank with no ``end`` record whose trace stops before its peers were stopped by a signal: it went first.

A launcher (torchrun, ``eplb-fsm simulate``) sends SIGTERM to the ranks still running once one of them is
gone, and each of those writes ``end how=signal`` (an engine of its own asks for that once per process:
``eplb_fsm.stop_signals.end_traces_on_signal``). The rank that was gone wrote no ``end`` (SIGKILL, a crash
of the interpreter, the OOM killer): its trace stops before the first of those ends. Read without it, the
signals look like a job stopped from outside (``signalled``, naming the survivors). So ``liveness._death``
counts a peer's signal ``end`` like an end in reaction (:func:`stopped_after`) when

- it comes after the last record of the rank without an end (a signal before that stop is no reaction to
  it: the rank still wrote after it),
- no participant had crashed (an ``end`` with an exception that is no failed wait,
  ``endings.ended_in_reaction``) at or before it: a crash explains the launcher's signals itself, and a
  rank left without an end among them that wrote after the crash is one the launcher killed after it. One
  that stopped writing before the crash and took no signal in the stop that followed was gone already (or
  frozen for good): all of its peers' signals count (a red team's SIGKILL and engine error at one step read
  only the crash), and
- its own trace shows no failed write (no half-written last line, no ``write_errors`` count:
  :func:`lost_writes`). A rank whose writes failed may have lost its own ``end``; for it the signals count only
  once it missed a liveness tick its peers made: a signalled peer wrote an ``alive`` record more than one of its
  intervals (``interval_s``; ``eplb_fsm.liveness.DEFAULT_INTERVAL_S`` when none was announced) after the rank's
  last record, and before its own signal ``end`` (for a joiner alone in its generation whose old ranks waited
  for it in the scale, a signal ``end`` of theirs more than one interval after its last record counts as such a
  tick, ``waited``: a live joiner is past its header in about 0.1 s).

Why no tick is asked of a rank whose writes did not fail: launchers react fast (torchrun looks at its workers
every 0.1 s, ``--monitor-interval``), so the survivors' SIGTERM ends follow the kill by a fraction of a second,
and a rule that wanted a tick the dead rank missed named the survivors ``signalled`` in nearly every real kill
(a red team's torchrun runs). A job stopped from outside while no rank had failed leaves an ``end how=signal``
on every rank, since the signal thread writes it while the main thread waits in a collective
(:mod:`eplb_fsm.stop_signals`); a rank without one did not take the signal: it was gone already, or it ran no
Python for the launcher's whole grace (a C call holding the GIL) and was SIGKILLed after it. Either way it is
where to look, and the finding's detail names the second reading.

What the traces cannot tell apart either: a rank frozen (SIGSTOP, a stalled host) when the job was stopped
from outside, without a SIGCONT, writes no ``end``, and its trace stops before the others' signal ends too:
every thread of a stopped process stops, as of a killed one, and nothing it wrote before differs. (The
stop of ``eplb-fsm simulate`` sends SIGCONT with SIGTERM, so a rank of its own writes its ``end`` and reads
``frozen``.) Such a rank is named ``rank_died`` as well, and the finding's detail says that a frozen
process looks the same. It is the safer reading: that rank was no longer running when the others were
stopped, so it is where to look either way, while ``signalled`` would name only ranks that did nothing
wrong and leave the dead rank of the common case (a kill, then the launcher's SIGTERM) unnamed. On gloo its
peers' waits can tell the two apart (:mod:`eplb_fsm.inspect.held`).

A signal that lands while a collective is in flight is no hang either (:func:`in_flight`): ranks reach a
collective a few ms apart, so a SIGTERM to a healthy job often finds one inside it and a peer not there yet.
The replay folds a ``signalled`` cause into a hang whose culprit never joined the collective its signalled
ranks wait in (``late.signalled_in_hang``: an operator ends a hung job) only when one of those ranks had
waited in it at least one liveness interval (``interval_s``; 1 s when none was announced) before its signal
``end``: a wait that short is every collective's. Else the verdict stays ``signalled`` and names the collective
in flight in a detail line. The limit: a real hang stopped within one interval of its start reads
``signalled`` (nothing in the records can yet tell it from a collective in flight).

A waiter whose wait failed after the stop began counts as inside too (:func:`waiters`): a launcher signals
its ranks one after another, often the stalled culprit first, and the culprit's exit closes its sockets, so
a waiter's collective can end with "Connection closed by peer" a few ms before its own signal ``end``, or
(an operator's ``kill`` of the stalled rank alone) the waiter gives up with an exception, in async mode often
from the engine thread while its transfer worker still waits. It had waited from its collective's start to
the first signal ``end`` of the stop; its wait must have failed (or its rank given up) at or after that
``end`` (clocks of ranks on different hosts that disagree by more than the gap read ``signalled``).
"""

from __future__ import annotations

from eplb_fsm.inspect.elastic import Cast, Key
from eplb_fsm.inspect.endings import ended_in_reaction
from eplb_fsm.inspect.findings import Finding
from eplb_fsm.liveness import DEFAULT_INTERVAL_S

__all__ = ["in_flight", "lost_writes", "signal_death", "stopped_after", "waiters"]


def _end_ts(cast: Cast, key: Key) -> float | None:
    ts = (cast.parts[key].end or {}).get("ts")
    return ts if type(ts) in (int, float) else None


def stopped_after(cast: Cast, key: Key, peers: list[Key], waited: bool = False) -> list[Key]:
    """The ``peers`` of ``key`` (a participant with no ``end``) that a signal stopped after ``key``'s last
    record and before any participant crashed (see the module docstring). ``waited``: the peers waited for
    ``key`` (a joiner alone in its generation, the ranks before it in the scale): a signal ``end`` more than
    one interval after its last record counts as a tick it missed (a live joiner is past its header in ~0.1 s,
    so one that wrote nothing more for an interval while they waited made no progress)."""
    last = cast.parts[key].last_ts
    if type(last) not in (int, float):
        return []
    later = {o: ts for o in peers if (cast.parts[o].end or {}).get("how") == "signal"
             and (ts := _end_ts(cast, o)) is not None and ts > last}
    if not later:
        return []   # the usual case (no signal, or none after it): no need to read every end for a crash
    if lost_writes(cast.parts[key]) and not any(_missed_tick(cast, o, last, ts) or (
            waited and ts - last > (cast.parts[o].alive_interval or DEFAULT_INTERVAL_S)) for o, ts in later.items()):
        return []   # its writes failed: its own end may be what was lost, so only a tick it missed tells a death
    crashes = [ts for o, s in cast.parts.items() if o != key and (s.end or {}).get("how") == "exception"
               and (ts := _end_ts(cast, o)) is not None and not ended_in_reaction(cast, o)]
    first_crash = min(crashes, default=float("inf"))
    if last < first_crash:   # it stopped writing before the crash, and took no signal in the stop that followed
        return list(later)
    return [o for o, ts in later.items() if ts < first_crash]


def lost_writes(s) -> bool:
    """The participant's trace shows writes that failed: a half-written last line, or a ``write_errors`` count."""
    return bool(s.truncated) or (type(s.write_errors) is int and s.write_errors > 0)


def _missed_tick(cast: Cast, peer: Key, last: float, end: float) -> bool:
    """``peer`` wrote an ``alive`` record more than one of its intervals after ``last`` and before its signal
    ``end`` at ``end``: its liveness thread ticked where the silent rank's, had it been running, would have."""
    s = cast.parts[peer]
    interval = s.alive_interval or DEFAULT_INTERVAL_S
    return any(type(ts) in (int, float) and last + interval < ts < end for ts, *_ in s.alive)


def signal_death(cast: Cast, key: Key, stopped: list[Key], last: float, at) -> tuple[str, str]:
    """Why ``key`` died, as ``liveness._death`` words it (its reason and a detail line): its trace, last
    record at ``last``, stops before ``stopped`` (peers from :func:`stopped_after`) were stopped by a signal.
    ``at`` formats a ts."""
    first = min(stopped, key=lambda o: (_end_ts(cast, o), o))
    end = _end_ts(cast, first)
    sigs = sorted({str(cast.parts[o].end.get("signal") or "a signal") for o in stopped})
    sig = " or ".join(sigs)
    who = cast.who(sorted(stopped))
    were = "were" if len(stopped) > 1 else "was"
    return (f"trace stops {end - last:.2f} s before {who} {were} stopped by {sig} (first at {at(end)}): a "
            "launcher stops the ranks still running once one is gone",
            f"last record at {at(last)}; {who} {were} stopped by {sig} from {at(end)} and wrote "
            f"{'their end records' if len(stopped) > 1 else 'its end record'}; had it still been running, it "
            "took no signal in the launcher's grace (no Python ran: a C call holding the GIL?)")


def waiters(cast: Cast, cause: Finding, coll: tuple) -> dict[Key, float]:
    """The ranks inside the collective ``coll`` (group, cseq) when the ``signalled`` ``cause`` stopped the job,
    each with how long it had waited (infinity when a time is missing, so that a hang keeps its rank):

    - a rank of ``cause`` still inside it at its own ``end``: the wait up to that ``end``;
    - any rank whose wait in it failed at or after the first signal ``end`` of ``cause`` (the stopped rank's
      exit closed the connection it waited on): the wait up to that first ``end``;
    - a rank outside ``cause`` still inside it at an ``exception`` end (a failed wait) at or after that first
      ``end``: another of its threads gave up first (async mode: the engine thread's collective failed, and the
      rank ended before its transfer worker wrote the error). The wait up to that first ``end`` too.
    """
    stopped = set(cause.keys())
    first = min((ts for k in stopped if k in cast.parts and (ts := _end_ts(cast, k)) is not None), default=None)
    group, cseq = coll
    out: dict[Key, float] = {}
    for k, s in cast.parts.items():
        entries = s.collectives.get(group)
        e = entries.get(cseq) if entries is not None else None
        if e is None:
            continue
        start = e.ts if type(e.ts) in (int, float) else None
        if e.status == "open" and k in stopped:
            end = _end_ts(cast, k)
            out[k] = end - start if start is not None and end is not None else float("inf")
        elif first is None or start is None or start > first:
            continue
        elif e.status == "error" and type(e.error_ts) in (int, float) and e.error_ts >= first:
            out[k] = first - start
        elif e.status == "open" and (s.end or {}).get("how") == "exception" \
                and (end := _end_ts(cast, k)) is not None and end >= first and ended_in_reaction(cast, k):
            out[k] = first - start
    return out


def in_flight(cause: Finding, rest: list[Finding], cast: Cast) -> list[Finding]:
    """``rest`` without the hangs that a ``signalled`` ``cause`` stopped while in flight (see the module
    docstring): each goes into ``cause``'s details instead, and leaves ``rest`` (changed in place, returned)."""
    if cause.kind != "signalled":
        return rest
    for f in [f for f in rest if f.kind == "hang" and f.collective]:   # two different collectives are no timing
        coll = (f.collective.get("group"), f.collective.get("cseq"))
        waits = waiters(cast, cause, coll)
        if not waits or set(waits) & set(f.keys()):
            continue
        k = max(waits, key=lambda o: (waits[o], o))
        interval = cast.parts[k].alive_interval or DEFAULT_INTERVAL_S
        if waits[k] >= interval:
            continue
        layer = f.collective.get("layer", f.layer)
        where = f"group {coll[0]}, cseq {coll[1]}" + (f", layer {layer}" if type(layer) is int else "")
        cause.details.append(
            f"{cast.who(sorted(waits))} {'was' if len(waits) == 1 else 'were'} inside {f.collective.get('op')} "
            f"({where}) for {waits[k] * 1000:.1f} ms at most when stopped, which {cast.who(f.keys())} had not "
            f"joined yet: a collective in flight, no hang (a hang needs a wait of one liveness interval, "
            f"{interval:g} s)")
        rest.remove(f)
    return rest
