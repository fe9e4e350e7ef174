"""A rank with no ``end`` whose peers lost their connection to it, and went on: its process went away there.

When a rank's process dies (SIGKILL, the OOM killer, a crash of the interpreter) the kernel closes its
sockets, and a peer waiting with it in a collective fails with a lost connection ("Connection reset by
peer", "Read error", "Broken pipe") right after the dead rank's last record. Mostly the peers then end as
well, and ``liveness._death`` reads their ends as the reaction. But a peer may survive it and go on: an
elastic scale-up whose joiner died is rolled back and the old group keeps serving, until a launcher that
saw a process gone stops the job with SIGTERM a second or two later. Read without this rule, those signals
look like a job stopped from outside (``signalled``, naming the survivors) and the dead joiner goes unnamed.
So ``liveness._death`` asks :meth:`Dropped.first_after` when no peer's end tells the death.
The same errors tell a launcher's reaction to a rank stopped by a signal: once a peer lost its connection
to it (:meth:`Dropped.seen_going`), a rank signalled a while (over one interval) after it is that stop's
consequence (the launcher stopping the job because a process was gone), not a second stop from outside.

What counts: a collective of a group ``key`` belongs to (``Cast.members``) that a peer left with a lost
connection at or after ``key``'s last record, while no other member of that group had written an ``end``
(a rank that exited in order, or on a signal, closes its sockets too: its end explains the lost connection).
A frozen rank (SIGSTOP) closes nothing: its peers' waits time out, and a timeout is no lost connection, so a
freeze stays with the silence rules (``frozen``).
"""

from __future__ import annotations

from functools import cached_property

from eplb_fsm.inspect.elastic import Cast, Key
from eplb_fsm.inspect.endings import CONNECTION_LOST, entries
from eplb_fsm.inspect.model import Collective

__all__ = ["Dropped"]


class Dropped:
    """The collectives that failed with a lost connection, every rank's, read once when first asked."""

    def __init__(self, cast: Cast) -> None:
        self.cast = cast

    @cached_property
    def errors(self) -> list[tuple[float, Key, Collective]]:
        """(ts of the error, rank, collective), earliest first."""
        return sorted(((e.error_ts, k, e) for k, s in self.cast.parts.items() for e in entries(s)
                       if e.status == "error" and type(e.error_ts) in (int, float)
                       and CONNECTION_LOST.search(str(e.error or ""))), key=lambda x: (x[0], x[1]))

    def first_after(self, key: Key) -> tuple[float, Key, Collective] | None:
        """The first (ts, peer, collective) a peer of ``key`` left with a lost connection at or after ``key``'s
        last record, no other member of its group having ended by then; None when there is none."""
        last = self.cast.parts[key].last_ts
        if type(last) not in (int, float):
            return None
        parts = self.cast.parts
        for ts, peer, e in self.errors:
            if peer == key or ts < last:
                continue
            members = self.cast.members(e.group)
            if key not in members:
                continue
            ended = [o for o in members if o not in (key, peer) and o in parts
                     and type(end := (parts[o].end or {}).get("ts")) in (int, float) and end <= ts]
            if not ended:
                return ts, peer, e
        return None

    def seen_going(self, key: Key, since: float) -> bool:
        """A peer of ``key`` left a collective of a group ``key`` belongs to with a lost connection at or after
        ``since`` (``key``'s signal ``end``, say: ``key`` went, and a peer saw it go)."""
        return any(o != key and ts >= since and key in self.cast.members(e.group) for ts, o, e in self.errors)
