"""The report of ``eplb-fsm simulate``: built from the ranks' results, and formatted as text.

:func:`build_report` turns every rank's result into one dict (what ``--json`` prints);
:func:`build_failed_report` describes a run whose ranks did not all finish, from the
launcher's error and the last record of each trace; :func:`replay_verdict` adds the
replay of the traces; :func:`format_report` writes either report for a terminal.
"""

from __future__ import annotations

import json
import re
from collections import deque
from pathlib import Path
from typing import Any

__all__ = ["build_report", "build_failed_report", "replay_verdict", "format_report", "format_scalings"]


def _last_record(path: Path, start: int = 0, run_id: str | None = None) -> dict | None:
    """The last readable record of a trace file past byte ``start`` (where this run began appending; a
    half-written last line is skipped); None when the run wrote nothing there. ``run_id``: only records
    of a session whose header carries it count, as another process may append past ``start`` too (a run
    already writing the file when this one began: this run's ranks were refused it)."""
    tail: deque[bytes] = deque(maxlen=16)   # the last lines that count: the very last may be half-written
    mine = run_id is None
    try:
        with open(path, "rb") as fh:
            if run_id is None:   # every record past `start` counts: the file's tail is enough
                start = max(start, fh.seek(0, 2) - 65536)
            fh.seek(start)
            for raw in fh:
                if run_id is not None and b'"header"' in raw:
                    rec = _record(raw)
                    if rec is not None and rec.get("event") == "header":
                        mine = rec.get("run_id") == run_id   # a header opens a session, this run's or not
                if mine:
                    tail.append(raw)
    except OSError:
        return None
    return next((rec for rec in map(_record, reversed(tail)) if rec is not None), None)


def _record(raw: bytes) -> dict | None:
    """One trace line as a dict, or None (not JSON, or not an object)."""
    try:
        rec = json.loads(raw.decode("utf-8", "replace"))
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


def _own_run_ids(log_dir: Any) -> dict[str, str] | None:
    """Trace file name -> the run id of this run's sessions in it (a file left out has none); None for a
    plain path. A ``TraceDir``'s run id (the one replay reads); when the ranks' run-identity agreement
    failed, each file's first header past ``start`` (its rank's own id)."""
    if getattr(log_dir, "start", None) is None:
        return None
    from eplb_fsm.commands.simulate_checks import header_run_ids, split_run_ids

    run_id = log_dir.run_id
    if run_id is None:
        return {}
    if split_run_ids(log_dir):
        return {name: first for name, (_, first) in header_run_ids(log_dir).items()}
    return {path.name: run_id for path in Path(log_dir).glob("*.jsonl")}


def _reason(text: str) -> str:
    """The last line of a rank's traceback (the exception), or the launcher's note."""
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    if not lines:
        return "?"
    # "package.module.SomeError: message" -> "SomeError: message"
    last = re.sub(r"^(?:[A-Za-z_]\w*\.)+(?=[A-Za-z_]\w*(?::|$))", "", lines[-1])
    # gloo's messages: drop the C++ source location and the boilerplate after the first sentence
    last = re.sub(r"\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", last)
    return last.split(". This is typically")[0]


def _returned_status(value: dict, steps: int | None) -> tuple[str, str | None]:
    """``(status, reason)`` of a rank that returned: ``finished`` only when it ran every step and its machine did
    not fail; ``failed`` when it stopped on a failed scale (its ``stop_reason``) or its machine ended ``failed``;
    ``left`` when it left the group at a scale-down; ``stopped`` when it returned early for another reason."""
    ran = value.get("steps")
    if value.get("stop_reason") or value.get("final_state") == "failed":
        return "failed", value.get("stop_reason") or f"its state machine ended in state failed after {ran} step(s)"
    if value.get("left"):
        return "left", None
    if isinstance(ran, int) and isinstance(steps, int) and ran < steps:
        return "stopped", f"returned after {ran} of {steps} steps"
    return "finished", None


def build_failed_report(opts, exc: Exception, wall_s: float) -> dict:
    """The report of a run whose ranks did not all finish: what each rank did and where it stopped."""
    from eplb_fsm.sim.elastic import JOINER_ID, NOT_JOINED
    from eplb_fsm.sim.launcher import FORKSERVER_LOST, RanksTimeoutError
    from eplb_fsm.trace import trace_path

    failures = dict(getattr(exc, "failures", {}) or {})
    values = dict(getattr(exc, "values", {}) or {})
    pending = set(getattr(exc, "pending", []) or [])
    ranks = []
    # first ranks by rank, then the joiners of --scale by process id (JOINER_ID * (scale + 1) + rank)
    started = set(getattr(exc, "processes", []) or [])  # elastic runs: every process the launcher started
    joiners = sorted(k for k in set(failures) | set(values) | pending | started if k >= opts.ranks)
    own = _own_run_ids(opts.log_dir)  # None: a plain path, every record past `start` counts
    for r in list(range(opts.ranks)) + joiners:
        process = r
        r = r % JOINER_ID if process >= opts.ranks else r
        # a joiner of the i-th --scale (process JOINER_ID * (i + 1) + rank) writes its own file, generation i + 1
        path = trace_path(opts.log_dir, r, process // JOINER_ID if process >= opts.ranks else 0)
        start = getattr(opts.log_dir, "start", {}).get(path.name, 0)  # a reused --trace-dir: this run's part
        run_id = None if own is None else own.get(path.name)
        last = _last_record(path, start, run_id) if path.is_file() and (own is None or run_id) else None
        if process in values and values[process].get("status") == NOT_JOINED:  # its scale aborted: no failure
            status, reason = NOT_JOINED, values[process].get("reason")
        elif process in values:
            status, reason = _returned_status(values[process], getattr(opts, "steps", None))
        elif process in failures:
            reason = _reason(failures[process])
            # "lost": it ran on when its forkserver died, and the launcher stopped it
            status = ("died" if reason.startswith("process exited with code")
                      else "lost" if reason == FORKSERVER_LOST else "failed")
        elif process in pending:
            status, reason = "timed_out", f"still running at the {getattr(exc, 'timeout', 0):g} s deadline (killed)"
        else:
            status, reason = "stopped", "stopped by the launcher after another rank failed"
        # a plain path: any growth past `start`; a TraceDir: a session of this run's in the file
        wrote = bool(last) if own is not None else path.is_file() and path.stat().st_size > start
        if last and last.get("event") == "rearrangement":  # its `step` is the due step
            last = dict(last, step=last.get("end_step", last.get("step")))
        ranks.append({"rank": r, "process": process, "role": "joiner" if process >= opts.ranks else "initial",
                      "status": status, "reason": reason,
                      "last_step": last.get("step") if last else None,
                      "last_state": last.get("state") if last else None,
                      "last_event": last.get("event") if last else None,
                      "trace": str(path) if wrote else None})
    report = {
        "config": opts.config_dict(),
        "ok": False,
        "failed": True,
        "error": ("timeout" if isinstance(exc, RanksTimeoutError)
                  else "forkserver_died" if any(e["status"] == "lost" for e in ranks) else "ranks_failed"),
        "deadline_s": getattr(exc, "timeout", None) if isinstance(exc, RanksTimeoutError) else None,
        "ranks": ranks,
        "failed_ranks": [e["rank"] for e in ranks if e["status"] in ("failed", "died", "timed_out")],
        "failed_processes": [e["process"] for e in ranks if e["status"] in ("failed", "died", "timed_out")],
        "final_states": [e["last_state"] for e in ranks],
        "log_dir": opts.log_dir,
        "traces": [e["trace"] for e in ranks if e["trace"]],
        "wall_s": _r(wall_s, 2),
    }
    if opts.extra.get("inject"):
        report["inject"] = list(opts.extra["inject"])
    return report


def replay_verdict(log_dir: str, run_id: str | None = None) -> dict:
    """Replay the traces of run ``run_id`` in ``log_dir`` (eplb_fsm.inspect.replay): the verdict and where it points.

    Default ``run_id``: the run ``log_dir`` names when it knows its own (a ``TraceDir``, see
    ``simulate_checks``), so that the traces of earlier runs in a reused folder are left out.
    """
    if run_id is None and getattr(log_dir, "start", None) is not None:
        from eplb_fsm.commands.simulate_checks import split_run_ids

        run_id = log_dir.run_id  # type: ignore[attr-defined]
        if run_id is None:
            return {"verdict": "unavailable", "summary": f"this run wrote no trace header in {log_dir}",
                    "culprit_ranks": []}
        split = split_run_ids(log_dir)
        if split:  # a replay of rank 0's id would call every other rank missing: say what happened instead
            return {"verdict": "unavailable", "summary": split, "culprit_ranks": []}
    try:
        from eplb_fsm.inspect.replay import replay_dir

        rep = replay_dir(log_dir, run_id=run_id)
    except Exception as exc:  # the report must come out even if the traces can't be replayed
        return {"verdict": "unavailable", "summary": f"{type(exc).__name__}: {exc}", "culprit_ranks": []}
    return {"verdict": rep.verdict, "summary": rep.summary, "culprit_ranks": rep.culprit_ranks, "step": rep.step,
            "state": rep.state, "layer": rep.layer, "collective": rep.collective,
            "illegal_transitions": len(rep.illegal_transitions)}


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _r(value: Any, digits: int = 4) -> Any:
    return round(value, digits) if isinstance(value, float) else value


def build_report(opts, results: list[dict], wall_s: float) -> dict:
    """The simulation's report from every rank's result (rank 0 speaks for shared values)."""
    first = results[0]
    series = first["balancedness"]
    by_step = dict(series)
    rearrangements = []
    for h in first["history"]:
        before = [v for s, v in series if h["step"] - opts.window < s <= h["step"]]
        after = [by_step[s] for s in range(h["end_step"] + 1, h["end_step"] + 1 + opts.window) if s in by_step]
        rearrangements.append({
            "index": h["index"],
            "step": h["step"],
            "end_step": h["end_step"],
            "outcome": h["outcome"],
            "reason": h["reason"],
            # predicted by the planner, both placements under the planning load
            "balancedness_before": _r(h["balancedness_before"]),
            "balancedness_after": _r(h["balancedness_after"]),
            # measured on the live batches: mean over `window` steps before / after
            "measured_before": _r(_mean(before)),
            "measured_after": _r(_mean(after)),
            "moved_slots": h["moves"],
            "moved_bytes": h["moved_bytes"],
            "layers_committed": h["layers_committed"],
            "seconds": _r(h["seconds"], 6),
        })
    signature = [[(h["step"], h["outcome"], h["moves"]) for h in r["history"]] for r in results]
    states: set[str] = set().union(*(r["state_seconds"] for r in results))
    time_in_state = {s: _r(max(r["state_seconds"].get(s, 0.0) for r in results), 6) for s in sorted(states)}
    outputs_unchanged = all(r["mismatches"] == 0 for r in results) and all(r["output_checks"] > 0 for r in results)
    maps_identical = all(r["phy2log"] == first["phy2log"] for r in results)
    report = {
        "config": opts.config_dict(),
        "rearrangements": rearrangements,
        "committed": sum(1 for r in rearrangements if r["outcome"] == "committed"),
        "moved_slots_total": sum(r["moved_slots"] for r in rearrangements if r["outcome"] == "committed"),
        "moved_bytes_total": sum(r["moved_bytes"] for r in rearrangements if r["outcome"] == "committed"),
        "outputs_unchanged": outputs_unchanged,
        "output_checks": sum(r["output_checks"] for r in results),
        "weights_exact": all(r["weights_exact"] for r in results),
        "maps_agree": all(r["maps_agree"] for r in results) and maps_identical,
        "histories_agree": all(sig == signature[0] for sig in signature),
        "final_state": first["final_state"],
        "final_states": [r["final_state"] for r in results],
        "time_in_state_s": time_in_state,
        "balancedness_first_window": _r(_mean([v for s, v in series if s < opts.window])),
        "balancedness_last_window": _r(_mean([v for s, v in series[-opts.window:]])),
        "steps": first["steps"],
        "log_dir": opts.log_dir,
        "traces": [r["trace"] for r in results],
        "wall_s": _r(wall_s, 2),
    }
    report["ok"] = bool(report["outputs_unchanged"] and report["weights_exact"] and report["maps_agree"]
                        and report["histories_agree"] and len(set(report["final_states"])) == 1)
    if extras := {r["rank"]: r["extra"] for r in results if r.get("extra")}:
        report["hooks"] = extras
    return report


def _brief(reason: str, limit: int = 200) -> str:
    """A rank's reason for one line of text: a long list (a scale's lost experts) is cut at an item, with a count."""
    if len(reason) <= limit:
        return reason
    head = reason[:limit].rsplit(", ", 1)[0]
    rest = reason[len(head):].count(", ")
    return f"{head}, ... ({rest} more)" if rest else head + " ..."


def _format_failed(report: dict) -> list[str]:
    c = report["config"]
    what = "did not finish in time" if report.get("error") == "timeout" else "failed"
    lines = [
        f"eplb-fsm simulate: {c['ranks']} ranks, {c['layers']} layers, {c['experts']} experts + {c['redundant']} "
        f"redundant, {c['steps']} steps, interval {c['interval']}, window {c['window']}, {c['mode']}, load {c['load']}",
    ]
    if report.get("inject"):
        lines.append("injected: " + " ".join(report["inject"]))
    rep = report.get("replay") or {}
    culprits = rep.get("culprit_ranks") or []
    lost = [e["rank"] for e in report["ranks"] if e["status"] == "lost"]   # their forkserver died
    stopped = ', '.join(map(str, report['failed_ranks'] + lost)) or '-'
    # a rank the launcher killed at its deadline because it was still running did not die before it: its trace
    # stopped early (writes failing: a full disk, a file-size limit), not the rank
    running = {e["rank"] for e in report["ranks"] if e["status"] == "timed_out"}
    alive_dead = rep.get("verdict") == "rank_died" and bool(culprits) and set(culprits) <= running
    if report.get("error") in ("timeout", "forkserver_died") and (rep.get("verdict") == "signalled" or alive_dead):
        # the launcher's own deadline, or its loss of the rank processes, sent those signals: no rank is to blame
        cause = (f"the run did not finish in time: the --timeout deadline ({report.get('deadline_s'):g} s)"
                 if report["error"] == "timeout" else
                 "the run did not finish: the forkserver the rank processes came from died (killed?), and the launcher")
        lines += ["", f"{cause} stopped every rank; no rank had failed before it", f"ranks that stopped: {stopped}"]
        if alive_dead:
            who = ", ".join(map(str, culprits))
            lines.append(f"replay reads rank_died for rank(s) {who}, but the launcher found them still running at "
                         "the deadline: their traces stopped early (writes failing?), not the ranks: "
                         f"{rep['summary']}")
    elif culprits:
        # the cause first (what replay blames), then every rank that stopped as a consequence
        lines += ["", f"the run {what}: caused by rank(s) {', '.join(map(str, culprits))}: "
                      f"{rep['verdict']}: {rep['summary']}", f"ranks that stopped: {stopped}"]
    else:
        lines += ["", f"the run {what}: rank(s) {stopped}"]
    for e in report["ranks"]:
        where = (f"last record: step {e['last_step']}, {e['last_state']} ({e['last_event']})"
                 if e["last_event"] else "no trace")
        who = f"rank {e['rank']}" + (f" (joiner, process {e['process']})" if e.get("role") == "joiner" else "")
        lines.append(f"  {who}: {e['status']:<9} {where}" + (f"; {_brief(e['reason'])}" if e["reason"] else ""))
    lines += ["", _traces_line(report), f"wall time: {report['wall_s']} s"]
    return lines


def _traces_line(report: dict) -> str:
    """``traces: DIR``, naming this run's id when the folder holds earlier runs' traces too."""
    line = f"traces: {report['log_dir']}"
    if report.get("earlier_traces") and report.get("run_id"):
        line += f" (appended to earlier traces: this run is --run-id {report['run_id']})"
    return line


def _format_replay(report: dict) -> list[str]:
    lines = []
    if report.get("inject_unfired"):
        lines.append("injection(s) that never fired: " + " ".join(report["inject_unfired"]) + " (the run fails)")
    rep = report.get("replay")
    if rep and not (report.get("failed") and rep.get("culprit_ranks")):  # else it leads the failure report
        lines.append(f"replay: {rep['verdict']}: {rep['summary']}")
    return lines


def format_scalings(report: dict) -> list[str]:
    """One line per --scale; a scale that did not run says why instead of printing empty rank counts."""
    lines, current = [], report["config"]["ranks"]
    for sc in report.get("scalings", ()):
        wanted = sc.get("requested_ranks")
        if sc.get("from_ranks") is None:  # no process scaled: same size, or the run ended first
            why = (f"the group already has {current} ranks" if sc["outcome"] == "skipped"
                   else "the run ended before this step")
            lines.append(f"scale at step {sc['step']} to {wanted} ranks: {sc['outcome']} ({why})")
            continue
        lines.append(f"scale at step {sc['step']}: {sc['from_ranks']} -> {wanted} ranks: "
                     f"{sc['outcome']}, {sc['moved_slots']} slots moved, {sc['seconds']} s"
                     + (f" ({sc['reason']})" if sc.get("reason") else ""))
        if sc.get("to_ranks") is not None:
            current = sc["to_ranks"]
    return lines


def format_report(report: dict) -> str:
    """The report as text for a terminal."""
    if report.get("failed"):
        return "\n".join(_format_failed(report) + _format_replay(report))
    c = report["config"]
    lines = [
        f"eplb-fsm simulate: {c['ranks']} ranks, {c['layers']} layers, {c['experts']} experts + {c['redundant']} "
        f"redundant, {c['steps']} steps, interval {c['interval']}, window {c['window']}, {c['mode']}, load {c['load']}",
        "",
        "rearrangements (balancedness: planned = both placements under the planning load; "
        "measured = mean over the window before / after)",
        f"  {'#':>2} {'step':>5} {'outcome':<10} {'planned':>15} {'measured':>15} {'moved':>6} {'bytes':>9}  layers",
    ]
    for r in report["rearrangements"]:
        planned = (f"{r['balancedness_before']:.3f}->{r['balancedness_after']:.3f}"
                   if r["balancedness_before"] is not None else "-")
        measured = (f"{r['measured_before']:.3f}->{r['measured_after']:.3f}"
                    if r["measured_before"] is not None and r["measured_after"] is not None else "-")
        lines.append(f"  {r['index']:>2} {r['step']:>5} {str(r['outcome']):<10} {planned:>15} {measured:>15} "
                     f"{r['moved_slots']:>6} {r['moved_bytes']:>9}  {r['layers_committed']}"
                     + (f"  ({r['reason']})" if r["reason"] else ""))
    if not report["rearrangements"]:
        lines.append("  (none)")
    lines += [
        "",
        f"moved in total: {report['moved_slots_total']} slots, {report['moved_bytes_total']} bytes",
        "time in state (s, slowest rank): " + ", ".join(f"{k} {v:.3f}" for k, v in report["time_in_state_s"].items()),
        f"balancedness: first window {report['balancedness_first_window']}, last window "
        f"{report['balancedness_last_window']}",
        f"outputs identical to the reference: {'yes' if report['outputs_unchanged'] else 'NO'} "
        f"({report['output_checks']} checks); weights bit-exact: {'yes' if report['weights_exact'] else 'NO'}; "
        f"maps agree on every rank: {'yes' if report['maps_agree'] else 'NO'}",
        f"final state: {report['final_state']} (all ranks: {', '.join(report['final_states'])})",
        _traces_line(report),
    ]
    if report.get("png"):
        lines.append(f"balancedness plot: {report['png']}")
    elif report.get("png_note"):
        lines.append(f"no plot: {report['png_note']}")
    lines += format_scalings(report)
    for p in report.get("processes", ()):
        if p.get("status") == "not_joined":  # an expected end of an aborted scale, not a failure
            lines.append(f"joiner process {p['process']} (rank {p['rank']}, scale at step {p['start_step']}): "
                         f"not joined, its scale aborted ({p['reason']})")
    lines.append(f"wall time: {report['wall_s']} s")
    if report.get("inject"):
        lines.append("injected: " + " ".join(report["inject"]))
    return "\n".join(lines + _format_replay(report))
