"""The report of an elastic simulation: every ``--scale`` and every process, checked across ranks.

:func:`elastic_report` adds the elastic fields to the plain report of the processes
serving at the end (:func:`final_members`): one entry per scale, the weight and map checks
after each scale, and the outputs of leaving processes too. A joiner that never joined (its
scale aborted: status ``not_joined``) is listed among the processes, not checked as a member.
"""

from __future__ import annotations

from typing import Any, Sequence

from eplb_fsm.sim.elastic import NOT_JOINED, scale_events

__all__ = ["final_members", "elastic_report"]


def final_members(results: Sequence[dict]) -> list[dict]:
    """The processes serving at the end (not left, not stopped, joined), by final rank."""
    finals = [r for r in results if not r["left"] and r.get("status") != NOT_JOINED]
    return sorted(finals, key=lambda r: r["rank"])


def elastic_report(opts: Any, results: Sequence[dict], base: dict) -> dict:
    """Add the elastic fields to ``base`` (``build_report`` of the final members); returns it.

    ``scalings``: one entry per ``--scale`` (``step``, ``from_ranks``, ``to_ranks``,
    ``moved_slots``, ``moved_bytes``, ``seconds`` (slowest rank), ``outcome``, ``generation``,
    ``kind``, ``agree``; ``outcome`` is the ranks' common one: ``switched``, ``aborted`` or
    ``failed``, else ``mixed``; ``skipped`` when the group had that size already, an earlier scale
    having aborted; ``not_reached`` when the run ended first); ``outputs_unchanged`` and
    ``weights_exact`` cover every process, leaving ones included, and the checks after every
    scale; ``processes`` lists them, each with
    ``status`` (``finished``, ``left``, or ``not_joined`` with its ``reason``: a joiner of a scale that
    aborted, ok only when its scale's outcome is ``aborted``).
    """
    events = scale_events(opts)
    everyone, results = results, [r for r in results if r.get("status") != NOT_JOINED]
    scalings = []
    for index, event in enumerate(events):
        gen = index + 1
        entries = [s for r in results for s in r["scalings"] if s["generation"] == gen]
        skipped = [c for r in results for c in r["checks"] if c.get("at") == "skipped" and c["generation"] == gen]
        if not entries:
            # the same keys as a scale that ran (docs/elastic.md), so a reader needs no special case
            scalings.append({"step": event.step, "generation": gen, "kind": None, "requested_ranks": event.ranks,
                             "outcome": "skipped" if skipped else "not_reached", "from_ranks": None,
                             "to_ranks": None, "moved_slots": 0, "moved_bytes": 0, "seconds": 0.0,
                             # parse_scale_specs refuses a size the group would already have: only an
                             # earlier scale that aborted instead of switching leads here
                             "reason": ("the group already had that many ranks (an earlier scale did not switch)"
                                        if skipped else "the run ended before this step"),
                             "lost_experts": [], "agree": True})
            continue
        outcomes = {s["outcome"] for s in entries} - {"left"}
        ref = entries[0]
        scalings.append({
            "step": ref["step"],
            "generation": gen,
            "kind": ref["kind"],
            "from_ranks": ref["from_ranks"],
            "to_ranks": ref["to_ranks"],
            "requested_ranks": ref["requested_ranks"],
            "outcome": outcomes.pop() if len(outcomes) == 1 else "mixed",
            "moved_slots": max(s["moved_slots"] for s in entries),
            "moved_bytes": max(s["moved_bytes"] for s in entries),
            "seconds": round(max(s["seconds"] for s in entries), 4),
            "reason": next((s["reason"] for s in entries if s["reason"]), None),
            "lost_experts": next((s["lost_experts"] for s in entries if s["lost_experts"]), []),
            "agree": len({(s["outcome"] if s["outcome"] != "left" else "switched", s["moved_slots"])
                          for s in entries}) == 1,
        })
    # after each scale every member must hold bit-exact rows and the same maps
    scale_checks_ok = True
    by_gen: dict[int, set] = {}
    for r in results:
        for c in r["checks"]:
            if "bad_rows" in c:
                scale_checks_ok &= not c["bad_rows"] and c["gates_exact"]
                by_gen.setdefault(c["generation"], set()).add(c["maps_crc"])
    maps_each_scale = all(len(v) == 1 for v in by_gen.values())
    finals = final_members(results)
    joined = max((r["start_step"] for r in finals), default=0)
    sigs = [[(h["step"], h["outcome"], h["moves"]) for h in r["history"] if h["step"] >= joined] for r in finals]
    base["histories_agree"] = all(s == sigs[0] for s in sigs)
    base["outputs_unchanged"] = all(r["mismatches"] == 0 for r in results) and any(r["output_checks"] for r in results)
    base["output_checks"] = sum(r["output_checks"] for r in results)
    base["weights_exact"] = all(r["weights_exact"] for r in results) and scale_checks_ok
    base["maps_agree"] = bool(base["maps_agree"]) and maps_each_scale
    base["scalings"] = scalings
    base["final_ranks"] = len(finals)
    base["processes"] = [_process_entry(r) for r in everyone]
    base["traces"] = sorted({r["trace"] for r in everyone if r["trace"]})
    # a joiner may miss only a scale that aborted: one that switched (or failed) without it is no clean abort
    outcome = {s["generation"]: s["outcome"] for s in scalings}
    joiners_ok = all(outcome.get(r["generation"]) == "aborted" for r in everyone if r.get("status") == NOT_JOINED)
    base["ok"] = bool(base["outputs_unchanged"] and base["weights_exact"] and base["maps_agree"]
                      and base["histories_agree"] and len(set(base["final_states"])) == 1 and joiners_ok
                      and all(s["agree"] for s in scalings) and not any(r["stop_reason"] for r in results))
    return base


def _process_entry(r: dict) -> dict:
    """One process of ``report["processes"]``: who it was, when it served, how it ended."""
    if r.get("status") == NOT_JOINED:
        return {"process": r["process"], "role": r["role"], "start_step": r["start_step"], "end_step": r["steps"],
                "left": False, "final_rank": None, "final_state": None, "stop_reason": None,
                "status": NOT_JOINED, "reason": r["reason"], "generation": r["generation"], "rank": r["rank"]}
    return {"process": r["process"], "role": r["role"], "start_step": r["start_step"], "end_step": r["steps"],
            "left": r["left"], "final_rank": None if r["left"] else r["rank"], "final_state": r["final_state"],
            "stop_reason": r["stop_reason"], "status": "left" if r["left"] else "finished", "reason": None}
