"""The ``lagging`` finding: a rank behind in its own work, its peers waiting for it.

Why: the commonest hang of an engine is not a dead rank but a live one that stopped in its own work (a hung data
loader, a lock, a slow or stuck kernel, a blocking read) while its peers wait for it inside the engine's next
collective. Every process runs on and writes ``alive`` records; only what those records name tells the ranks
apart. Two readings:

- :func:`engine_lag`: the peers' records name the engine's collective their main thread waits in
  (``engine_wait``), the lagging rank's name none its main thread waits in (a side thread's wait aside), for
  ``stalled.RUN`` records or more at one step each, overlapping in time. The lagging rank is at the waiters' step
  (it has not reached the collective yet) or below it (it finished the previous one and has not ended its step).
  Read like the network's stall: before the job is stopped, or after an operator's or scheduler's signals, which
  are then its consequences. Before this rule, a real job with one rank asleep in its own work read as healthy
  while it ran and as stopped from outside (``signalled``) once stopped (tests/test_inspect_lagging.py).
- :func:`step_lag`: traces without ``engine_wait`` (older writers, or an engine whose waits the liveness thread
  cannot see): every live rank's step stopped advancing and some stopped at a lower step. Read only where nothing
  else was found.
"""

from __future__ import annotations

from eplb_fsm.inspect.elastic import Cast, Key
from eplb_fsm.inspect.endings import waiting_text
from eplb_fsm.inspect.findings import Finding
from eplb_fsm.inspect.stalled import engine_run, waited_or_stopped

__all__ = ["engine_lag", "step_lag"]


def engine_lag(cast: Cast, at) -> tuple[float, Key, Finding] | None:
    """(ts the waits began, first culprit, finding) when every participant still running, or stopped by a signal or
    a failed wait since, either waits in one engine collective or is in its own work, as the module docstring says;
    else None."""
    parts = {k: s for k, s in cast.parts.items() if not s.ended_on_purpose}
    if cast.missing or len(parts) < 2 or not all(waited_or_stopped(s) for s in parts.values()):
        return None   # a rank without a trace may be the one they wait for
    waits = {k: r for k, s in parts.items() if (r := engine_run(s))}
    own = {k: r for k, s in parts.items() if (r := engine_run(s, waiting=False))}
    if not waits or not own or len(waits) + len(own) != len(parts):
        return None
    # the waiters sit in one collective (one step, op and call); the ranks in their own work at that step or below
    if len({(r[0], r[1], r[4]) for r in waits.values()}) > 1:
        return None
    step, op = next(iter(waits.values()))[:2]
    runs = waits | own
    if any(r[0] > step for r in own.values()) or max(r[2] for r in runs.values()) >= min(r[3] for r in runs.values()):
        return None
    behind, waiters = sorted(own), sorted(waits)
    low = min(own[k][0] for k in behind)
    began = min(r[2] for r in waits.values())
    lasted = max(r[3] for r in runs.values()) - began
    first, one = cast.parts[behind[0]], len(behind) == 1
    side = sorted({r[1] for r in own.values() if r[1]})
    where = (f"its main thread outside any collective; a side thread waits in {', '.join(side)}" if side
             else "in no collective of the engine's or the controller's")
    at_step = f"at step {low}" if all(own[k][0] == low for k in behind) else f"at steps {low}..{step}"
    summary = (f"{cast.who(behind)} {'has' if one else 'have'} been in {'its' if one else 'their'} own work {at_step} "
               f"in {first.alive[-1][2]} ({where}) for {lasted:.1f} s from {at(began)}, while {cast.who(waiters)} "
               f"waited for {'it' if one else 'them'} inside the engine's {op} at step {step}: alive, "
               f"{'its' if one else 'their'} step no longer advancing (a hung data loader, a lock, a slow or stuck "
               "kernel, a blocking read)")
    return began, behind[0], Finding.of(
        "lagging", low, behind, summary, state=first.alive[-1][2],
        ranks=[cast.position(k, "lagging" if k in own else "waiting",
                             f"alive at step {runs[k][0]}, " + (f"inside the engine's {op}" if k in waits else where),
                             runs[k][0], parts[k].alive[-1][2]) for k in sorted(runs)],
        details=["each rank's alive records say whether its main thread waits in a collective (engine_wait): the "
                 "waiters sit in the engine's, the lagging ranks in none",
                 "look at what the lagging ranks' main threads were doing: the stacks a signal end writes to stderr "
                 "(eplb_fsm.stop_signals), py-spy dump, the engine's own logs"],
    )


def step_lag(cast: Cast) -> Finding | None:
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
        f"({waiting_text(s)}) while "
        f"{cast.who(ahead)} wait at step {top}: alive, their steps no longer advance",
        state=s.alive[-1][2],
        ranks=[cast.position(k, "lagging" if k in behind else "waiting",
                             f"alive at step {stalled[k]}, {waiting_text(cast.parts[k])}", stalled[k])
               for k in sorted(stalled)],
    )
