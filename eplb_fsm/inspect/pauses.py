"""Replay: a pause of the whole job is no freeze of one rank.

A SIGSTOP to every process of the job at once (a suspended host or VM alike), then SIGCONT, leaves every rank
silent over one window, and the first rank to resume writes a fraction of a ms inside the others' silences.
That is no freeze of one rank: ``liveness`` asks :func:`silent_over` whether a peer that wrote inside a silence
was silent over it itself (but for one interval), and :func:`all_silent` whether every participant that ran over
it was; :func:`pause_warnings` words each such window as a warning (no culprit). The waits that ran out across it
(the clocks ran on, the ranks stood still) are its consequences: a rank that came to a collective late only by
the paused time is no late rank (:func:`paused_late`).
"""

from __future__ import annotations

from eplb_fsm.inspect.elastic import Cast, Key
from eplb_fsm.inspect.findings import Finding

__all__ = ["all_silent", "pause_warnings", "paused_late", "silent_over"]


def silent_over(o, a: float, b: float, margin: float) -> bool:
    """Whether participant ``o``'s own long silences (``RankSummary.silences``) cover the window (a, b) but for at
    most ``margin`` s."""
    covered = sum(max(0.0, min(y, b) - max(x, a)) for x, y, *_ in o.silences)
    return covered >= (b - a) - margin


def all_silent(cast: Cast, key: Key, a: float, b: float, margin: float) -> bool:
    """Whether every other participant that ran over ``key``'s silence (a, b) (started by ``a``, wrote at or after
    ``b``) was silent over it too, but for ``margin`` s at most, and there is at least one: the job was paused."""
    spanning = [o for k, o in cast.parts.items() if k != key and type(o.last_ts) in (int, float) and o.last_ts >= b
                and not (type(start := (o.header or {}).get("ts")) in (int, float) and start > a)]
    return bool(spanning) and all(silent_over(o, a, b, margin) for o in spanning)


def pause_warnings(cast: Cast, paused: list[tuple], at) -> tuple[list[str], list[tuple]]:
    """One warning and one (from ts, to ts) window per stretch the whole job was silent over (``paused``:
    ((from, to, step, state, layer), key) per participant's silence; overlapping ones are one window)."""
    windows: list[list] = []
    for (a, b, step, state, layer), k in sorted(paused, key=lambda p: (p[0][0], p[1])):
        if windows and a <= windows[-1][1]:
            windows[-1][1] = max(windows[-1][1], b)
            windows[-1][2].append(k)
        else:
            windows.append([a, b, [k], step, state, layer])
    return [f"{cast.who(keys)} {'were all' if len(set(keys)) > 1 else 'was'} silent from {at(a)} to {at(b)} "
            f"({b - a:.1f} s, at step {step} in {state}" + (f", layer {layer}" if layer is not None else "")
            + "): the whole job was paused (SIGSTOP to every process, a suspended host or VM), no rank froze alone; "
            "a collective or scale that timed out right after is its consequence"
            for a, b, keys, step, state, layer in windows], [(w[0], w[1]) for w in windows]


def paused_late(f: Finding, cast: Cast, windows: list[tuple], noise: float) -> bool:
    """Whether ``f`` is a ``lagging`` finding (a rank late to a collective that then failed) whose lateness a pause
    of the whole job explains: every late rank started the collective no more than ``noise`` s later than the
    first rank did, once the pause windows between the two starts are taken off (their clocks ran on, the ranks
    stood still, and the first rank's wait ran out on resuming)."""
    coll = f.collective or {}
    if f.kind != "lagging" or not windows or not coll:
        return False
    starts = {k: e.ts for k in (f.members or f.keys()) if k in cast.parts
              and (e := cast.parts[k].collectives.get(coll.get("group"), {}).get(coll.get("cseq"))) is not None
              and type(e.ts) in (int, float)}
    if not starts or any(k not in starts for k in f.keys()):
        return False
    first = min(starts.values())
    return all(starts[k] - first - sum(max(0.0, min(b, starts[k]) - max(a, first)) for a, b in windows) <= noise
               for k in f.keys())
