"""Collective findings built on records a rank's trace lost: told as such, never as fact.

A rank's ``seq`` advances by one per record, so a jump is lines lost (a rotated segment
removed or cut short, a damaged disk block); each stretch is kept per session in
``RankSummary.gaps`` (``seqcheck``), with the step and ``ts`` either side. A collective
finding reads an absence as what a rank did not do: a collective it never issued, or one
it started and never finished. When that absence lies inside a gap of the rank's trace,
the finding does not hold as stated, and ``LostRecords.qualify`` turns it into
``lost_records``:

- a collective the rank never issued (``skipped``, ``never_joined``), or one only the others
  lack (an "extra" collective): the gap lies between the last collective of that group the
  rank started before it and the next one it started after it, which are on either side of
  the one claimed;
- a collective the rank started and never finished: the gap lies after its start (unless
  the rank's last ``alive`` record says it still waited in it);
- and in time: the record after the gap is no older than the first start of that collective
  on any member (within ``SKEW_S``): a collective ends only once every member joined it, so
  lines lost well before anyone started it cannot hold it.

The summary keeps the finding's own text, then says which gap (``rank R's trace lost N
record(s) here (seq A..B, steps X..Y), so this may be the gap, not the rank``) and, for a
rank that went on to write its ``end`` record, that it ended in order. The culprits are the
ranks whose traces lost the records (their files are what to look at); a detail says what
the finding would have been. One ``lost_records`` is told per gap: a later finding that
rests on the same gap is dropped (``qualify`` answers False), and ``check_collectives``
goes on with the group after it.

A silence is read the same way (``liveness``): a rank that wrote nothing for longer than the
frozen limit while the others wrote is ``frozen``, unless the silence lies in a gap (its
records either side bound the gap, whose ``from_ts``/``to_ts`` they are; ``lost_gap``):
the rank wrote there and the lines went (a rotated segment removed, a live file deleted and
opened again), so it is ``lost_records`` (``LostRecords.silent``), told once per gap.

State changes lost with the lines shift the rank's n-th state change against the others'
(``checks.align_transitions``). ``LostRecords.shifted`` tells a divergence at state change
#n as ``lost_records`` for a participant whose state change there follows a gap (after its
state change before it) that held state changes by the walk's account (the record after it
did not start from the replayed state: ``transition_replay.settle_lost_changes`` marks it
``state_from``/``state_to``), or whose steps span every state change that others, at least
as many as share the rank's own state change #n, took from #n up to one equal to the
rank's (the same event at the same step): a whole cycle lost, which leaves the replayed
state as it was (a lone rank that diverged is no reference for the others, unless its own trace lost nothing
between its state changes #n-1 and #n: a whole record of those steps against a broken one). Either way the
rank's lost lines must be at least as many as those state changes of the others (one line each): one lost
``steps`` line cannot hold a whole rearrangement that a lone rank shows. The alignment
goes on without that participant. The gaps told are shared by every ``LostRecords`` of one
``Cast`` (one diagnosis): the collectives do not tell a gap the alignment told.
"""

from __future__ import annotations

import math
from collections import Counter

from eplb_fsm.inspect.elastic import Cast, Key
from eplb_fsm.inspect.findings import Finding
from eplb_fsm.inspect.model import Collective, RankSummary, Transition

__all__ = ["LOST_RECORDS", "SKEW_S", "LostRecords", "gap_text", "held_around", "lost_gap"]

LOST_RECORDS = "lost_records"
SKEW_S = 2.0    # clocks of different hosts agree to well under this (docs/debugging-hangs.md, liveness)
_ABSENT = ("hang", "collective_mismatch")    # the kinds that read an absence as what a rank did


def held_around(s: RankSummary, group: str, seq: int) -> tuple[float, float]:
    """(the highest cseq of ``group`` the session started before ``seq``, the lowest it holds above
    that one): -1 and inf where there is none."""
    index = s.collectives.get(group)
    if not index:
        return -1, float("inf")
    one, runs = getattr(index, "one", index), getattr(index, "runs", ())
    # a bulk run follows its template with no gap between them: it lies wholly on the template's side of a gap
    lo = max([c for c, e in one.items() if type(e.seq) is int and e.seq < seq]
             + [r.last for r in runs if type(r.template.seq) is int and r.template.seq < seq], default=-1)
    hi = min([c for c in one if c > lo] + [max(r.first, lo + 1) for r in runs if r.last > lo], default=float("inf"))
    return lo, hi


def lost_gap(s: RankSummary, a: float, b: float) -> int | None:
    """The index in ``s.gaps`` of the stretch of lost lines that the silence from ``a`` to ``b`` lies in (its
    records either side are the ones around the gap, or a gap widened past ``seqcheck.MAX_GAPS`` spans it), or
    None: the rank's own ``seq`` shows nothing missing there."""
    for i, gap in enumerate(s.gaps):
        x, y = gap.get("from_ts"), gap.get("to_ts")
        if type(x) in (int, float) and type(y) in (int, float) and x < b and y > a:
            return i
    return None


def gap_text(cast: Cast, key: Key, gap: dict) -> str:
    """``rank R's trace lost N record(s) here (seq A..B, steps X..Y)``."""
    a, b = gap["first"], gap["last"]
    x, y = gap.get("from_step"), gap.get("to_step")
    steps = "" if type(x) is not int or type(y) is not int else f", step {x}" if x == y else f", steps {x}..{y}"
    seqs = f"seq {a}" if a == b else f"seq {a}..{b}"
    return f"{cast.label(key)}'s trace lost {gap['lost']} record(s) here ({seqs}{steps})"


class LostRecords:
    """The collective findings of one replay whose evidence lies in a gap (see the module docstring)."""

    def __init__(self, cast: Cast) -> None:
        self.cast = cast
        self.told: set[tuple] = cast.told_gaps    # (participant, gap index) already named, shared by the diagnosis
        self._around: dict[tuple, tuple] = {}    # (participant, group, gap index) -> held_around

    def qualify(self, f: Finding) -> bool | None:
        """None: no gap bears on ``f`` (it stands); True: ``f`` is now ``lost_records``, naming the gap;
        False: it rests on a gap an earlier finding named (leave it out)."""
        coll = f.collective or {}
        g, c = coll.get("group"), coll.get("cseq")
        if f.kind not in _ABSENT or type(c) is not int:
            return None
        parts = self.cast.parts
        first = min([e.ts for k in f.members if k in parts and (e := parts[k].collectives.get(g, {}).get(c))
                     is not None and type(e.ts) in (int, float)], default=None)
        hits = self._hits(f.keys(), g, c, first)
        if not hits and f.kind == "collective_mismatch" and self._one_signature(f, g, c):
            # the culprits issued it and the others did not (an extra collective): the others' absence is the evidence
            hits = self._hits([k for k in f.members if k not in f.keys()], g, c, first)
        if not hits:
            return None
        keys = sorted({k for k, _ in hits})
        text, ended = self._texts(hits)
        stands = [k for k in f.keys() if k not in keys]
        if stands and len(stands) < len(f.keys()):
            # the finding holds for the other culprits: the ones whose evidence was lost leave it
            f.summary += f"; but {text}, so for {self.cast.who(keys)} this may be the gap, not the rank{ended}"
            f.culprits, f.sessions = sorted({k[0] for k in stands}), [list(k) for k in stands]
            return None
        if all(hit in self.told for hit in hits):
            return False
        self.told.update(hits)
        f.details.insert(0, f"read as it stands: {f.kind}, culprit {self.cast.who(f.keys())}")
        f.kind = LOST_RECORDS
        f.summary += f"; but {text}, so this may be the gap, not the rank{ended}"
        f.culprits, f.sessions = sorted({k[0] for k in keys}), [list(k) for k in keys]
        return True

    def silent(self, key: Key, silence: tuple, i: int, at) -> Finding | None:
        """``lost_records`` for a silence of ``key`` that would read as ``frozen`` (``silence``: (from ts, to ts,
        step, state, layer)) but lies in its gap #``i``; None when that gap was told before. ``at`` formats a ts."""
        if (key, i) in self.told:
            return None
        self.told.add((key, i))
        a, b, step, state, layer = silence
        label = self.cast.label(key)
        text, ended = self._texts([(key, i)])
        return Finding.of(
            LOST_RECORDS, step, [key],
            f"{label} wrote nothing readable for {b - a:.1f} s at step {step} in {state} (from {at(a)} to {at(b)}) "
            f"while the other ranks kept writing; but {text}, so this may be the gap, not the rank{ended}",
            state=state, layer=layer,
            ranks=[self.cast.position(key, "silent", f"no readable record for {b - a:.1f} s from {at(a)}",
                                      step, state, layer)],
            details=[f"read as it stands: frozen, culprit {label}"])

    def _texts(self, hits: list[tuple[Key, int]]) -> tuple[str, str]:
        """The gaps ``hits`` name, and ``; R then ended in order ...`` for those of them that wrote their end."""
        parts = self.cast.parts
        text = "; ".join(gap_text(self.cast, k, parts[k].gaps[i]) for k, i in sorted(hits))
        ended = "".join(f"; {self.cast.label(k)} then ended in order ({parts[k].end.get('how')}) at step "
                        f"{parts[k].end.get('step')}" for k in sorted({k for k, _ in hits}) if parts[k].end is not None)
        return text, ended

    def shifted(self, f: Finding, rest: dict[Key, tuple[list[Transition], int]]) -> tuple[list[Key], Finding | None]:
        """The participants whose state changes are shifted by lines their traces lost just before state change #i
        (``f``: the divergence there), and the ``lost_records`` finding (``f`` as read, naming their gaps; None:
        each gap was told before). ``rest``: each participant that holds #i -> (its state changes compared, the
        index of #i among them)."""
        hits = [(k, n) for k in rest if (n := self._shift_gap(k, rest)) is not None]
        if not hits:
            return [], None
        keys = sorted({k for k, _ in hits})
        if all(hit in self.told for hit in hits):
            return keys, None
        self.told.update(hits)
        text, ended = self._texts(hits)
        gaps = [self.cast.parts[k].gaps[n] for k, n in sorted(hits)]
        held = [f"{self.cast.label(k)}'s lost lines held its state change(s) from {g['state_from']} to {g['state_to']}"
                for (k, _), g in zip(sorted(hits), gaps) if "state_to" in g]
        return keys, Finding.of(
            LOST_RECORDS, f.step, keys, f"{f.summary}; but {text}, so this may be the gap, not the rank{ended}",
            state=f.state, layer=f.layer, ranks=f.ranks,
            details=[f"read as it stands: {f.kind}, culprit {self.cast.who(f.keys())}"] + held)

    def _shift_gap(self, k: Key, rest: dict[Key, tuple[list[Transition], int]]) -> int | None:
        """The gap of ``k``'s trace between its state change #i and the one before that explains the divergence
        at #i (see the module docstring), or None."""
        s = self.cast.parts.get(k)
        if s is None or not s.gaps:
            return None
        mine, j = rest[k]
        t = mine[j]
        near = self._near(k, rest)
        marked = [n for n in near if "state_to" in s.gaps[n]]
        if marked or not near:
            return marked[-1] if marked else None
        here = {q: (theirs[jq].key(), theirs[jq].step) for q, (theirs, jq) in rest.items()}
        size = Counter(here.values())
        # those it diverges from, as many as its own kind at least (a lone odd one is the others' reference), or
        # fewer whose own trace lost nothing there: their record of those steps is whole, its is not
        refs = [q for q in rest if here[q] != here[k] and (size[here[q]] >= size[here[k]] or not self._near(q, rest))]
        room = sum(s.gaps[n]["lost"] for n in near)   # one line per state change: no more can have gone
        for n in reversed(near):
            g = s.gaps[n]
            a = g["from_step"] if type(g["from_step"]) is int else -math.inf
            b = g["to_step"] if type(g["to_step"]) is int else math.inf
            for q in refs:
                theirs, jq = rest[q]
                for m in range(jq, len(theirs)):
                    u = theirs[m]
                    if m > jq and (u.key(), u.step) == (t.key(), t.step):
                        if m - jq > room:
                            break   # the others' state changes in between are more than the lost lines could hold
                        return n    # the others' state changes before this one all lie in the gap's steps
                    if type(u.step) is not int or not a <= u.step <= b:
                        break
        return None

    def _near(self, k: Key, rest: dict[Key, tuple[list[Transition], int]]) -> list[int]:
        """The gaps of ``k``'s trace between its state change #i and the one before it (in the whole session:
        ``rest``'s list may start where every kept history starts)."""
        s = self.cast.parts[k]
        mine, j = rest[k]
        t = mine[j]
        before = mine[j - 1] if j else next((s.transitions[n - 1] for n in range(1, len(s.transitions))
                                              if s.transitions[n] is t), None)
        lo = before.seq if before is not None and type(before.seq) is int else -1
        hi = t.seq if type(t.seq) is int else math.inf
        return [n for n, g in enumerate(s.gaps) if g["last"] > lo and g["first"] < hi]

    def _hits(self, keys, g: str, c: int, first_start: float | None) -> list[tuple[Key, int]]:
        """(participant, gap index) for each of ``keys`` whose lost lines would hold its missing record of (g, c);
        ``first_start``: the earliest ``ts`` a member started it at (None: unknown)."""
        out = []
        for k in keys:
            s = self.cast.parts.get(k)
            if s is None or not s.gaps:
                continue
            entry = s.collectives.get(g, {}).get(c)
            where = self._end_gaps(s, entry) if entry is not None else self._start_gaps(k, s, g, c)
            i = next((i for i in where if first_start is None or type(to := s.gaps[i]["to_ts"]) not in (int, float)
                      or to + SKEW_S >= first_start), None)
            if i is not None:
                out.append((k, i))
        return out

    def _start_gaps(self, k: Key, s: RankSummary, g: str, c: int) -> list[int]:
        """The gaps between the last collective of ``g`` started before ``c`` and the next one after it."""
        out = []
        for i, gap in enumerate(s.gaps):
            around = self._around.get((k, g, i))
            if around is None:
                around = self._around[(k, g, i)] = held_around(s, g, gap["first"])
            if around[0] < c < around[1]:
                out.append(i)
        return out

    @staticmethod
    def _end_gaps(s: RankSummary, entry: Collective) -> list[int]:
        """The gaps after the start of ``entry``, a collective the session never finished."""
        if entry.status != "open" or type(entry.seq) is not int:
            return []
        waiting = s.alive[-1][3] if s.alive else None
        if isinstance(waiting, dict) and (waiting.get("group"), waiting.get("cseq")) == (entry.group, entry.cseq):
            return []    # its last alive record says it still waited inside: it did not finish it
        return [i for i, gap in enumerate(s.gaps) if gap["first"] > entry.seq]

    def _one_signature(self, f: Finding, g: str, c: int) -> bool:
        """Every member that holds (g, c) issued the same collective (no mismatch of op, shape, ...)."""
        sigs = {e.signature() for k in f.members if k in self.cast.parts
                and (e := self.cast.parts[k].collectives.get(g, {}).get(c)) is not None}
        return len(sigs) == 1
