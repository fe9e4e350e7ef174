"""One ``transition`` record (or ``steps`` run) re-driven through the machine definition, for ``walker.Walker``.

Moved out of walker.py to keep modules small: it reads and updates the walker's replayed
state (``state``, ``layer``, ``pending``, ``num_layers``) and its summary.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from eplb_fsm.fsm.machine import COMMITTING, EVENT_DATA, TRANSFERRING
from eplb_fsm.inspect.model import SCALE_TRIGGERS, Transition, compact_record
from eplb_fsm.inspect.records import REQUEST_KEYS
from eplb_fsm.trace_fields import PENDING_CLEARED, PENDING_SET

if TYPE_CHECKING:
    from eplb_fsm.inspect.walker import Walker

__all__ = ["replay_steps_run", "replay_transition"]


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
    st = rec.get("state")
    if w.state is None:
        w.state = st
    elif st != w.state:
        w.illegal(rec, f"steps record stamped {st!r} but the replayed state is {w.state!r}", w.state)
        w.state = st
    w.plain_ok = w.steps_keep_state(False)
    if not w.plain_ok:
        w.illegal(rec, f"a steps record says the state stayed {w.state!r}, the machine does not keep it", w.state)


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
    if not reasons or (len(reasons) == 1 and src != replayed):
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
    if not (trig == "step" and src == dst):
        s.transitions.append(Transition(rec.get("step"), trig, src, dst, rec_layer, rec.get("seq"),
                                        rec.get("generation") if trig in SCALE_TRIGGERS else None))
        if trig == "fault":
            s.faults.append(compact_record(rec))
        elif trig == "scale_requested":
            s.scale_requests.append({k: rec.get(k) for k in REQUEST_KEYS})
        s.progress_after_stuck = True
