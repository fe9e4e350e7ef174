"""Freezes: a rank silent while the others wrote (``liveness``), told as findings, and whether the job got past one.

Ranks stopped at once are one finding. A freeze is the cause of what failed after it only if the job did
not get past it: when every frozen rank, once it ran again, finished a collective it started after its
silence (no collective finishes without its peers), the job went on with it, and a death or crash after
that has causes of its own (a red team's real run: rank 2 SIGSTOPped 4 s, every rank then committed the
rearrangement, and rank 0 was SIGKILLed 0.1 s later; replay named the freeze, and charged the peers'
"connection reset" errors, which only a closed process causes, to it).
"""

from __future__ import annotations

from typing import Callable

from eplb_fsm.inspect.elastic import Cast, Key
from eplb_fsm.inspect.endings import entries
from eplb_fsm.inspect.findings import Finding

#: causes that a freeze the job got past does not explain (a later freeze or signal may still be its doing)
_OWN_CAUSES = ("rank_died", "crashed")
#: the findings of other checks that are such a cause when they come at the freeze's step or later
_LATER_CAUSES = ("hang", "collective_mismatch", "decision_divergence", "step_divergence", "illegal_transition")


def frozen_findings(cast: Cast, frozen: list[tuple], at: Callable, interval: Callable) -> list[tuple]:
    """Events (start, "frozen", key, Finding, end of the latest silence) of ``frozen`` silences ((start, key, end,
    step, state, layer), earliest first): those that began within 1.5 intervals of the first one (a live rank
    writes at least that often: ranks stopped at once) and overlap it are one finding; a rank stopped seconds
    later wrote on meanwhile, and is a freeze of its own."""
    out = []
    while frozen:
        a, k, b, step, state, layer = frozen[0]
        together = [f for f in frozen if f[0] - a <= 1.5 * interval(cast.parts[k]) and f[0] < b]
        frozen, keys = [f for f in frozen if f not in together], [f[1] for f in together]
        spans = sorted({f"{f[2] - f[0]:.1f}" for f in together}, key=float)   # each rank's own, shortest to longest
        until = max(f[2] for f in together)
        out.append((a, "frozen", k, Finding.of(
            "frozen", step, keys, f"{cast.who(keys)} froze for {' to '.join(dict.fromkeys([spans[0], spans[-1]]))}"
            f" s at step {step} in {state}" + (f", layer {layer}" if layer is not None else "") + " (SIGSTOP?): no "
            f"record from {at(a)} to {at(until)} while the other ranks kept writing",
            state=state, layer=layer,
            ranks=[cast.position(f[1], "frozen", f"silent {f[2] - f[0]:.1f} s from {at(f[0])}", *f[3:])
                   for f in together]), until))
    return out


def _went_on(cast: Cast, key: Key, since: float) -> bool:
    """``key`` finished a collective it started after ``since``."""
    return any(e.status == "ended" and type(e.ts) in (int, float) and e.ts >= since for e in entries(cast.parts[key]))


def survived_last(cast: Cast, events: list[tuple]) -> tuple[list[tuple], list[Finding]]:
    """``events`` (earliest first) as (ts, kind, key, Finding), each freeze the job got past moved behind a later
    death or crash (it stays a finding: it did happen); and the findings of every freeze the job got past
    (:func:`passed_last` applies the same rule to the findings that are no liveness event)."""
    passed = [e for e in events if e[1] == "frozen" and len(e) > 4
              and all(_went_on(cast, k, e[4]) for k in e[3].keys())]
    later = [e for e in passed if any(x[1] in _OWN_CAUSES and x[0] > e[4] for x in events)]
    ordered = [e for e in events if e not in later] + later
    return [e[:4] for e in ordered], [e[3] for e in passed]


def passed_last(causes: list[Finding], rest: list[Finding], passed: list[Finding]) -> tuple[list, list]:
    """``causes`` (liveness findings) and ``rest`` (the other findings), a freeze the job got past moved from the
    first to the end of the second when ``rest`` holds a cause at its step or later (a hang, a divergence: the
    job failed there, after it went on past the freeze)."""
    first = causes[0] if causes else None
    if first is None or not any(first is f for f in passed) or type(first.step) is not int or not any(
            x.kind in _LATER_CAUSES and type(x.step) is int and x.step >= first.step for x in rest):
        return causes, rest
    return causes[1:], rest + [first]
