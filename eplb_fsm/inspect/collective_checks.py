"""Stage 2 of the replay, collectives: every group's collectives lined up by sequence number.

The n-th collective of a group (``cseq``) must be the same op, shape (except point-to-point ops), ``layer`` and
``wave`` on every member, and it must end everywhere. Members come from ``elastic.Cast`` (generation membership,
switches, untraced ranks). The first problem of each group becomes a finding: a mismatch, a rank that skipped one
and went on, or a hang (who waits inside, who never joined). ``handled_by_fault`` tells a problem every member
rolled back from with a ``fault`` (the machine doing its job) from a real divergence.
"""

from __future__ import annotations

import bisect
import math
from typing import Any

from eplb_fsm.fsm.machine import FAILED
from eplb_fsm.inspect.elastic import Cast, Key
from eplb_fsm.inspect.findings import UNREAD, Finding, coll_text, last_seen, majority, short_error
from eplb_fsm.inspect.lost import LostRecords
from eplb_fsm.inspect.model import Collective, CollectiveIndex, RankSummary, freeze


def handled_by_fault(f: Finding, cast: Cast) -> bool:
    """A collective problem after which every member aborted the rearrangement with ``fault``: the machine doing
    its job (docs/design.md §8): the collective failed or timed out somewhere, every rank agreed and rolled back.
    The finding is kept as a note."""
    if f.kind not in ("collective_mismatch", "hang") or not isinstance(f.step, int):
        return False
    for k in (f.members or list(cast.parts)):
        s = cast.parts.get(k)
        if s is None:
            continue
        ends = (t for t in s.transitions
                if isinstance(t.step, int) and t.step >= f.step and t.trigger in ("fault", "committed"))
        first = next(ends, None)
        if first is None or first.trigger != "fault":
            return False
        # a rollback that ends in `failed` did not handle it: the collective problem is the cause
        if any(t.dest == FAILED and t.step == first.step for t in s.transitions):
            return False
    return True


def check_collectives(cast: Cast) -> list[Finding]:
    """Line every group's collectives up by cseq among its members; report each group's first problem.

    A member that switched away from the group's generation for good (or left) takes part
    up to the last collective it issued there and no further. A problem read from records a
    trace lost (``lost.LostRecords``) is told as ``lost_records`` and the group's check goes on.
    """
    found: list[Finding] = []
    lost = LostRecords(cast)
    parts = cast.parts
    for g in sorted({g for s in parts.values() for g in s.collectives}):
        members = cast.members(g)
        top = max(parts[k].max_cseq(g) for k in members if k in parts)
        streams = [parts[k].collectives.get(g, {}) if k in parts else {} for k in members]
        limits = [parts[k].max_cseq(g) if k in parts and cast.away(k, g) else math.inf for k in members]
        everyone = min(limits, default=math.inf)
        # a rank whose oldest segments were deleted holds no cseq below its first kept one: not "never issued"
        floors = [parts[k].kept_from(g) if k in parts else 0 for k in members]
        whole = max(floors, default=0)
        c = min(floors, default=0) - 1
        held: list[int] | None = None
        while c < top:
            c += 1
            skip = _runs_agree(streams, limits, floors, c)
            if skip is not None:   # every member read these cseqs in bulk, with one signature
                c = skip
                continue
            if whole <= c <= everyone:
                active, active_streams = members, streams
            else:
                idx = [i for i, (low, lim) in enumerate(zip(floors, limits)) if low <= c <= lim]
                active, active_streams = [members[i] for i in idx], [streams[i] for i in idx]
            # fast path: every member ended the same collective at this cseq
            first = active_streams[0].get(c) if active_streams else None
            if first is not None and first.status != "open":
                sig = first.signature()
                if all((e := st.get(c)) is not None and e.status != "open" and e.signature() == sig
                       for st in active_streams):
                    continue
            if first is None and not any(c in st for st in active_streams):
                # no member issued this cseq: go on at the next one any member holds (a far cseq, e.g.
                # a damaged one, must not be walked up to one by one)
                held = _held_cseqs(streams) if held is None else held
                i = bisect.bisect_right(held, c)
                if i == len(held):
                    break
                c = held[i] - 1
                continue
            finding = _check_one_collective(cast, g, c, active)
            told = None if finding is None else lost.qualify(finding)
            if finding is not None and told is not False:
                found.append(finding)
            if finding is not None and told is None:
                break
    return found


def _held_cseqs(streams: list) -> list[int]:
    """Every cseq some stream holds by itself, and the first of each bulk run, sorted."""
    held: set[int] = set()
    for st in streams:
        if isinstance(st, CollectiveIndex):
            held.update(st.one)
            held.update(r.first for r in st.runs)
        else:
            held.update(st)
    return sorted(c for c in held if type(c) is int)


def _runs_agree(streams: list, limits: list, floors: list, c: int) -> int | None:
    """The last cseq from ``c`` on that every active member holds in a bulk run with the same
    signature (all ended), or None."""
    end, sig = math.inf, None
    active = 0
    for st, lim, low in zip(streams, limits, floors):
        if c > lim or c < low:
            continue
        run = st.run_at(c) if isinstance(st, CollectiveIndex) else None
        if run is None:
            return None
        this = run.template.signature()
        if sig is None:
            sig = this
        elif this != sig:
            return None
        end = min(end, run.last, lim)
        active += 1
    end = min([end] + [low - 1 for low in floors if low > c])   # a member whose kept history starts later joins there
    return int(end) if active and end != math.inf else None


def _ran_elsewhere(cast: Cast, g: str, c: int, later: bool) -> tuple[dict, dict]:
    """How often group ``g`` ran each collective at its sequence numbers before ``c`` (``later``: and after it),
    counted once per member and cseq: by (signature, dtype), and by op alone."""
    full: dict[tuple, int] = {}
    ops: dict[Any, int] = {}
    top = math.inf if later else c - 1

    def count(e: Collective, n: int) -> None:
        if n <= 0:
            return
        key = (e.signature(), freeze(e.dtype))
        full[key] = full.get(key, 0) + n
        op = freeze(e.op)   # the signature's form of it (a damaged op may be a list)
        ops[op] = ops.get(op, 0) + n

    def counts(cseq: Any) -> bool:
        return type(cseq) is int and cseq != c and cseq <= top

    for s in cast.parts.values():
        index = s.collectives.get(g)
        if isinstance(index, CollectiveIndex):
            for cseq, e in index.one.items():
                if counts(cseq):
                    count(e, 1)
            for run in index.runs:   # one signature for the whole run: counted at once, not cseq by cseq
                last = min(run.last, top)
                count(run.template, last - run.first + 1 - (run.first <= c <= last))
        elif index:
            for cseq, e in index.items():
                if counts(cseq):
                    count(e, 1)
    return full, ops


def _realigned(cast: Cast, g: str, c: int, tied_ranks: list[Key]) -> bool:
    """The tied members issued one and the same collective at ``c + 1``: their streams line up again after
    ``c`` (a rank that skipped one would be a collective ahead of the others there)."""
    after = set()
    for k in tied_ranks:
        s = cast.parts.get(k)
        e = s.collectives.get(g, {}).get(c + 1) if s is not None else None
        if e is None:
            return False
        after.add((e.signature(), freeze(e.dtype)))
    return len(after) == 1


_TELLS_APART = ("shape", "dtype", "layer", "wave", "parts")


def _sig_text(e: Collective, others: list[Collective]) -> str:
    """``e``'s op, and where the others have the same op, the fields that tell ``e`` from them."""
    if any(freeze(o.op) != freeze(e.op) for o in others):
        return str(e.op)
    differ = [f for f in _TELLS_APART if any(freeze(getattr(o, f)) != freeze(getattr(e, f)) for o in others)]
    return f"{e.op} with " + ", ".join(f"{f} {getattr(e, f)}" for f in differ) if differ else str(e.op)


def _break_tie(cast: Cast, g: str, c: int, by_sig: dict[tuple, list[Key]],
               entries: dict[Key, Collective]) -> tuple[tuple | None, str]:
    """Equal numbers of members issued different collectives at (g, c) (e.g. one rank against one).

    A rank that skipped a collective issues its next one at ``c`` instead, at a later step or in a later state
    than the ranks that did not, and a rank that issued one without cause does so before them: from the traces
    the two read the same, so tied entries issued at different steps or states are left undecided. At one step
    and state the expected one is the collective the group also runs at its other sequence numbers, first by its
    whole signature (op, shape, dtype, layer, wave, parts), then by its op alone: those before ``c`` (what the
    group had already run), and those after it only when the tied members issued the same collective at
    ``c + 1`` (no skip shifted one stream against the other). Returns (reference signature, a note for the
    finding), or (None, a note saying the tie is undecided) when that does not tell one apart.
    """
    top = max(len(ks) for ks in by_sig.values())
    tied = [k for k, ks in by_sig.items() if len(ks) == top]
    issued = {k: entries[by_sig[k][0]] for k in tied}
    tied_ranks = [r for k in tied for r in by_sig[k]]
    at = {(entries[r].step, freeze(entries[r].state)) for r in tied_ranks}
    if len(at) > 1:
        sides = "; ".join(f"{cast.who(by_sig[k])} at step {issued[k].step} in {issued[k].state}" for k in tied)
        return None, (f"a tie at different positions ({sides}): a rank that skipped a collective issues its next "
                      f"one there later than the others, a rank that added one issues it earlier, and the traces "
                      "do not tell the two apart; which is the odd one is undecided, so every rank of the tie is named")
    full, ops = _ran_elsewhere(cast, g, c, later=_realigned(cast, g, c, tied_ranks))
    for seen in (lambda k: full.get((k, freeze(issued[k].dtype)), 0), lambda k: ops.get(freeze(issued[k].op), 0)):
        familiar = [k for k in tied if seen(k) > 0]
        if len(familiar) == 1:
            ref = familiar[0]
            others = [issued[k] for k in tied if k != ref]
            odd = ", ".join(sorted({_sig_text(e, [issued[ref]]) for e in others}))
            return ref, (f"as many ranks issued one collective as the other; {_sig_text(issued[ref], others)} is "
                         f"what group {g} runs at its other sequence numbers, {odd} appears nowhere else in it")
    texts = sorted({_sig_text(e, [o for o in issued.values() if o is not e]) for e in issued.values()})
    texts_said = " as ".join(texts) if len(texts) == 2 else "each of " + ", ".join(texts)
    return None, (f"a tie: as many ranks issued {texts_said}, and group {g}'s other sequence numbers favour none "
                  "of them; which is the odd one is undecided, so every rank of the tie is named")


def _check_one_collective(cast: Cast, g: str, c: int, members: list[Key]) -> Finding | None:
    parts = cast.parts
    entries: dict[Key, Collective] = {}
    absent: list[Key] = []
    for k in members:
        s = parts.get(k)
        e = s.collectives.get(g, {}).get(c) if s is not None else None
        if e is None:
            absent.append(k)
        else:
            entries[k] = e
    if not entries:
        return None
    by_sig: dict[tuple, list[Key]] = {}
    for k, e in entries.items():
        by_sig.setdefault(e.signature(), []).append(k)
    ref_sig = majority(by_sig)
    tie_note, undecided = None, False
    if len(by_sig) > 1 and sorted(map(len, by_sig.values()))[-2:] == [len(by_sig[ref_sig])] * 2:
        decided, tie_note = _break_tie(cast, g, c, by_sig, entries)
        ref_sig, undecided = (ref_sig, True) if decided is None else (decided, False)
    ref = entries[by_sig[ref_sig][0]]
    start_step = min((e.step for e in entries.values() if e.step is not None), default=None)
    open_ = sorted(k for k, e in entries.items() if e.status == "open")
    left = sorted(k for k, e in entries.items() if e.status != "open")
    # absent members: no trace, trace ended before this collective, or went on without it
    no_file = [k for k in absent if k not in parts]
    ended_before = [k for k in absent if k in parts and _ended_before(parts[k], start_step)]
    skipped = [k for k in absent if k in parts and k not in ended_before]
    # went on stepping, nothing more in this group (an async worker stalled there): to a hang, never joined
    idle = [k for k in skipped if parts[k].max_cseq(g) < c]
    who = cast.who

    def positions(joins: list[Key] = ()) -> list[dict]:   # joins: absent ranks a hang reads as never joined
        out = []
        for k in members:
            s = parts.get(k)
            if s is None:
                out.append(cast.position(k, "no_trace", "no trace file"))
                continue
            e = entries.get(k)
            if e is None:
                went = f", nothing more in group {g} though its trace went on" if k in skipped else ""
                status, note = ("skipped", "never issued it but went on: ") if k in skipped and k not in joins \
                    else ("never_joined", f"never joined{went}; ")
                out.append(cast.position(k, status, note + last_seen(s), s.last_step, (s.last or {}).get("state")))
            elif e.signature() != ref_sig:
                out.append(cast.position(k, "different", f"issued {coll_text(e)} at step {e.step} instead"
                                         + ("" if e.status != "open" else ", never finished"), e.step, e.state,
                                         e.layer))
            elif e.status == "open":
                out.append(cast.position(k, "inside", f"inside since step {e.step} ({e.state}), never finished; "
                                         + last_seen(s), e.step, e.state, e.layer))
            elif e.status == "error":
                out.append(cast.position(k, "error", f"left it with an error: {short_error(e.error)}", e.step, e.state,
                                         e.layer))
            else:
                later = s.last_step is not None and e.step is not None and (
                    s.last_step > e.step or s.max_cseq(g) > c)
                note = f"finished it, moved on: {last_seen(s)}" if later else "finished it"
                out.append(cast.position(k, "past" if later else "finished", note, e.step, e.state, e.layer))
        return out

    where = dict(state=ref.state, layer=ref.layer, collective=ref.describe(),
                 members=[k for k in members if k in parts])
    if len(by_sig) > 1:
        others = sorted(k for key, ks in by_sig.items() if key != ref_sig for k in ks)
        odd = entries[others[0]]
        # an undecided tie names both sides: no rank is presented as the certain culprit
        culprits = sorted(others + by_sig[ref_sig]) if undecided else others
        # step and state from the entry they describe: the two sides may stand at different ones
        if (odd.step, freeze(odd.state)) == (ref.step, freeze(ref.state)):
            said = f"{who(others)} issued {coll_text(odd)} where {who(by_sig[ref_sig])} issued {coll_text(ref)}, " \
                   f"at step {ref.step} in {ref.state}"
        else:
            said = f"{who(others)} issued {coll_text(odd)} at step {odd.step} in {odd.state} where " \
                   f"{who(by_sig[ref_sig])} issued {coll_text(ref)} at step {ref.step} in {ref.state}"
        return Finding.of(
            "collective_mismatch", start_step, culprits, said + ("; a tie, undecided" if undecided else ""),
            ranks=positions(), details=[tie_note] if tie_note else [], **where,
        )
    extra = _extra_collective(cast, g, c, entries, ended_before + skipped)
    if extra is not None:
        return Finding.of("collective_mismatch", extra[1], sorted(entries), extra[0], ranks=positions(), **where)
    if (ended_before or no_file or skipped) and open_:
        culprits = sorted(ended_before + no_file + skipped)
        return Finding.of(
            "hang", start_step, culprits,
            f"{who(culprits)} never joined {coll_text(ref)} at step {start_step} in {ref.state}; "
            f"{who(open_)} {'waits' if len(set(open_)) == 1 else 'wait'} inside it"
            + (f", {who(left)} left it" if left else ""),
            ranks=positions(idle), details=[f"{cast.label(k)}: no trace file" for k in no_file], **where,
        )
    # with bounded waits a hang ends in collective_error: the members that gave up had waited
    # for members whose traces stop before they ever joined
    gave_up = sorted(k for k, e in entries.items() if e.status == "error")
    if (ended_before or no_file or idle) and gave_up and len(idle) == len(skipped):
        culprits = sorted(ended_before + no_file + idle)
        return Finding.of(
            "hang", start_step, culprits,
            f"{who(culprits)} never joined {coll_text(ref)} at step {start_step} in {ref.state}; "
            f"{who(gave_up)} gave up waiting inside it ({short_error(entries[gave_up[0]].error)})"
            + (f", {who([k for k in left if k not in gave_up])} finished it" if len(left) > len(gave_up) else ""),
            ranks=positions(idle), details=[f"{cast.label(k)}: no trace file" for k in no_file], **where,
        )
    if skipped:
        return Finding.of(
            "collective_mismatch", start_step, skipped,
            f"{who(skipped)} never issued {coll_text(ref)} (step {start_step}) but went on; "
            f"{who(sorted(entries))} did",
            ranks=positions(), **where,
        )
    if open_ and left:
        finished = all(entries[k].status == "ended" for k in left)
        # a posted collective (async ready flags) completes without its rank; still open, it was never read back
        unread = finished and all(entries[k].posted for k in open_)
        how = ("posted", UNREAD) if unread else ("started", "and never finished")
        return Finding.of("hang", start_step, open_, f"{who(open_)} {how[0]} {coll_text(ref)} at step {start_step} in "
                          f"{ref.state} {how[1]}; {who(left)} {'finished' if finished else 'left'} it",
                          ranks=positions(), **where)
    # posted flags whose every rank then ended (an error elsewhere): nobody waits in them, no hang of theirs
    if open_ and not (all(entries[k].posted and cast.parts[k].end for k in open_) and not no_file):
        return Finding.of(
            "hang", start_step, open_,
            f"every rank that joined {coll_text(ref)} (step {start_step}, {ref.state}) is still inside it"
            + (f"; {who(no_file)} have no trace" if no_file else ""),
            ranks=positions(), **where,
        )
    return None


def _extra_collective(cast: Cast, g: str, c: int, entries: dict[Key, Collective],
                      absent: list[Key]) -> tuple[str, int | None] | None:
    """A minority issued a collective the majority never issued: the minority's sequence is the odd one.

    Every member with a trace that did not issue (g, c) has a sequence in ``g`` that ends
    before it, and they outnumber the ones that did: those issued one collective more than
    the rest (``log_stats`` or ``rearrange()`` called on one rank alone), so they are the
    culprits, never the ranks that went on without it. A trace that just stops (no ``end``, not left on
    purpose, its last record before they started (g, c)) casts no vote: dead ranks must not outvote a survivor;
    nor one still running below the collective's step, not there yet (a pipeline's first stage runs steps ahead).
    """
    first = min((e.ts for e in entries.values() if type(e.ts) in (int, float)), default=None)
    step = next(iter(entries.values())).step if entries else None
    absent = [k for k in absent if (s := cast.parts[k]).end is not None or s.ended_on_purpose or (
        (first is None or s.last_ts is None or s.last_ts >= first)
        and (type(step) is not int or type(s.last_step) is not int or s.last_step >= step))]
    if not entries or len(absent) <= len(entries):
        return None
    if any(cast.parts[k].max_cseq(g) >= c for k in absent):
        return None
    ref = next(iter(entries.values()))
    theirs = max(cast.parts[k].max_cseq(g) for k in absent)
    text = (f"{cast.who(sorted(entries))} issued an extra {coll_text(ref)} at step {ref.step} in {ref.state} that "
            f"{cast.who(sorted(absent))} never issued: its sequence in group {g} runs to cseq "
            f"{max(cast.parts[k].max_cseq(g) for k in entries)}, theirs to cseq {theirs}")
    # where the sequences part: the first cseq the odd rank issued at another step than the others
    odd, other = cast.parts[sorted(entries)[0]], cast.parts[sorted(absent)[0]]
    mine_g, theirs_g = odd.collectives.get(g), other.collectives.get(g)
    for x in sorted(x for x in mine_g if x < c):   # the cseqs it holds (not every number below a far one)
        a, b = mine_g.get(x), theirs_g.get(x)
        if a is not None and b is not None and a.step != b.step:
            return (text + f"; the sequences part at cseq {x}: {cast.label(sorted(entries)[0])} issued it at step "
                    f"{a.step}, {cast.label(sorted(absent)[0])} at step {b.step}", a.step)
    return text, ref.step


def _ended_before(s: RankSummary, step: int | None) -> bool:
    """The participant's trace stops at or before ``step`` (with no records past it)."""
    return step is None or s.last_step is None or s.last_step <= step
