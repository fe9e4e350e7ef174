"""The ``rank_died`` finding of ranks that died together (``liveness.check_liveness`` decides who died, and why)."""

from __future__ import annotations

from eplb_fsm.inspect.elastic import Cast
from eplb_fsm.inspect.findings import Finding, last_seen

__all__ = ["died_finding"]


def died_finding(cast: Cast, dead: list[tuple]) -> Finding:
    """One ``rank_died`` finding for participants that died together (``dead``: (last ts, key, (why, detail)),
    earliest first). Step and state are the first one's; a rank that stopped elsewhere says where, in brackets."""
    keys = [d[1] for d in dead]
    s = cast.parts[keys[0]]
    step = s.last_step
    why = dead[0][2][0]
    if not why.startswith("while") and (len(keys) > 1 or why.startswith("trace")):   # whose: the first to stop
        why = ("its " if len(keys) == 1 else f"{cast.label(keys[0])}'s ") + why
    elsewhere = [f"{cast.label(k)} at step {o.last_step} in {o.final_state}" for k in keys[1:]
                 if ((o := cast.parts[k]).last_step, o.final_state) != (step, s.final_state)]
    return Finding.of(
        "rank_died", step, keys,
        f"{cast.who(keys)} died (SIGKILL?) at step {step} in {s.final_state}"
        + (f" ({', '.join(elsewhere)})" if elsewhere else "") + ": no end record"
        + (" on any of them" if len(keys) > 1 else "") + f", {why}",
        state=s.final_state, layer=s.final_layer,
        ranks=[cast.position(k, "died", last_seen(cast.parts[k]), cast.parts[k].last_step,
                             cast.parts[k].final_state, cast.parts[k].final_layer) for k in keys],
        details=[f"{cast.label(k)}: {reason[1]} (a process frozen for good looks the same)" for _, k, reason in dead
                 if reason[1]],
    )
