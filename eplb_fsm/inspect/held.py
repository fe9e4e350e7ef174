"""A rank whose trace stops while a peer's wait on it stayed unbroken: frozen for good, not dead.

Gloo, the backend of a controller on CPU weights (the header's ``device`` is ``cpu``), joins every pair of
ranks by a socket. When a process ends, in order or by SIGKILL, the kernel closes its sockets, and a
peer that waits on it in a collective fails at once with a lost connection (``endings.CONNECTION_LOST``,
read per rank by ``dropped.Dropped``). A rank without an ``end`` whose last record is older than a live
rank's liveness thread ever stays silent, while a peer still waited on it in a controller collective with
nothing broken, was therefore a process then that ran no Python: stopped (SIGSTOP, never continued) or
inside a C call that holds the GIL (its liveness thread cannot run either). It never wrote again, and its
launcher killed it later (torchrun SIGKILLs a worker that outlives its grace, 30 s by default,
``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``) or it is stopped still. ``liveness`` names it ``frozen`` (for good)
instead of ``rank_died``, with the wait that shows it (a red team's torchrun runs: a worker SIGSTOPped in a
transfer, then the job stopped, read "died (SIGKILL?)").

The evidence, from one peer ``P`` of the silent rank ``K`` (:func:`held_open`): a collective ``C`` of ``P``'s,
not a posted one (async ready flags are read back later, nobody waits in them),

- of a group ``K`` belongs to, and, for a point-to-point batch, with ``K`` among its ``peers`` (a batch
  with other partners waits on them, not on ``K``); for any other op every member but ``K`` started it (a
  rank outside it would be the one waited on, and whoever receives from ``K`` was inside, where a closed
  socket would have shown);
- that ``P`` was inside, unbroken, at a time past ``K``'s last record by more than ``limit`` (the frozen
  limit, ``liveness.FROZEN_FACTOR`` intervals and at least 2 s: a live rank writes every 1.5 intervals):
  still open at ``P``'s end (a signal, its launcher's stop) or last record, or ended by a wait that ran
  out (a timeout, no lost connection);
- and no member of the group lost its connection to anyone at or after ``K``'s last record.

``K`` needs liveness records (a writer without them is silent whenever nothing happens) and no failed
write (its own lines may be what was lost, ``signal_death.lost_writes``). On NCCL (``device`` not cpu) a
peer waits on a dead rank as on a frozen one, until the watchdog's timeout: no claim there, and the rank
stays ``rank_died``, whose detail says that a process frozen for good looks the same.
"""

from __future__ import annotations

from typing import Callable

from eplb_fsm.inspect.dropped import Dropped
from eplb_fsm.inspect.elastic import Cast, Key
from eplb_fsm.inspect.endings import CONNECTION_LOST, entries
from eplb_fsm.inspect.findings import Finding, coll_text
from eplb_fsm.inspect.model import Collective
from eplb_fsm.inspect.signal_death import lost_writes

__all__ = ["held_open", "held_findings"]

Held = tuple  # (peer, collective, ts): the peer was inside the collective, unbroken, at ts


def _on_gloo(s) -> bool:
    return (s.header or {}).get("device") == "cpu"


def _inside_until(s, c: Collective) -> float | None:
    """When the participant was last known inside ``c`` with nothing broken, or None (it ended, or broke)."""
    if c.posted or type(c.ts) not in (int, float):
        return None
    if c.status == "error":   # a wait that ran out kept the connection; a lost one says the peer went
        lost = CONNECTION_LOST.search(str(c.error or ""))
        return c.error_ts if not lost and type(c.error_ts) in (int, float) else None
    if c.status != "open" or CONNECTION_LOST.search(str((s.end or {}).get("error") or "")):
        return None
    end = (s.end or {}).get("ts")
    return end if type(end) in (int, float) else s.last_ts


def _waits_on(cast: Cast, key: Key, c: Collective) -> bool:
    """``c`` cannot finish without ``key``: ``key`` is a partner of the batch, or every other member joined it."""
    members = cast.members(c.group)
    if key not in members:
        return False
    if isinstance(c.peers, list):
        ordered = cast.generation_of(c.group) is not None   # members are listed by group rank then
        return ordered and members.index(key) in c.peers
    return all(m == key or (m in cast.parts and c.cseq in cast.parts[m].collectives.get(c.group, {}))
               for m in members)


def _broken(cast: Cast, dropped: Dropped, since: float, until: float) -> bool:
    """Some rank lost a connection between ``since`` and ``until``: a collective's error, or an ``end``'s."""
    if any(since <= ts <= until for ts, _, _ in dropped.errors):
        return True
    return any(type(ts := (s.end or {}).get("ts")) in (int, float) and since <= ts <= until
               and CONNECTION_LOST.search(str(s.end.get("error") or "")) for s in cast.parts.values())


def held_open(cast: Cast, key: Key, dropped: Dropped, limit: float) -> Held | None:
    """The wait that shows ``key`` (no ``end``) was a live process, silent, past ``limit`` seconds after its last
    record: (peer, collective, ts), the latest such ts; None when nothing shows it (see the module docstring)."""
    s = cast.parts[key]
    last = s.last_ts
    if s.end is not None or not s.alive or lost_writes(s) or type(last) not in (int, float) or not _on_gloo(s):
        return None
    found = [(peer, c, ts) for peer, p in cast.parts.items() if peer != key and _on_gloo(p) for c in entries(p)
             if (ts := _inside_until(p, c)) is not None and ts - last > limit and _waits_on(cast, key, c)]
    # the longest wait that nothing broke before its end (a peer's exit after it closes sockets in turn)
    return max((h for h in found if not _broken(cast, dropped, last, h[2])), key=lambda h: h[2], default=None)


def held_findings(cast: Cast, held: list[tuple], at: Callable, interval: Callable) -> list[tuple]:
    """Events (last ts, "frozen", key, Finding) for ``held`` ((last ts, key, Held), earliest first): ranks whose
    last records lie within 1.5 intervals of the first one's froze together, as one finding."""
    out = []
    while held:
        first, k, (peer, c, ts) = held[0]
        together = [h for h in held if h[0] - first <= 1.5 * interval(cast.parts[k])]
        held = held[len(together):]
        keys = [h[1] for h in together]
        s = cast.parts[k]
        where = f" at step {s.last_step} in {s.final_state}" + (
            f", layer {s.final_layer}" if s.final_layer is not None and s.final_state == "transferring" else "")
        out.append((first, "frozen", k, Finding.of(
            "frozen", s.last_step, keys,
            f"{cast.who(keys)} froze for good{where} (SIGSTOP, or a C call holding the GIL?): no record after "
            f"{at(first)}, while {cast.label(peer)} waited on {'them' if len(keys) > 1 else 'it'} in {coll_text(c)} "
            f"{'until its wait ran out at' if c.status == 'error' else 'until'} {at(ts)}, {ts - first:.1f} s later, "
            "with nothing broken (on gloo a process that ends closes "
            "its sockets, and its peers' waits fail at once); no end record: killed later, or stopped still",
            state=s.final_state, layer=s.final_layer,
            ranks=[cast.position(h[1], "frozen", f"silent from {at(h[0])} on, a process still at {at(h[2][2])}",
                                 cast.parts[h[1]].last_step, cast.parts[h[1]].final_state,
                                 cast.parts[h[1]].final_layer) for h in together]), ts))
    return [e[:4] for e in out]
