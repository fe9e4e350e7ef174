"""A rank's last ``alive`` records read as one run: where its main thread stood while its step stayed put.

Why: three readings of live engines (``stalled``: the network; ``lagging``: a rank in its own work; ``deadlock``:
ranks in different collectives) look at the same thing on every rank: its last ``RUN`` or more alive records, at one
step, each saying whether the main thread waits in a collective of the engine's (``engine_wait``, from the frames
the liveness thread reads; ``eplb_fsm.engine_wait``; or ``main_wait``, the main thread's own when ``engine_wait``
names a side thread's, or a rooted one: broadcast, gather; or a send or recv, with its peer) and in which (its call:
group name and tensor shape).

A run is what the rank did *last*: a record of a later step after it (the job went on: a slow step, not a stall; a
red team's job that caught up read as lagging), a silence over ``GAP`` intervals inside it (a pause of the job), a
controller collective it waits in (posted ready flags aside: nobody waits in them) or a record of the other kind
ends it. :func:`longest_wait_before` measures the waits a rank got past before its run: a job whose engine steps
often take seconds is slow, not stuck, until a wait outlasts them (``lagging.engine_lag``).
"""

from __future__ import annotations

from dataclasses import dataclass

from eplb_fsm.engine_wait import P2P
from eplb_fsm.inspect.endings import WAIT_ERROR, peer_text

__all__ = ["RUN", "Run", "by_rank", "engine_run", "held_back", "job_longest_wait", "longest_wait_before",
           "stopped_parts", "waited_or_stopped"]

RUN = 3   # alive records in a row at one step: a wait, not a slow beat
GAP, GAP_MIN_S = 2.5, 2.0   # between two alive records of a run, at most: a longer silence is a pause or a freeze
# collectives whose tensor shape may differ from member to member in one call (uneven all-to-all splits, a red
# team's MoE dispatch): one call is one group there
UNEVEN = frozenset({"all_to_all", "all_to_all_single", "all_gather", "all_gather_object"})
WARM_STEPS = 2   # the first steps of a session: their waits are a warm-up's
# a rank in its own work while its peers wait, or ranks in different collectives, for less than this, or for no more
# than SLOW_FACTOR times the longest wait the job got past, is held back as a warning: an idle server waiting for
# requests, a first checkpoint, a slow step look the same over seconds (a red team's healthy jobs, stopped inside
# one, read as lagging); a hang an operator stops has lasted minutes
LAG_MIN_S, SLOW_FACTOR = 60.0, 2


@dataclass(frozen=True)
class Run:
    """A rank's last alive records at one step: ``step``; ``op`` and ``call`` of the collective the last one names
    (None when none: its own work; a side thread's wait in a run of its own work); ``first`` and ``last`` ts;
    ``ours``: every record's collective is on the controller's ranks; ``peer``: the controller's rank a ``send`` or
    ``recv`` waits on (None: unknown, or no point-to-point call)."""

    step: int
    op: str | None
    first: float
    last: float
    call: str | None
    ours: bool
    peer: int | None = None

    @property
    def p2p(self) -> bool:
        """Whether the main thread waits in a point-to-point call (``send``, ``recv``): on one peer."""
        return self.op in P2P

    @property
    def collective(self) -> tuple:
        """Which collective, alike on every member of one call: op, and group and shape (group alone: ``UNEVEN``)."""
        if self.op in UNEVEN and self.call:
            return self.op, self.call.rsplit(":", 1)[0]
        return self.op, self.call

    @property
    def text(self) -> str:
        """``all_reduce (WORLD:[48, 8])``, ``recv from rank 1 (WORLD:[4])``."""
        peer = peer_text(self.op, self.peer) if self.p2p else ""
        return f"{self.op}{peer} ({self.call})" if self.call else f"{self.op}{peer}"


def _main_waits(a) -> bool:
    """Whether an alive record says the main thread waits in an engine collective (older traces: any thread)."""
    return bool(a[4]) and a[4][3] is not False


def _where(a) -> tuple | None:
    """(op, call, on the controller's ranks, a wait on every member, peer) of the collective an alive record's main
    thread sits in: its ``engine_wait``, or its ``main_wait`` (a rooted one; another group's beside a side thread's;
    a send or recv, with its peer), or None (its own work)."""
    if _main_waits(a):
        return a[4][0], a[4][2], a[4][1] is True, True, None
    return a[5]


def _within_gap(s, earlier: float, later: float) -> bool:
    return later - earlier <= max(GAP * (s.alive_interval or 1.0), GAP_MIN_S)


def engine_run(s, mode: str = "ours") -> Run | None:
    """``s``'s run (module docstring) when it has ``RUN`` or more records, each with the main thread inside an engine
    collective on the controller's ranks in which every member waits (``mode`` "ours"), inside one of any group
    ("any"), inside any collective, a rooted one or a point-to-point call too (broadcast, gather, send, recv:
    "c10d"), inside a point-to-point call ("p2p"), or inside none, a side thread's wait aside ("own"); else None."""
    def posted(on: dict) -> bool:   # async ready flags: issued, read back later, nobody waits in them
        e = s.collectives.get(on.get("group"), {}).get(on.get("cseq"))
        return e is not None and e.posted

    def counts(i: int) -> bool:
        a = s.alive[i]
        w = _where(a)
        kind = {"ours": bool(w) and w[2] and w[3], "any": bool(w) and w[3], "c10d": w is not None,
                "p2p": bool(w) and w[0] in P2P}.get(mode, w is None)
        if (a[3] and not posted(a[3])) or type(a[0]) not in (int, float) or a[1] != s.alive[-1][1] or not kind:
            return False
        return i + 1 == len(s.alive) or _within_gap(s, a[0], s.alive[i + 1][0])

    step = s.alive[-1][1] if s.alive else None
    if type(step) is not int or (type(s.last_step) is int and s.last_step > step):
        return None   # no step, or the rank stepped on after its last alive record
    n = 0
    while n < len(s.alive) and counts(len(s.alive) - 1 - n):
        n += 1
    if n < RUN:
        return None
    last, w = s.alive[-1], _where(s.alive[-1])
    op, call = w[:2] if w else (last[4][0], last[4][2]) if last[4] else (None, None)   # own work: a side thread's
    ours = all((w := _where(a)) is not None and w[2] for a in s.alive[-n:])
    return Run(step, op, s.alive[-n][0], last[0], call, ours, w[4] if (w := _where(last)) and op in P2P else None)


def longest_wait_before(s, ts: float, inside_only: bool = True) -> float:
    """The longest stretch, in seconds from its first alive record to its last, that ``s``'s main thread waited in an
    engine collective at one step before ``ts`` (0.0 when it never did): a wait the job got past; without
    ``inside_only``, any stretch of alive records at one step (traces whose waits the liveness thread cannot see).
    Not at the first ``WARM_STEPS`` steps of its session: a warm-up (loading, compiling) says nothing of the steps
    after it (a red team's 10 s first step hid a hang behind it)."""
    header = getattr(s, "header", None) or {}
    warm = (header.get("step") if type(header.get("step")) is int else 0) + WARM_STEPS
    longest, start, prev = 0.0, None, None   # prev: the previous record, if it counted
    for a in s.alive:
        if type(a[0]) not in (int, float) or a[0] >= ts:
            break
        inside = (_where(a) is not None or not inside_only) and type(a[1]) is int and a[1] >= warm
        if not inside:
            start = prev = None
            continue
        if prev is None or a[1] != prev[1] or not _within_gap(s, prev[0], a[0]):
            start = a[0]
        longest, prev = max(longest, a[0] - start), a
    return longest


def stopped_parts(cast) -> dict | None:
    """The participants the readings of live engines look at (all but those that left on purpose), when every rank
    has a trace (an untraced one may be the rank the others wait for), there are two or more, and each is still
    running, signalled or ended by a failed wait after its last alive record; else None."""
    parts = {k: s for k, s in cast.parts.items() if not s.ended_on_purpose}
    if cast.missing or len(parts) < 2 or not all(waited_or_stopped(s) for s in parts.values()):
        return None
    return parts


def by_rank(keys) -> dict:
    """Rank -> participant, for the ranks one participant holds alone: where a send's or recv's peer (a rank of the
    controller's group) is followed to a trace (a rank two sessions hold, elastic, is left out: ambiguous)."""
    seen: dict = {}
    for k in keys:
        seen.setdefault(k[0], []).append(k)
    return {rank: ks[0] for rank, ks in seen.items() if len(ks) == 1}


def job_longest_wait(parts: dict, ts: float) -> float:
    """The longest wait any of ``parts`` got past before ``ts`` (:func:`longest_wait_before`)."""
    return max(longest_wait_before(s, ts) for s in parts.values())


def held_back(lasted: float, before: float) -> bool:
    """Whether waits of ``lasted`` s (a run's first alive record to its last), in a job whose longest earlier wait
    was ``before`` s (measured alike: :func:`longest_wait_before`), are too short to name a cause (``LAG_MIN_S``,
    ``SLOW_FACTOR``)."""
    return lasted < LAG_MIN_S or lasted <= SLOW_FACTOR * before


def waited_or_stopped(s) -> bool:
    """Still running, stopped by a signal, or ended by a wait that failed (gloo closing the stalled pairs when a
    bounded wait ran out) after its last alive record: the ends a stall leads to."""
    end = s.end or {}
    if end.get("how") in (None, "signal"):
        return True
    ts, last = end.get("ts"), s.alive[-1][0] if s.alive else None
    return end.get("how") == "exception" and bool(WAIT_ERROR.search(str(end.get("error") or ""))) \
        and type(ts) in (int, float) and type(last) in (int, float) and ts >= last
