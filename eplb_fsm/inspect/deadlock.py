"""A deadlock of the engine's: every rank waits inside a collective of the engine's, and they are not one.

Why: an engine whose ranks took different branches (one all-gathers where the others all-reduce, or all-reduces on
another group of the same ranks) hangs with every process alive, each main thread inside a collective that no peer
joins. The controller traces none of those, so only the ``alive`` records tell it: each names the collective its
main thread waits in (``engine_wait``: op, and ``engine_wait_call``: group and tensor shape). A red team's real
4-rank runs of both shapes read as healthy while they hung and as stopped from outside (``signalled``) once stopped.

:func:`engine_deadlock` reads ``collective_mismatch`` when every participant's last ``engine_runs.RUN`` or more
alive records wait so (``engine_runs.engine_run``) at one step, overlapping in time, in more than one (op, call). A
blocking ``send`` or ``recv`` counts too (``main_wait`` names its peer), as one call with the recv or send that
meets it: ranks each in recv from the other are a cycle of such waits (a tie), and a send and recv that meet, still
stuck, are no mismatch at all. Ranks all in sends and recvs are read only when their peers, followed, close a cycle
(each link within a step: a pipeline's stages drift apart), not a chain that ends outside the traced ranks. The
ranks off the largest share are the culprits; in a tie every rank is, undecided. Signals and failed waits after it
are its consequences, as for the network's stall. Held back as a warning under ``engine_runs.LAG_MIN_S``, or while
no longer than twice the longest wait the job got past: a slow peer or a side thread's late root leave the same
records for seconds. Ranks at two steps in one op are the network's (``network_stall``), which reads them first.
"""

from __future__ import annotations

from collections import Counter

from eplb_fsm.inspect.elastic import Cast, Key
from eplb_fsm.inspect.findings import Finding
from eplb_fsm.inspect.engine_runs import by_rank, engine_run, held_back, job_longest_wait, stopped_parts

__all__ = ["engine_deadlock"]


def _call_of(k: Key, r) -> tuple:
    """Which call a rank waits in, alike on every rank of one call: a collective's (``Run.collective``), or for a
    send or recv ``("p2p", sender, receiver, call)``, which a send and the recv it meets share (two ranks each in
    recv from the other do not: a cycle of point-to-point waits)."""
    if not r.p2p:
        return r.collective
    return ("p2p", k[0], r.peer, r.call) if r.op == "send" else ("p2p", r.peer, k[0], r.call)


def _cycles(runs: dict) -> set | None:
    """The ranks on a cycle of sends and recvs when every rank's, its peer followed from rank to rank (each within a
    step of the one before), comes back to a rank already passed (on a cycle, or leading into one: those only
    wait); else None."""
    keys, on = by_rank(runs), set()
    if len(keys) != len(runs):
        return None
    for k in runs:
        seen = [k]
        while True:
            r = runs[k]
            if (k := keys.get(r.peer)) is None or abs(runs[k].step - r.step) > 1:
                return None
            if k in seen:
                on |= set(seen[seen.index(k):])
                break
            seen.append(k)
    return on


def engine_deadlock(cast: Cast, at) -> tuple[float, Key, bool, Finding] | None:
    """(ts the waits began, first culprit, whether it is held back as too short: ``engine_runs.held_back``, finding)
    when every participant still running, or stopped by a signal or a failed wait since, waits inside an engine
    collective at one step and they differ, as the module docstring says; else None."""
    if (parts := stopped_parts(cast)) is None:
        return None
    runs = {k: engine_run(s, "c10d") for k, s in parts.items()}
    if any(r is None for r in runs.values()):
        return None
    coll = {r.step for r in runs.values() if not r.p2p}
    # the collectives' waiters at one step, a send or recv within a step of it; send/recv alone only when their
    # peers close a cycle, a step at most from link to link (a pipeline's stages drift apart: a red team's stage in
    # recv from the wrong peer), not a chain that ends outside the traced ranks (a controller on a subgroup)
    if len(coll) > 1 or (coll and any(abs(r.step - min(coll)) > 1 for r in runs.values())) \
            or (not coll and (cycle := _cycles(runs)) is None):
        return None
    if max(r.first for r in runs.values()) >= min(r.last for r in runs.values()):
        return None   # not waiting at the same time
    key = {k: _call_of(k, r) for k, r in runs.items()}
    calls = Counter(key.values())
    # a send and the recv it meets, both stuck: no mismatch of calls (a link's stall, or the bytes are moving)
    if len(calls) < 2 or any(c[0] == "p2p" and None not in c[1:3] and n == 2 for c, n in calls.items()):
        return None
    top = calls.most_common()
    # in a subgroup's collective the members outside it, whom its waiters wait for, may be in the majority's (a red
    # team's tensor-parallel rank that skipped its pair's all-reduce): the traces cannot tell who left which
    tie = top[0][1] == top[1][1] or not all(r.ours for r in runs.values())
    odd = sorted(runs) if tie else sorted(k for k in runs if key[k] != top[0][0])
    if not coll:   # sends and recvs alone: the ranks on the cycle, each as much at fault; the others feed it
        tie, odd = True, sorted(cycle)
    text = {key[k]: r.text for k, r in runs.items()}
    step, began = min(coll or {r.step for r in runs.values()}), min(r.first for r in runs.values())
    steps = sorted({r.step for r in runs.values()})
    at_steps = f"step {step}" if len(steps) == 1 else f"steps {steps[0]}..{steps[-1]}"
    lasted = max(r.last - r.first for r in runs.values())
    # a side thread's late root, a slow peer: ranks may sit in different collectives for seconds and go on (a red
    # team's rank 0 whose control thread broadcast a config 7 s late)
    before = job_longest_wait(parts, began)
    by_call = "; ".join(f"{cast.who(sorted(k for k in runs if key[k] == c))} in {text[c]}" for c, _ in top)
    summary = (f"every rank has waited inside a collective of the engine's at {at_steps} for {lasted:.1f} s from "
               f"{at(began)}, and not in one: {by_call}. None completes without every rank of its group"
               + (", a send or recv without its peer's matching call" if any(r.p2p for r in runs.values()) else "")
               + " (the engine's ranks issued different collectives: a deadlock of the engine's)"
               + ("" if all(r.ours for r in runs.values()) else
                  "; some wait in a subgroup's collective, whose missing members may sit in another (or that "
                  "subgroup's link stalled)")
               + (", a tie, undecided" if tie else f"; {cast.who(odd)} left the others' {text[top[0][0]]}"))
    first = parts[odd[0]]
    return began, odd[0], held_back(lasted, before), Finding.of(
        "collective_mismatch", step, odd, summary, state=first.alive[-1][2],
        ranks=[cast.position(k, "mismatch" if k in odd else "waiting", f"alive, inside the engine's {r.text}",
                             r.step, parts[k].alive[-1][2]) for k, r in sorted(runs.items())],
        details=["each rank's alive records name the collective its main thread waits in (engine_wait, "
                 "engine_wait_call: group and tensor shape); the engine's own collectives are not traced",
                 "look at the branch that sent the named ranks' engines to another collective: the stacks a signal "
                 "end writes to stderr (eplb_fsm.stop_signals), py-spy dump"],
    )
