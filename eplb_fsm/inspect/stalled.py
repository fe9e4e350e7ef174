"""The ``network`` finding: the transport between live ranks stopped delivering, or was torn down under them.

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

What makes it the transport and not a rank: no member is computing (the last ``engine_runs.RUN`` or more alive
records of each name the engine's collective on the controller's ranks, from the main thread, every rank in one op
and the ranks at one step in one call: one group, one shape, or one group for an all-to-all), none is in a
controller collective (``waiting_on``; but posted ready flags, read back later, hold nobody), none is silent
(that is ``frozen``), every rank has a trace (an untraced one may be the one missing from the collective), none
ended other than by a signal from outside or by a wait that failed after its stall (a bounded wait that ran out,
gloo then closing the group's pairs under every other wait: the stall's consequences; a crash has rules of its
own), and the stalls overlap in time. A rank that lags in its own work has no ``engine_wait`` from its main thread
and stays ``lagging``. Held back as a warning while the stall lasted under ``engine_runs.LAG_MIN_S``, or no longer
than twice the longest wait the job got past: a big collective of a healthy job holds every rank for seconds too.

One more shape comes without ``engine_wait`` (an engine that waits on a handle, ``work.wait(timeout)``, which the
liveness thread cannot see) and ends with every rank's exception, nothing else explaining them
(:func:`lost_together`, read only where the replay would otherwise name the first exception ``crashed``): the
first two waits to fail lost their connection (``CONNECTION_LOST``) within ``PAIR_S``, one or both torn down
(``RESET``; the other end may read a close), as ``ss -K`` or a reset link on ranks 1-2 left in a red team's runs
(7 of 7) and in this project's tests. Those two lost their connection to each other while alive (with any other
torn down within ``SAME_MOMENT_S`` of the second: every connection reset at once); the ranks that failed after them
lost theirs when those exited. Waits that all ran out together are not read so: a late rank, a deadlock of the
engine's or a paused job end the same way (a red team's real runs, 6 of 6).
"""

from __future__ import annotations

import re
from itertools import takewhile

from eplb_fsm.inspect.elastic import Cast, Key
from eplb_fsm.inspect.engine_runs import engine_run, held_back, job_longest_wait, stopped_parts
from eplb_fsm.inspect.endings import CONNECTION_LOST
from eplb_fsm.inspect.findings import Finding, short_error

__all__ = ["RESET", "lost_together", "network_stall"]

# a connection torn down under a live rank (an RST, or the socket destroyed), not closed by a peer that exited
RESET = re.compile(r"Connection reset by peer|Software caused connection abort", re.I)
PAIR_S = 0.1   # the other end of a reset connection fails with it: woken by the RST, not by a timeout
SAME_MOMENT_S = 0.01   # a third reset this close to the second is one event with them, not a peer's exit


def network_stall(cast: Cast, at) -> tuple[float, Key, bool, Finding] | None:
    """(ts the stall began, first culprit, whether it is held back as too short: ``engine_runs.held_back``, finding)
    when every participant still running, or stopped by a signal or a failed wait since, sat inside the engine's
    collective as the module docstring says; else None."""
    if (parts := stopped_parts(cast)) is None:
        return None
    runs = {k: engine_run(s) for k, s in parts.items()}
    if any(r is None for r in runs.values()):
        return None
    steps = {r.step for r in runs.values()}
    low, top = min(steps), max(steps)
    began, overlap_end = min(r.first for r in runs.values()), min(r.last for r in runs.values())
    if top - low > 1 or max(r.first for r in runs.values()) >= overlap_end:
        return None   # more than one collective apart, or not stalled at the same time
    # ranks in different ops, or at one step in calls of other groups or shapes, wait in different collectives: a
    # deadlock of the engine's (a red team's all_reduce against all_gather, or on two groups of the same ranks)
    if len({r.op for r in runs.values()}) > 1 or any(
            len({r.collective for r in runs.values() if r.step == step and r.call}) > 1 for step in steps):
        return None
    inside = sorted(k for k, r in runs.items() if r.step == low)
    ahead = sorted(k for k in runs if k not in inside)
    op, s = runs[inside[0]].op, parts[inside[0]]
    lasted = max(r.last for r in runs.values()) - began
    # a big collective of a healthy job holds every rank for seconds too (as a lag or a deadlock of the engine's)
    held = held_back(max(r.last - r.first for r in runs.values()), job_longest_wait(parts, began))
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
    return began, inside[0], held, Finding.of(
        "network", low, inside, summary, state=s.alive[-1][2],
        ranks=[cast.position(k, "inside" if k in inside else "waiting",
                             f"alive, inside the engine's {runs[k].op} at step {runs[k].step} "
                             f"(last at {at(runs[k].last)})",
                             runs[k].step, parts[k].alive[-1][2]) for k in sorted(runs)],
        details=["each rank's alive records name the engine's collective it waits in (engine_wait): a rank still "
                 "inside one its peers finished waits for their data, it is not behind in its own work",
                 "look at the network of the named ranks' hosts and their peers' (link and NIC error counters, "
                 "dmesg, the switch); a collective only they issued reads the same"],
    )


def lost_together(cast: Cast, failed: list[tuple[float, Key]], at) -> Finding | None:
    """``network`` when every participant ended with a failed wait (``failed``: (ts, key), earliest first, every one
    of them) and the first two are a connection reset under live ranks, as the module docstring says; else None."""
    parts = {k for k, s in cast.parts.items() if not s.ended_on_purpose}
    if cast.missing or len(failed) < 2 or {k for _, k in failed} != parts:
        return None
    errors = [str(cast.parts[k].end.get("error") or "") for _, k in failed]
    t0, label = failed[0][0], cast.label
    if all(CONNECTION_LOST.search(e) for e in errors[:2]) and any(RESET.search(e) for e in errors[:2]) \
            and failed[1][0] - t0 <= PAIR_S:
        # torn down with them, not after their exits: one moment (a red team's ss -K of every connection: 0.7 ms)
        torn = 2 + sum(1 for _ in takewhile(lambda i: RESET.search(errors[i]) and failed[i][0] - failed[1][0]
                                           <= SAME_MOMENT_S, range(2, len(failed))))
        pair, later = sorted(k for _, k in failed[:torn]), sorted(k for _, k in failed[torn:])
        whom = "their connection to each other" if torn == 2 else "their connections at one moment"
        return _lost(cast, pair, failed[0][1],
                     f"{cast.who(pair)} lost {whom} at {at(t0)}: their waits were torn down "
                     f"within {(failed[torn - 1][0] - t0) * 1e3:.1f} ms ({label(failed[0][1])}: "
                     f"{short_error(errors[0])}; {label(failed[1][1])}: {short_error(errors[1])}) while no rank had "
                     "died, frozen, crashed or closed" + (f", and {cast.who(later)} failed after them, as they exited"
                                                          if later else "")
                     + ": a connection between live ranks was reset (the network: a link, a firewall or NAT dropping "
                     "the flow), or by a process outside the traces")
    return None


def _lost(cast: Cast, keys: list[Key], first: Key, summary: str) -> Finding:
    s = cast.parts[first]
    step = s.end.get("step", s.last_step)
    return Finding.of("network", step, keys, summary, state=s.end.get("state"),
                      ranks=[cast.position(k, "lost", short_error(cast.parts[k].end.get("error")),
                                           cast.parts[k].end.get("step"), cast.parts[k].end.get("state"))
                             for k in keys])
