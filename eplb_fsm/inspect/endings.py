"""How a participant's ``end`` reads to replay: a reaction to what happened to others, or a cause.

A rank that notices a peer gone or a wait run out ends with one of a few error forms
(:data:`WAIT_ERROR`), or sat in a collective a peer never finished (:func:`waits_on_peer`), or
had its own last collective fail that way at the step it ended (:func:`failed_wait_first`):
those exceptions are consequences. :func:`ended_in_reaction` adds an orderly close. Anything
else a rank ended with (an engine error, a signal) explains itself.
"""

from __future__ import annotations

import re
from typing import Any

from eplb_fsm.inspect.elastic import Cast, Key
from eplb_fsm.inspect.findings import coll_text, short_error

__all__ = ["CONNECTION_LOST", "WAIT_ERROR", "ended_in_reaction", "entries", "failed_wait_first", "failed_waits",
           "waits_on_peer"]

# the forms of a wait whose peer's sockets closed (its process went away); no timeout (a frozen peer closes nothing)
_LOST = r"Connection (?:closed|reset) by peer|(?:Read|Write) error \[|writev \[|Broken pipe|Connection refused"
CONNECTION_LOST = re.compile(_LOST, re.I)

# how a rank notices that a peer is gone or a wait ran out: gloo's pair and buffer errors, torch's Work.wait
# and store timeouts, NCCL's watchdog and remote errors, the controller's GroupBroken and its transfer that "ran
# past collective_timeout_s", the simulator's RankFault (a rank stopping after its controller handled a fault).
# A word alone ("timeout", "NCCL") is no such form: an engine's KeyError about request_timeout or a CUDA fault
# is a crash of its own
WAIT_ERROR = re.compile(
    r"\bGroupBroken\b|" + _LOST + "|"
    r"Timed out waiting \d+ ?ms for (?:send|recv)|Operation timed out!|Socket Timeout|wait timeout after|"
    r"Watchdog caught collective operation timeout|NCCL communicator was aborted|ncclRemoteError|"
    r"remote process exiting prematurely|timed out waiting for rank|ran past collective_timeout_s|"
    r"Application timeout caused pair closure|client socket has timed out|Timeout waiting for key|"
    r"niced call .* did not return within|"
    r"^RankFault: .* its controller fired fault", re.I)


def entries(s) -> list:
    """Every collective the participant read one by one (a bulk run holds only ones that ended alike)."""
    return [e for index in s.collectives.values() for e in getattr(index, "one", index).values()]


def ended_since(s, waiting: dict) -> bool:
    """Whether the collective an ``alive`` record's ``waiting_on`` names ended well on this rank later (the
    record is a second old when the rank fails in a later one: it no longer says where the rank waits)."""
    group = waiting.get("group")
    entry = s.collectives.get(group, {}).get(waiting.get("cseq")) if isinstance(group, str) else None
    return entry is not None and entry.status == "ended"


def last_wait(s) -> Any:
    """The latest collective (by its start) the participant is still inside, or whose wait failed at the step
    it ended at or later (an engine's collective carries the step in progress, one past the controller's; an
    earlier failure it recovered from says nothing of its end), or None."""
    step = (s.end or {}).get("step", s.last_step)
    waits = [e for e in entries(s) if type(e.ts) in (int, float) and (e.status == "open" or (
        e.status == "error" and type(e.step) is int and type(step) is int and e.step >= step))]
    return max(waits, key=lambda e: e.ts, default=None)


def peer_text(op: str, peer: int | None) -> str:
    """`` to rank 1`` (a send's) or `` from rank 1`` (a recv's): whom a point-to-point wait waits on; '' unknown."""
    return "" if peer is None else f" {'to' if op == 'send' else 'from'} rank {peer}"


def waiting_text(s) -> str:
    """What the participant was waiting on at its last alive record, unless that collective ended since; else
    the latest collective it was left inside or whose wait failed (:func:`last_wait`); else the engine's collective
    that record names (``engine_wait``)."""
    waiting = s.alive[-1][3] if s.alive else None
    if waiting and not ended_since(s, waiting):
        return f"waiting in {waiting.get('op')} (group {waiting.get('group')}, cseq {waiting.get('cseq')})"
    last = last_wait(s)
    if last is not None:
        return f"{'inside' if last.status == 'open' else 'waiting in'} {coll_text(last)}"
    engine = s.alive[-1][4] if s.alive else None   # (op, on the controller's ranks, call, main thread) or None
    mine = s.alive[-1][5] if s.alive else None   # the main thread's own wait, named apart (main_wait)
    if engine and engine[3] is not False:
        return f"in no controller collective, inside the engine's {engine[0]}"
    if mine:
        return (f"in no controller collective, inside the engine's {mine[0]}{peer_text(mine[0], mine[4])} "
                f"({mine[1] or 'its main thread'})")
    if engine:
        return f"in no controller collective, its main thread in its own work (a side thread in {engine[0]})"
    return "in no controller collective (so in the engine's step or its own work)"


def ending_text(s) -> str:
    """How the participant's trace ended, in words (its ``end`` record, or none)."""
    if (end := s.end) is None:
        return "no end record"
    how = end.get("how")
    if how == "exception":
        return f"ended with an exception: {end.get('error')}"
    if how == "signal":
        return f"stopped by {end.get('signal') or 'a signal'}"
    return f"ended: {how}"


def waits_on_peer(cast: Cast, key: Key) -> bool:
    """Whether the participant sat in a collective some other member had not finished (its error ended a wait).

    A collective every other member finished is no wait: an async rank's posted all-reduce stays
    open from one step to the next, so a rank that raises in its own code in between (a crash)
    leaves one open that its peers had long read.
    """
    s = cast.parts[key]
    opened = [(c.group, c.cseq) for c in s.open_collectives()]
    waiting = s.alive[-1][3] if s.alive else None
    if waiting:
        opened.append((waiting.get("group"), waiting.get("cseq")))
    for g, c in opened:
        for m in cast.members(g) if isinstance(g, str) else []:
            peer = cast.parts.get(m)
            entry = peer.collectives.get(g, {}).get(c) if peer is not None else None
            if m != key and (entry is None or entry.status != "ended"):
                return True
    return False


def failed_wait_first(s) -> bool:
    """Its latest collective failed on a wait (a peer gone, a timeout) at the step it ended with an exception:
    the engine raised because the controller had failed (e.g. a ``failed`` state after a broken group)."""
    errors = [e for e in entries(s) if e.status == "error" and type(e.ts) in (int, float)]
    last = max(errors, key=lambda e: e.ts, default=None)
    return last is not None and last.step == (s.end or {}).get("step", s.last_step) \
        and bool(WAIT_ERROR.search(str(last.error or "")))


def ended_in_reaction(cast: Cast, key: Key) -> bool:
    """``key``'s ``end`` is closed, or an exception from a failed wait (the rule ``check_liveness`` applies)."""
    s = cast.parts[key]
    how = s.end.get("how")
    if how == "closed":
        return True
    return how == "exception" and bool(
        WAIT_ERROR.search(str(s.end.get("error") or "")) or waits_on_peer(cast, key) or failed_wait_first(s))


def failed_waits(cast: Cast, keys: list[Key], step: int, since: int | None = None) -> str:
    """The first collective whose wait failed at ``step`` (or, with ``since``, after step ``since`` up to ``step``:
    an async rank's wait fails a step before the rollback) on some of ``keys``, in words ('' when none, or when the
    ranks issued different collectives there). With no rank late, dead, frozen or signalled, a wait that ran out in a
    collective every one of them had joined alike is the transport's: the messages between members stopped (a real
    link dropped between two ranks reads so)."""
    failed: dict[tuple, list] = {}
    for k in keys:
        for g, index in cast.parts[k].collectives.items():
            for c, e in index.one.items():
                if e.status == "error" and type(e.step) is int and (
                        e.step == step if since is None else since < e.step <= step):
                    failed.setdefault((g, c), []).append((k, e))
    if not failed:
        return ""
    (g, c), hits = min(failed.items(), key=lambda kv: min(_when(e) for _, e in kv[1]))
    # every member's collective there, not only the aborting ranks': a rank that aborted alone may have waited in
    # another collective than its peers (an injected wrong broadcast under load read as the network's)
    members = [m for m in (cast.members(g) if isinstance(g, str) else []) if m in cast.parts]
    joined = [cast.parts[k].collectives.get(g, {}).get(c) for k in dict.fromkeys([*keys, *members])]
    if len({e.signature() for e in joined if e is not None}) > 1:
        return ""   # ranks issued different collectives there: the mismatch is the story, not the wait
    text = f"the wait in {coll_text(hits[0][1])} failed on {cast.who([k for k, _ in hits])} " \
           f"({short_error(hits[0][1].error)})"
    if all(e is not None for e in joined):
        text += ", though every rank had joined it: the messages between them stopped (the network?)"
    return text


def _when(e) -> float:
    ts = e.error_ts if type(e.error_ts) in (int, float) else e.ts
    return ts if type(ts) in (int, float) else float("inf")
