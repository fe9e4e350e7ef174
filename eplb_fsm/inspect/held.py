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
a posted one (async ready flags) only when its wait ran out as it was read back (open, nobody may wait in it;
a red team's async ranks SIGSTOPped for good read "died" while their peers' read-backs timed out),

- of a group ``K`` belongs to: for a point-to-point batch, one with ``K`` among its ``peers`` whose other
  partners all started it (a partner still outside may be the one waited on: ``K``'s part may be done);
  for any other op, one every member but ``K`` started (a rank outside it would be the one waited on, and
  whoever receives from ``K`` was inside, where a closed socket would have shown);
- that ``P`` was inside, unbroken, at a time past ``K``'s last record by more than ``limit`` (the frozen
  limit, ``liveness.FROZEN_FACTOR`` intervals and at least 2 s: a live rank writes every 1.5 intervals):
  still open at ``P``'s end (a signal, its launcher's stop) or last record; or ended by a wait that ran
  out (a timeout; any other error says nothing of ``K``) past 1.5 intervals and half a second (at least
  2 s): the wait's own clock, with the socket open all along; or, not posted, ended later by a lost
  connection: then ``P``'s last ``alive`` record naming it (``waiting_on``) before any loss is the time (a
  watchdog's SIGKILL after the freeze ends every wait so: a red team's async runs read died);
- and no member of the group lost its connection to anyone from ``K``'s last record to that time (the cut:
  every record at or after the first loss is set aside);
- and no other member that went silent before ``K`` (by more than 1.5 intervals) was still silent then: the
  wait may have been on it alone (:func:`_silent_beside`).

Or the engine's own collective (:func:`_engine_held`): ``alive`` records name the ``torch.distributed``
function a thread was blocked in while the step stayed put, and whether its group holds the controller's
ranks (``engine_wait``, ``engine_wait_group``, ``eplb_fsm.engine_wait``). Only a wait on the controller's
ranks counts: another group may wait on a rank no trace shows, or leave the silent one out (red teams'
controllers on 2 of 3 and 3 of 4 ranks read a SIGKILLed one frozen while the engine waited on the busy
untraced rank, first on a wider group, then on one of the same size). Every other member of ``K``'s group
must show such a wait past the limit (or be inside it at its signal ``end``), begun after ``K``'s last
record and by the time it could first show a wait on ``K``, read from records before the cut (a peer's
liveness thread may beat between a kill and its own failure), not at the step where ``K``'s own last record
shows it inside an engine collective too (a wait begun before, or shared, may be on another live member: a
red team's survivors deadlocked in mismatched broadcasts read a rank SIGKILLed beside them frozen), with
nothing broken since ``K``'s last record: a wait on a dead ``K`` would have
failed at once, and its failure ended the others'. Only collectives count (``engine_wait.COLLECTIVES``; the
reader drops other names: a red team's survivors of a SIGKILL sat in ``new_group``, a wait in the store,
unbroken). A member silent within 1.5 intervals of ``K`` is not asked for a wait: the first of them to stop
carries the finding, the others join it as companions (a red team's two ranks SIGSTOPped together each
lacked the other's wait).

``K`` needs liveness records (a writer without them is silent whenever nothing happens) and no failed
write (its own lines may be what was lost, ``signal_death.lost_writes``). A dead rank that stopped writing
within 1.5 intervals of ``K``, that no peer lost a connection to, goes into ``K``'s finding with a line
saying its trace cannot tell (a red team's two ranks SIGSTOPped together, only one of them waited on).

What this cannot see: a child process that outlived a killed rank and still holds its sockets (forked
without closing them: multiprocessing's ``fork``, ``os.system``) keeps the connections open, and the peers
time out as on a frozen rank (a red team's real runs, with a launcher slow enough to leave the survivors
waiting: torchrun at ``--monitor-interval 5``). The finding says so, with each rank's pid for torchrun's
log, where only a process still there when the job was stopped gets "forcefully exiting via 9".

On NCCL (``device`` not cpu) a peer waits on a dead rank as on a frozen one, until the watchdog's
timeout: no claim there, and the rank stays ``rank_died``, whose detail says that a process frozen for
good looks the same.
"""

from __future__ import annotations

import re
from typing import Callable

from eplb_fsm.inspect.dropped import Dropped
from eplb_fsm.inspect.elastic import Cast, Key
from eplb_fsm.inspect.endings import CONNECTION_LOST, entries
from eplb_fsm.inspect.findings import Finding, coll_text
from eplb_fsm.inspect.model import WORLD_GROUP, Collective
from eplb_fsm.inspect.signal_death import lost_writes

__all__ = ["held_open", "held_findings"]

Held = tuple  # (peer, collective, ts): the peer was inside the collective, unbroken, at ts
# the forms of a wait that ran out (gloo's, torch's, the controller's); any other error says nothing of the peer
_RAN_OUT = re.compile(r"timed out|timeout|ran past collective_timeout_s|did not return within", re.I)


def _on_gloo(s) -> bool:
    return (s.header or {}).get("device") == "cpu"


def _inside_until(s, c: Collective, cut: float) -> float | None:
    """When the participant was last known inside ``c`` with nothing broken, or None (it ended, or broke);
    ``cut``: the first lost connection after the silent rank's last record."""
    # a posted all-reduce (async ready flags) is waited in only when read back: a wait there that ran out counts,
    # one still open may have had nobody waiting
    if type(c.ts) not in (int, float) or (c.posted and c.status != "error"):
        return None
    if c.status == "error" and _ran_out(c.error):   # a wait that ran out kept the connection
        return c.error_ts if type(c.error_ts) in (int, float) else None
    if c.status == "error":
        # a lost one says a peer went, but not when: the alive records that name the wait before the first loss
        # still show it held that long (a red team's ranks SIGSTOPped in async mode, SIGKILLed 5-8 s later,
        # read died: their peers' waits broke only at the kill); a posted one may be open with nobody in it
        return max((a[0] for a in s.alive if type(a[0]) in (int, float) and c.ts <= a[0] < cut
                    and a[3] is not None and (a[3].get("group"), a[3].get("cseq")) == (c.group, c.cseq)),
                   default=None) if not c.posted else None
    if c.status != "open":   # an end of its own with a lost connection is read by the cut
        return None
    end = (s.end or {}).get("ts")
    return end if type(end) in (int, float) else s.last_ts


def _joined(cast: Cast, key: Key, c: Collective, others: list) -> bool:
    """Every one of ``others`` but ``key`` started ``c`` (a traced participant)."""
    return all(m == key or (m is not None and m in cast.parts and c.cseq in cast.parts[m].collectives.get(c.group, {}))
               for m in others)


def _waits_on(cast: Cast, key: Key, c: Collective) -> bool:
    """``c`` cannot finish without ``key``: ``key`` is a partner of the batch and every other partner joined it
    (a partner still outside may be the one waited on: a wait on ``key`` whose part is done waits on nobody), or
    any other op, which every other member joined."""
    members = cast.members(c.group)
    if key not in members:
        return False
    if not isinstance(c.peers, list):
        return _joined(cast, key, c, members)
    if cast.generation_of(c.group) is None:   # members are listed by group rank only then
        return False
    partners = [members[j] for j in c.peers if type(j) is int and 0 <= j < len(members)]
    return key in partners and _joined(cast, key, c, partners)


def _first_break(cast: Cast, dropped: Dropped, since: float) -> float:
    """When some rank first lost a connection at or after ``since`` (a collective's error, or an ``end``'s); inf
    when none did."""
    errors = [ts for ts, _, _ in dropped.errors if ts >= since]
    ends = [ts for s in cast.parts.values() if type(ts := (s.end or {}).get("ts")) in (int, float) and ts >= since
            and CONNECTION_LOST.search(str(s.end.get("error") or ""))]
    return min(errors + ends, default=float("inf"))


def held_open(cast: Cast, key: Key, dropped: Dropped, limit: float) -> Held | None:
    """The wait that shows ``key`` (no ``end``) was a live process, silent, past ``limit`` seconds after its last
    record: (peer, collective, ts), the latest such ts; None when nothing shows it (see the module docstring)."""
    s = cast.parts[key]
    last = s.last_ts
    if s.end is not None or not s.alive or lost_writes(s) or type(last) not in (int, float) or not _on_gloo(s):
        return None
    # a wait that ran out timed the silence on its own clock, the socket open: past a live rank's longest
    # silence (1.5 intervals) by half a second of a busy host's delay will do (a red team's engine timeout of
    # 2 s ran out 2.48 s after a SIGSTOPped rank's last record, under the 2.5 s limit, and read died)
    short = min(limit, max(2.0, 1.5 * (s.alive_interval or 1.0) + 0.5))
    cut = _first_break(cast, dropped, last)
    found = [(peer, c, ts) for peer, p in cast.parts.items() if peer != key and _on_gloo(p) for c in entries(p)
             if (ts := _inside_until(p, c, cut)) is not None
             and ts - last > (short if c.status == "error" and _ran_out(c.error) else limit)
             and _waits_on(cast, key, c)]
    # the longest wait that nothing broke before its end (a peer's exit after it closes sockets in turn), and
    # that no other member's silence explains: a wait may be on that member, not on ``key``
    held = max((h for h in found if h[2] < cut and not _silent_beside(cast, key, h[0], h[1], h[2])),
               key=lambda h: h[2], default=None)
    return held or _engine_held(cast, key, limit, short, cut)


def _silent_beside(cast: Cast, key: Key, peer: Key, c: Collective, ts: float) -> bool:
    """Another member of ``c``'s group, silent since before ``key``'s last record (by more than 1.5 intervals: one
    closer joins ``key``'s finding), was still silent at ``ts``: inside a gap of its records (over 2 intervals,
    ``silences``), or past its last record by 2 intervals with no end before ``ts``. The wait may have been on it,
    never reading from ``key`` (a red team's near miss: survivors waiting on a rank SIGSTOPped inside the
    collective never read from one SIGKILLed beside it). The first to go silent keeps the evidence: while the
    other still wrote, a wait on it could only end at it."""
    k = cast.parts[key]
    window = 1.5 * (k.alive_interval or 1.0)
    for m in cast.members(c.group):
        s = cast.parts.get(m)
        if m in (key, peer) or s is None or type(s.last_ts) not in (int, float) \
                or not s.last_ts < k.last_ts - window:
            continue
        end = (s.end or {}).get("ts")
        if type(end) in (int, float) and end <= ts:
            continue
        if s.last_ts < ts - 2 * (s.alive_interval or 1.0) or any(a < ts < b for a, b, *_ in s.silences):
            return True
    return False


def _ran_out(error: object) -> bool:
    """An error text that is a wait running out (a timeout), not a lost connection."""
    return bool(_RAN_OUT.search(str(error or ""))) and not CONNECTION_LOST.search(str(error or ""))


def _in_engine_until(p, last: float, limit: float, short: float, shared: object,
                     cut: float) -> tuple[str, float] | None:
    """(op, ts): ``p``'s latest alive record naming an engine wait (``engine_wait``) on the controller's ranks
    (``engine_wait_group`` same: another group may wait on a rank no trace shows), at ts past ``last + limit``;
    its end instead when that record was its last and the end, at the same step, is a signal or a wait that ran
    out (past ``last + short`` then, as held_open's). The run of such records at that step must have begun
    after ``last`` and by ``last + limit`` and 1.5 of ``p``'s intervals (when it could first show a wait on a
    rank silent since ``last``), and at a step other than ``shared`` (the silent rank's own last step, when its
    last alive record shows it inside an engine collective too: a wait it shared may be on someone else). None
    otherwise."""
    def waits(a: tuple) -> bool:
        return a[4] is not None and a[4][1] is True and type(a[0]) in (int, float)

    # before the first lost connection (``cut``): a record after it may show a wait the loss was about to end (a
    # red team's peer ticked between the kill of a rank SIGSTOPped 8 s before and its own failure: read died)
    marked = [i for i, a in enumerate(p.alive) if waits(a) and a[0] < cut]
    if not marked:
        return None
    j = first = marked[-1]
    if p.alive[j][1] == shared:
        return None
    while first > 0 and waits(p.alive[first - 1]) and p.alive[first - 1][1] == p.alive[j][1]:
        first -= 1
    # begun after the silent rank's last record: one begun before may wait on another live member (a red team's
    # survivors, deadlocked in mismatched broadcasts, read a rank SIGKILLed in the same wait frozen); and by the
    # time a wait on it could first show: one begun later came after p went on without it
    if not last <= p.alive[first][0] <= last + limit + 1.5 * (p.alive_interval or 1.0):
        return None
    op, ts, past = p.alive[j][4][0], p.alive[j][0], limit
    end = p.end or {}
    if j == len(p.alive) - 1 and end.get("step") == p.alive[j][1] and type(end.get("ts")) in (int, float) \
            and end["ts"] < cut and (end.get("how") == "signal" or _ran_out(end.get("error"))):
        ts, past = end["ts"], (limit if end.get("how") == "signal" else short)
    return (op, ts) if ts > last + past else None


def _engine_held(cast: Cast, key: Key, limit: float, short: float, cut: float) -> Held | None:
    """(peer, op, ts) when every other member of ``key``'s group sat in an engine collective (a thread's frames
    named it, ``eplb_fsm.engine_wait``) ``limit`` s past ``key``'s last record, each before ``cut`` (the first
    lost connection since); the latest.
    The engine's groups are not in the trace: all of them waiting, none broken, leaves ``key`` the one waited on
    (a wait on a dead rank would have failed at once on gloo, and its failure ended the others' in turn)."""
    members = cast.members(str((cast.parts[key].header or {}).get("group") or WORLD_GROUP))
    if key not in members or len(members) < 2:
        return None
    k = cast.parts[key]
    last, found, window = k.last_ts, [], 1.5 * (k.alive_interval or 1.0)
    # the silent rank inside an engine collective itself at its last step: its peers' waits at that step may be on
    # one another (a red team's survivors deadlocked in mismatched broadcasts beside a rank then SIGKILLed)
    shared = k.alive[-1][1] if k.alive and k.alive[-1][4] is not None and k.alive[-1][1] == k.last_step else object()
    for m in members:
        p = cast.parts.get(m)
        if m == key:
            continue
        if p is not None and p.end is None and type(p.last_ts) in (int, float) and abs(p.last_ts - last) <= window:
            # silent with it (two ranks SIGSTOPped together): the first to stop carries the finding, the other
            # joins it as a companion whose own trace cannot tell (held_findings)
            if (p.last_ts, m) < (last, key):
                return None
            continue
        seen = _in_engine_until(p, last, limit, short, shared, cut) if p is not None and _on_gloo(p) else None
        if seen is None:
            return None
        found.append((m, *seen))
    return max(found, key=lambda h: h[2], default=None)


def held_findings(cast: Cast, held: list[tuple], dead: list[tuple], dropped: Dropped, at: Callable,
                  interval: Callable) -> tuple[list[tuple], list[tuple]]:
    """Events (last ts, "frozen", key, Finding) for ``held`` ((last ts, key, Held), earliest first), and ``dead``
    ((last ts, key, why), ``liveness``) without the held ranks and their companions. Ranks whose last records lie
    within 1.5 intervals of the first one's froze together, as one finding; a dead rank that stopped writing
    that close to it, that no peer lost a connection to, is its companion (stopped with it, as far as its own
    trace tells: no peer waited on it to show more), named in the same finding with a detail line saying so."""
    out, keys_held = [], {h[1] for h in held}
    dead = [d for d in dead if d[1] not in keys_held]
    while held:
        first, k, (peer, c, ts) = held[0]
        window = 1.5 * interval(cast.parts[k])
        together = [h for h in held if h[0] - first <= window]
        held = held[len(together):]
        companions = [d for d in dead if abs(d[0] - first) <= window and dropped.first_after(d[1]) is None]
        dead = [d for d in dead if d not in companions]
        keys = sorted([h[1] for h in together] + [d[1] for d in companions])
        s = cast.parts[k]
        where = f" at step {s.last_step} in {s.final_state}" + (
            f", layer {s.final_layer}" if s.final_layer is not None and s.final_state == "transferring" else "")
        pids = ", ".join(f"{cast.label(x)} pid {pid}" for x in keys
                         if type(pid := (cast.parts[x].header or {}).get("pid")) is int)
        details = [f"{cast.label(d[1])} stopped writing {abs(d[0] - first):.2f} s from {cast.label(k)}, and no peer "
                   "waited on it in a controller collective: its trace cannot tell a freeze with it from a kill"
                   for d in companions]
        details.append("a child process that outlived a killed rank and still held its sockets (forked without "
                       "closing them: multiprocessing's fork start, os.system) keeps its connections open, and reads "
                       "the same; torchrun's log tells them apart: 'Unable to shutdown process <pid> via 15, "
                       "forcefully exiting via 9' names a rank still there when the job was stopped"
                       + (f" ({pids})" if pids else ""))
        engine = isinstance(c, str)   # a wait in the engine's own collective (_engine_held): every other rank's
        wait = (f"the engine's own {c}" + (", as every other rank did," if len(cast.parts) > 2 else "")) if engine \
            else coll_text(c)
        ran_out = not engine and c.status == "error" and _ran_out(c.error)
        # a wait that failed later on a lost connection: held_open read its alive records up to that loss
        until = "until its wait ran out at" if ran_out else "until at least" if not engine and c.status == "error" \
            else "until"
        on = "" if engine else f" on {cast.label(k)}"
        out.append((first, "frozen", k, Finding.of(
            "frozen", s.last_step, keys,
            f"{cast.who(keys)} froze for good{where} (SIGSTOP, or a C call holding the GIL?): no record after "
            f"{at(first)}, while {cast.label(peer)} waited{on} in {wait} "
            f"{until} {at(ts)}, {ts - first:.1f} s later, with nothing broken (on gloo a process that ends closes "
            "its sockets, and its peers' waits fail at once); no end record: killed later, or stopped still",
            state=s.final_state, layer=s.final_layer, details=details,
            ranks=[cast.position(h[1], "frozen", f"silent from {at(h[0])} on, a process still at {at(h[2][2])}",
                                 cast.parts[h[1]].last_step, cast.parts[h[1]].final_state,
                                 cast.parts[h[1]].final_layer) for h in together]
            + [cast.position(d[1], "frozen", f"silent from {at(d[0])} on, with {cast.label(k)}",
                             cast.parts[d[1]].last_step, cast.parts[d[1]].final_state, cast.parts[d[1]].final_layer)
               for d in companions])))
    return out, dead
