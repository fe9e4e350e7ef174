"""The ``network`` finding: a collective every member joined stopped delivering, with every rank alive.

Why: a link that drops packets (a NIC, cable or switch going bad, a firewall dropping a flow) leaves every
process running and every member inside the engine's collective, each writing ``alive`` records that name
that collective (``engine_wait``). Read by the lagging rule, the member still inside it looked like a rank
behind its peers; read after the operator's Ctrl-C, like a job stopped from outside with nothing wrong. A
real link dropped between two of four gloo ranks (tests/test_real_failures_network.py) leaves one of two
shapes, and this module reads both:

- some members finished the collective and wait in the next one, a step further, while the others are still
  inside it: the finishers sent their part, and it never arrived (the finding names the members still inside:
  one of their links is the broken one);
- every member is inside the collective at the same step: none finished (the finding names them all).

What makes it the transport and not a rank: no member is computing (the last ``RUN`` or more alive records of each
name the engine's collective on the controller's ranks), none is in a controller collective (``waiting_on``),
none is silent (that is ``frozen``), every rank has a trace (an untraced one may be
the one missing from the collective), none ended other than by a signal from outside (a wait that failed or a
crash has rules of its own), and the stalls overlap in time. A rank that lags in its own work has no
``engine_wait`` in its records and stays ``lagging``.
"""

from __future__ import annotations

from eplb_fsm.inspect.elastic import Cast, Key
from eplb_fsm.inspect.findings import Finding

__all__ = ["RUN", "network_stall"]

RUN = 3   # alive records in a row at one step, each inside the engine's collective: a wait, not a slow beat


def _stalled_run(s) -> tuple[int, str, float, float] | None:
    """(step, op, first ts, last ts) of ``s``'s last alive records that share one step and each name an engine
    collective on the controller's ranks and no controller collective, when there are ``RUN`` or more; else None."""
    def inside(a) -> bool:
        return not a[3] and bool(a[4]) and a[4][1] and type(a[0]) in (int, float) and a[1] == s.alive[-1][1]

    if type(s.alive[-1][1] if s.alive else None) is not int:
        return None
    n = 0
    while n < len(s.alive) and inside(s.alive[-1 - n]):
        n += 1
    if n < RUN:
        return None
    return s.alive[-1][1], s.alive[-1][4][0], s.alive[-n][0], s.alive[-1][0]


def network_stall(cast: Cast, at) -> tuple[float, Key, Finding] | None:
    """(ts the stall began, first culprit, finding) when every participant still running, or stopped by a
    signal since, sat inside the engine's collective as the module docstring says; else None."""
    parts = {k: s for k, s in cast.parts.items() if not s.ended_on_purpose}
    if cast.missing:
        return None   # a rank without a trace may be the one not in the collective
    if len(parts) < 2 or any((s.end or {}).get("how") not in (None, "signal") for s in parts.values()):
        return None
    runs = {k: _stalled_run(s) for k, s in parts.items()}
    if any(r is None for r in runs.values()):
        return None
    steps = {r[0] for r in runs.values()}
    low, top = min(steps), max(steps)
    began, overlap_end = min(r[2] for r in runs.values()), min(r[3] for r in runs.values())
    if top - low > 1 or max(r[2] for r in runs.values()) >= overlap_end:
        return None   # more than one collective apart, or not stalled at the same time
    inside = sorted(k for k, r in runs.items() if r[0] == low)
    ahead = sorted(k for k in runs if k not in inside)
    op, s = runs[inside[0]][1], parts[inside[0]]
    lasted = max(r[3] for r in runs.values()) - began
    clean = "none computing, silent or in a controller collective"
    if ahead:
        summary = (f"{cast.who(inside)} {'is' if len(inside) == 1 else 'are'} still inside the engine's {op} at step "
                   f"{low}, which {cast.who(ahead)} finished (they wait in the next one, at step {top}), for "
                   f"{lasted:.1f} s from {at(began)}: what the finishers sent never arrived. The transport between "
                   f"{cast.who(inside)} and a peer stalled (a link, NIC or switch dropping packets, a firewall), "
                   f"not a rank: every rank is alive, {clean}")
    else:
        summary = (f"{cast.who(inside)} have all been inside the engine's {op} at step {low} for {lasted:.1f} s "
                   f"from {at(began)}, and none finished it: the transport between them stalled (a link, NIC or "
                   f"switch dropping packets, a firewall), or a rank is stuck inside the collective's own code; "
                   f"every rank is alive, {clean}")
    return began, inside[0], Finding.of(
        "network", low, inside, summary, state=s.alive[-1][2],
        ranks=[cast.position(k, "inside" if k in inside else "waiting",
                             f"alive, inside the engine's {runs[k][1]} at step {runs[k][0]} (last at {at(runs[k][3])})",
                             runs[k][0], parts[k].alive[-1][2]) for k in sorted(runs)],
        details=["each rank's alive records name the engine's collective it waits in (engine_wait): a rank still "
                 "inside one its peers finished waits for their data, it is not behind in its own work",
                 "look at the network of the named ranks' hosts and their peers' (link and NIC error counters, "
                 "dmesg, the switch); a collective only they issued reads the same"],
    )
