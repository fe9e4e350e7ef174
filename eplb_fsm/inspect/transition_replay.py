"""One ``transition`` record (or ``steps`` run) re-driven through the machine definition, for ``walker.Walker``.

Moved out of walker.py to keep modules small: it reads and updates the walker's replayed
state (``state``, ``layer``, ``pending``, ``num_layers``) and its summary.

A record whose recorded source (or stamped state) is not the replayed state, right after lines
the trace lost (a stretch of ``seq`` in ``RankSummary.gaps`` that lies after the session's previous
transition record, or lines lost just before a step record), is explained by them: they held the
state change(s) in between. So is a ``transferring`` record whose source agrees but whose layer does not,
after such lines when there are at least as many of them as the state changes in between (layer_done forward, or
the rest of one rearrangement and the start of the next: ``CYCLE_CHANGES`` and more); one lost ``alive`` line
before a repeated ``layer_done`` explains nothing. The walk goes on from the recorded state (and layer) as for
any such record;
``settle_lost_changes`` (at the end of the session) takes the mismatch out of ``illegal`` and keeps
on the gap what it must have held (``state_from``, ``state_to``), once the gap is known to be lines
lost (not a foreign line or a swap, which ``seqcheck`` takes back). A record the machine refuses
even from its recorded source stays illegal.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from eplb_fsm.fsm.machine import COMMITTING, EVENT_DATA, TRANSFERRING
from eplb_fsm.inspect.model import SCALE_TRIGGERS, Transition, compact_record
from eplb_fsm.inspect.records import REQUEST_KEYS
from eplb_fsm.trace_fields import PENDING_CLEARED, PENDING_SET

if TYPE_CHECKING:
    from eplb_fsm.inspect.walker import Walker

__all__ = ["lost_change", "replay_steps_run", "replay_transition", "settle_lost_changes"]


def replay_steps_run(w: "Walker", rec: dict) -> None:
    """A ``steps`` record: ``count`` quiet steps of its state, each the internal ``step`` (due false)."""
    count = rec.get("count")
    if type(count) is not int or count < 1:
        w.s.warnings.append(f"{w.where()}: steps record without a positive integer count; not counted")
        return
    step, seq, before = rec.get("step"), w.step_seq, w.n_steps + w.run_steps
    if type(step) is not int or step - before != seq.base or len(w.s.transitions) != seq.tlen:   # else: runs on
        seq.run(step, step + count - 1 if type(step) is int else None, count, before, w.s.transitions)
    w.run_steps += count
    st, stamped = rec.get("state"), None
    if w.state is None:
        w.state = st
    elif st != w.state:
        w.illegal(rec, f"steps record stamped {st!r} but the replayed state is {w.state!r}", w.state)
        stamped, w.state = w.s.illegal[-1], st
    w.plain_ok = w.steps_keep_state(False)
    if not w.plain_ok:
        w.illegal(rec, f"a steps record says the state stayed {w.state!r}, the machine does not keep it", w.state)
    elif stamped is not None:
        lost_change(w, rec, stamped)


def lost_since(w: "Walker") -> list[dict]:
    """The session's stretches of lost lines after its last transition record (any, before the first one)."""
    lo = -1 if w.trans_seq is None else w.trans_seq
    return [g for g in w.s.gaps if g["last"] > lo]


# the fewest state changes from transferring back into transferring at layer 0 through a new plan: fault, recovered,
# step, plan_ready (the rest of the rearrangement, layer_done ... committed, then step and plan_ready, is longer)
CYCLE_CHANGES = 4


def _could_hold(w: "Walker", layer: int) -> bool:
    """Lines lost since the session's last transition record are enough to hold the state changes that take the
    replayed layer ``w.layer`` in transferring to ``layer`` (one line per state change): ``layer - w.layer``
    layer_done forward, else ``CYCLE_CHANGES + layer`` through a new plan."""
    need = layer - w.layer if layer > w.layer else CYCLE_CHANGES + layer
    return sum(g["lost"] for g in lost_since(w)) >= need


def lost_change(w: "Walker", rec: dict, entry: dict) -> None:
    """``entry`` (just put in ``illegal``: ``rec``'s recorded source or stamped state is not the replayed one)
    may be lines lost since the session's previous transition record: keep it for ``settle_lost_changes``.
    Every record's ``seq`` is checked before it is judged, so a gap just before ``rec`` is already known."""
    gaps = lost_since(w)
    if gaps:
        w.lost_changes.append((entry, gaps))


def settle_lost_changes(w: "Walker") -> None:
    """The mismatches ``lost_change`` kept whose gap is still lines lost (``seqcheck`` takes back a jump that was
    a foreign line or a swap) leave ``illegal``; the gap keeps the state change(s) it must have held."""
    s, explained = w.s, []
    for entry, gaps in w.lost_changes:
        held = [g for g in gaps if any(g is h for h in s.gaps)]
        if held:
            gap = held[-1]
            gap.setdefault("state_from", entry["replayed_state"])
            gap["state_to"] = entry["source"]
            explained.append((entry, gap))
    if not explained:
        return
    s.illegal[:] = [i for i in s.illegal if not any(i is e for e, _ in explained)]
    entry, gap = explained[0]
    seqs = f"seq {gap['first']}" if gap["first"] == gap["last"] else f"seq {gap['first']}..{gap['last']}"
    s.warnings.append(f"lines lost before {len(explained)} record(s) held state changes the replay did not see "
                      f"(first: {seqs}, from {entry['replayed_state']!r} to {entry['source']!r}); not illegal: the "
                      "replay goes on from the state recorded after them")


def replay_transition(w: "Walker", rec: dict) -> None:
    """Re-drive one ``transition`` record through the machine (``Walker.record`` calls it); an illegal one is
    recorded with its reason and the walk resynchronises on what the record claims."""
    s = w.s
    trig = rec.get("trigger")
    src = rec.get("source")
    dst = rec.get("dest")
    rec_layer = rec.get("layer")
    if rec.get("num_layers") is not None:
        w.num_layers = int(rec["num_layers"])
    allowed = EVENT_DATA.get(trig)
    data_src = rec.get("data") if isinstance(rec.get("data"), dict) else rec
    data = {} if allowed is None else {k: data_src[k] for k in allowed if k in data_src}
    if w.state is None or not w.layer_known:  # the trace starts here: trust the first source (and its layer)
        w.state = w.state or src
        w.layer_known = True
        if src == TRANSFERRING and isinstance(rec_layer, int):
            w.layer = rec_layer
    reasons = []
    replayed = w.state
    if src != w.state:
        reasons.append(f"recorded source {src!r} but the replayed state is {w.state!r}")
        w.state = src
        if src == TRANSFERRING and isinstance(rec_layer, int) and lost_since(w):
            w.layer = rec_layer   # the lost lines held the layer's changes too: as where a trace starts
    elif src == TRANSFERRING and isinstance(rec_layer, int) and rec_layer != w.layer and _could_hold(w, rec_layer):
        # lines lost since the last transition record spanned whole state changes back into transferring (the rest
        # of one rearrangement and the start of another): the source agrees, the layer does not; without lost
        # lines enough for those changes such a record stays one the machine refuses
        reasons.append(f"recorded layer {rec_layer} but the replayed layer is {w.layer}")
        w.layer = rec_layer
    resynced = bool(reasons)    # the one reason so far: the walk took the record's source (and layer) on trust
    nl = w.num_layers
    if nl is None:
        if trig == "layer_done" and dst == COMMITTING and isinstance(data.get("layer"), int):
            nl = data["layer"] + 1
        else:
            nl = 1 << 20
        if not w.warned_layers:
            s.warnings.append("transition records carry no num_layers; layer guards are checked loosely")
            w.warned_layers = True
    if allowed is None:
        out: tuple | str = f"unknown event {trig!r}"
    else:
        out = w.oracle.outcome(w.state, w.layer, nl, w.pending, trig, data)
    layer_after = rec.get("layer_after")
    if isinstance(out, str):
        reasons.append(f"the machine refuses it: {out}")
    elif out[0] != dst:
        reasons.append(f"the machine goes to {out[0]!r}, the trace says {dst!r}")
    elif isinstance(layer_after, int) and out[1] != layer_after and dst == TRANSFERRING:
        reasons.append(f"the machine is at layer {out[1]} after it, the trace says {layer_after}")
    if reasons:
        w.illegal(rec, "; ".join(reasons), replayed)
    if not reasons or (len(reasons) == 1 and resynced):
        if reasons:    # legal from the recorded source: lines lost since the previous transition may hold the rest
            lost_change(w, rec, w.s.illegal[-1])
        # legal, or legal from the recorded source (records lost before it left the replay behind): the machine's
        # answer is the state to go on from, scale flag included (a fault clears it, groups_ready sets it)
        w.state, w.layer, w.pending = out
    else:
        # resynchronise on what the trace claims
        w.state = dst
        if dst == TRANSFERRING:
            if isinstance(layer_after, int):
                w.layer = layer_after
            elif trig == "layer_done" and isinstance(data.get("layer"), int):
                w.layer = data["layer"] + 1
            elif isinstance(rec_layer, int):
                w.layer = rec_layer
            else:
                w.layer = 0
        if trig in PENDING_SET:   # the machine's own before-hooks set and clear the flag on these
            w.pending = True
        elif trig in PENDING_CLEARED:
            w.pending = False
    w.trans_seq = w.seqs.prev   # lines lost after this record can explain the next one's source
    if not (trig == "step" and src == dst):
        s.transitions.append(Transition(rec.get("step"), trig, src, dst, rec_layer, rec.get("seq"),
                                        rec.get("generation") if trig in SCALE_TRIGGERS else None))
        if trig == "fault":
            # an elastic scale's own fault (its transfer failed) names the scale: late.py lists it with the scales
            s.faults.append(dict(compact_record(rec), scale=rec["scale"]) if rec.get("scale") is not None
                            else compact_record(rec))
        elif trig == "scale_requested":
            s.scale_requests.append({k: rec.get(k) for k in REQUEST_KEYS})
        s.progress_after_stuck = True
