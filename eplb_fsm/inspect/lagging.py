"""The ``lagging`` finding: a rank behind in its own work, its peers waiting for it.

Why: the commonest hang of an engine is not a dead rank but a live one that stopped in its own work (a hung data
loader, a lock, a slow or stuck kernel, a blocking read) while its peers wait for it inside the engine's next
collective. Every process runs on and writes ``alive`` records; only what those records name tells the ranks
apart. Two readings:

- :func:`engine_lag`: the peers' records name the engine's collective their main thread waits in
  (``engine_wait``), the lagging rank's name none its main thread waits in (a side thread's wait aside): the
  last ``engine_runs.RUN`` records or more of each, at one step, overlapping in time (``engine_runs.engine_run``).
  The peers on the controller's ranks wait in one collective; peers in a subgroup's (tensor parallel) may wait in
  theirs, at that step or the one before. The lagging rank is at the waiters' step (it has not reached the
  collective yet) or below it (it finished the previous one and has not ended its step). Not when the waits last no
  more than ``engine_runs.SLOW_FACTOR`` times the longest wait any rank got past, a warm-up aside
  (``engine_runs.longest_wait_before``), nor under ``engine_runs.LAG_MIN_S``: an idle server, a first checkpoint, a
  slow step look the same over seconds; those are held back as a warning. Read like the network's stall:
  before the job is stopped, or after an operator's or scheduler's signals, which are then its consequences.
  Before this rule, a real job with one rank asleep in its own work read as healthy while it ran and as stopped
  from outside (``signalled``) once stopped (tests/test_inspect_lagging.py). A rank blocked in a point-to-point call
  (``send``, ``recv``: ``main_wait`` names its peer) waits on that peer alone: followed, through other such waiters
  (a pipeline's stages), to a rank in its own work, which lags, each link within a step (stages drift apart a step a
  link); without a collective's waiters on the controller's ranks, only when every rank in its own work is reached
  so, ranks in other collectives beside them (a data-parallel pair's all-reduce, a broadcast) within a step of it. A
  rooted collective (``broadcast``) is a wait too, not own work. Not seen: waits on a handle (``work.wait()``,
  ``isend``/``irecv``), which ``engine_wait`` cannot see (every rank then looks in its own work).
- :func:`step_lag`: traces without ``engine_wait`` at their end (older writers, or an engine whose waits the
  liveness thread cannot see): every live rank's step stopped advancing and some stopped at a lower step. Read
  only where nothing else was found, and held back as a warning under the same floor (the lower ranks' stall,
  against twice the longest stall at one step any rank got past). Every rank at the lower step is named: the
  records cannot tell the stuck one from those waiting on it (a pipeline on ``isend``/``irecv`` handles).
"""

from __future__ import annotations

from eplb_fsm.inspect.elastic import Cast, Key
from eplb_fsm.inspect.endings import waiting_text
from eplb_fsm.inspect.findings import Finding
from eplb_fsm.inspect.engine_runs import (GAP, GAP_MIN_S, by_rank, engine_run, held_back, job_longest_wait,
                                          longest_wait_before, stopped_parts)

__all__ = ["engine_lag", "step_lag"]


def _reached(parts: dict, own: dict, pairs: dict) -> set | None:
    """The ranks in their own work that the point-to-point waiters of ``pairs`` wait for, following each one's peer
    through other such waiters (a pipeline's stages, each in recv from the one before), each link within one step
    (a pipeline's stages drift apart a step a link); None when a chain ends elsewhere: an unknown peer (a recv from
    any source), a peer in a collective, a cycle (a deadlock's), a peer steps away."""
    keys, runs, reached = by_rank(parts), own | pairs, set()
    for k in pairs:
        seen = {k}
        while k in pairs:
            peer, step = pairs[k].peer, pairs[k].step
            if (k := keys.get(peer)) is None or k in seen or k not in runs or abs(runs[k].step - step) > 1:
                return None
            seen.add(k)
        reached.add(k)
    return reached


def engine_lag(cast: Cast, at) -> tuple[float, Key, bool, Finding] | None:
    """(ts the waits began, first culprit, whether it is held back as too short: ``engine_runs.held_back``, finding)
    when every participant still running, or stopped by a signal or a failed wait since, either waits in an engine
    collective or a point-to-point call or is in its own work, as the module docstring says; else None."""
    if (parts := stopped_parts(cast)) is None:
        return None
    own = {k: r for k, s in parts.items() if (r := engine_run(s, "own"))}
    pairs = {k: r for k, s in parts.items() if k not in own and (r := engine_run(s, "p2p"))}
    # any other collective: the controller's ranks' own, a subgroup's, a rooted one (a red team's pipeline whose
    # stages also wait in a broadcast)
    waits = {k: r for k, s in parts.items() if k not in own and k not in pairs and (r := engine_run(s, "c10d"))}
    ours = {k: r for k in waits if (r := engine_run(parts[k], "ours"))}
    # the waiters on the controller's ranks sit in one collective (one step, op and call); the others, in a
    # subgroup's (a tensor-parallel group's: red teams'), at that step or the one before (a member of the lagging
    # rank's subgroup waits for it there while the ranks outside it went on to the next step's collective)
    if not own or len(own) + len(waits) + len(pairs) != len(parts) or len({r.step for r in ours.values()}) > 1 \
            or len({r.collective for r in ours.values()}) > 1 or not (ours or pairs):
        return None
    # a send or recv waits on its peer alone: followed to a rank in its own work; without a collective's waiters
    # on the controller's ranks, every such rank must be one a waiter waits for (else nothing ties it to the wait)
    if (reached := _reached(parts, own, pairs)) is None or (not ours and reached != set(own)):
        return None
    step = next(iter(ours.values())).step if ours else max(r.step for r in pairs.values())
    runs = waits | pairs | own
    # beside the controller's ranks' collective: at its step or the one before; beside send/recv chains alone:
    # within a step of the ranks in their own work (a data-parallel all-reduce beside a pipeline: a red team's)
    own_steps = [r.step for r in own.values()]
    lo, hi = (step - 1, step) if ours else (min(own_steps) - 1, max(own_steps) + 1)
    if any(not lo <= r.step <= hi for r in waits.values()) or (ours and any(r.step > step for r in own.values())) \
            or max(r.first for r in runs.values()) >= min(r.last for r in runs.values()):
        return None
    waiting = waits | pairs
    began = min(r.first for r in waiting.values())
    lasted = max(r.last - r.first for r in waiting.values())   # measured as the waits the job got past are
    # a job whose engine steps often take seconds is slow, not stuck, until a wait outlasts the ones it got past, on
    # any rank (red teams' 4 s steps, and checkpoints the ranks took in turn, read as lagging once stopped)
    before = job_longest_wait(parts, began)
    behind = sorted(own)
    low = min(own[k].step for k in behind)
    first, one = cast.parts[behind[0]], len(behind) == 1
    side = sorted({r.op for r in own.values() if r.op})
    where = (f"its main thread outside any collective; a side thread waits in {', '.join(side)}" if side
             else "in no collective of the engine's or the controller's")
    top = max(own[k].step for k in behind)
    at_step = f"at step {low}" if top == low else f"at steps {low}..{top}"
    summary = (f"{cast.who(behind)} {'has' if one else 'have'} been in {'its' if one else 'their'} own work {at_step} "
               f"in {first.alive[-1][2]} ({where}) for {lasted:.1f} s from {at(began)}, while "
               f"{_waiters_text(cast, ours, waits, pairs, step, 'it' if one else 'them')}: alive, "
               f"{'its' if one else 'their'} step no longer advancing (a hung data loader, a lock, a slow or stuck "
               "kernel, a blocking read; or a server's rank waiting for requests while the others wait in the "
               "collective, which reads the same)" + (f"; the longest wait the job got past before: {before:.1f} s"
                                                     if before else ""))
    return began, behind[0], held_back(lasted, before), Finding.of(
        "lagging", low, behind, summary, state=first.alive[-1][2],
        ranks=[cast.position(k, "lagging" if k in own else "waiting",
                             f"alive at step {r.step}, " + (f"inside the engine's {r.text}" if k in waits | pairs
                                                            else where),
                             r.step, parts[k].alive[-1][2]) for k, r in sorted(runs.items())],
        details=["each rank's alive records say whether its main thread waits in a collective (engine_wait, or "
                 "main_wait: a rooted one, a send or recv with its peer): the waiters sit in the engine's, the "
                 "lagging ranks in none",
                 "look at what the lagging ranks' main threads were doing: the stacks a signal end writes to stderr "
                 "(eplb_fsm.stop_signals), py-spy dump, the engine's own logs"],
    )


def _waiters_text(cast: Cast, ours: dict, waits: dict, pairs: dict, step: int, them: str) -> str:
    """Who waited for the lagging ranks, and in what: the collective of the controller's ranks, the subgroups',
    the point-to-point calls."""
    parts = []
    if ours:
        r = next(iter(ours.values()))
        parts.append(f"{cast.who(sorted(ours))} waited for {them} inside the engine's "
                     f"{r.op} at step {step}")
    if sub := sorted(k for k in waits if k not in ours):
        lead = "" if parts else f"waited for {them} "
        parts.append(f"{cast.who(sub)} {lead}inside other collectives of the engine's "
                     f"({', '.join(sorted({waits[k].text for k in sub}))})")
    for text in sorted({r.text for r in pairs.values()}):
        keys = sorted(k for k, r in pairs.items() if r.text == text)
        parts.append(f"{cast.who(keys)} {'' if parts else f'waited for {them} '}inside the engine's {text} at step "
                     f"{pairs[keys[0]].step}")
    return ", and ".join(parts)


def step_lag(cast: Cast) -> tuple[bool, Finding] | None:
    """(whether it is held back as too short: ``engine_runs.held_back``, finding) when every live rank stalled (alive,
    step fixed) and some at a lower step: those lag, the others wait. Only in traces that name no engine wait at the
    end (where they do, :func:`engine_lag` reads it). Held back like it: the lower ranks' stall under
    ``engine_runs.LAG_MIN_S``, or no longer than twice the longest stall at one step any rank got past (a red team's
    healthy pipeline on ``isend``/``irecv`` handles, its slow stage 6 s a step, read lagging)."""
    if any(a[4] or a[5] for s in cast.parts.values() for a in s.alive[-3:]):
        return None
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
    began = {k: _stall_began(cast.parts[k]) for k in behind}
    lasted = max(cast.parts[k].alive[-1][0] - began[k] for k in behind)
    before = max(longest_wait_before(cast.parts[k], min(began.values()), inside_only=False) for k in stalled)
    return held_back(lasted, before), Finding.of(
        "lagging", low, behind,
        f"{cast.who(behind)} {'lags' if len(behind) == 1 else 'lag'} at step {low} in {s.alive[-1][2]} "
        f"({waiting_text(s)}) while "
        f"{cast.who(ahead)} {'waits' if len(ahead) == 1 else 'wait'} at step {top}: alive, their steps no longer "
        f"advance (for {lasted:.1f} s)",
        state=s.alive[-1][2],
        ranks=[cast.position(k, "lagging" if k in behind else "waiting",
                             f"alive at step {stalled[k]}, {waiting_text(cast.parts[k])}", stalled[k])
               for k in sorted(stalled)],
    )


def _stall_began(s) -> float:
    """The ts of the first of ``s``'s last alive records at its last alive step, none more than a gap apart."""
    i = len(s.alive) - 1
    while i > 0 and s.alive[i - 1][1] == s.alive[-1][1] and s.alive[i][0] - s.alive[i - 1][0] <= \
            max(GAP * (s.alive_interval or 1.0), GAP_MIN_S):
        i -= 1
    return s.alive[i][0]
