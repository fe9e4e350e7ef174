"""``eplb-fsm simulate``: run the toy MoE engine with the balancer on local gloo ranks.

Each rank (a process, see ``eplb_fsm.sim.launcher``) serves a drifting skewed load (or
real ESFT routing) with a small MoE model, checks every step's output bit for bit
against a placement-free reference, and lets the controller rearrange experts. The
parent shows a live progress line (stderr) with every rank's state, then reports
balancedness before and after each rearrangement, moved slots and bytes, time in each
state, and whether outputs stayed identical; traces go to ``--trace-dir`` and a PNG of
balancedness over steps next to them (when matplotlib is installed).

Every option and output path is checked before any process starts (``--trace-dir`` must be
a writable directory or creatable, ``--png`` a ``.png`` file in an existing, writable
directory); a bad one prints one ``eplb-fsm simulate: error: ...`` line and exits 2. A
plot that still cannot be written is reported as a note: the report is never lost.

Extension seam: :func:`build_options` turns arguments into a picklable ``SimOptions``;
per-rank behaviour is added through ``SimOptions.hooks`` (see ``eplb_fsm.sim.run``),
e.g. fault injection or elastic scaling, without changing the rank loop.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

from eplb_fsm.commands.simulate_checks import check_png_path, load_note, prepare_trace_dir

__all__ = ["add_arguments", "build_options", "run_simulation", "build_report", "build_failed_report", "replay_verdict",
           "format_report", "run"]


_INJECT_HELP = """\
fault injection (--inject SPEC, repeatable; R rank, S step, K layer, from 0):
  skip-step:rank=R,step=S         rank R's engine does not call controller.step() at
                                  step S: its counters fall one step behind
  stall-layer:rank=R,layer=K      rank R never transfers layer K (its transfer blocks
                                  without posting sends): peers time out
  wrong-collective:rank=R,step=S  rank R broadcasts instead of the controller's
                                  all-reduce at step S (or the next one after S)
  die:rank=R,step=S               rank R's process exits (os._exit) at step S

With --inject, waits are short (--collective-timeout 5, --watchdog 2.5 unless given),
the engine's forward all-reduces are traced too (group 'engine'), a rank stops at its
first fault and exits non-zero, and the report ends with the replay verdict of the
traces left in --trace-dir (exit 1 when ranks failed). The watchdog writes a 'stuck'
trace record when planning, a transferring layer or committing makes no progress for
S seconds.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("shape")
    g.add_argument("--ranks", type=int, default=4, help="EP ranks (local gloo processes), default 4")
    g.add_argument("--layers", type=int, default=4, help="MoE layers, default 4")
    g.add_argument("--experts", type=int, default=32, help="logical experts per layer, default 32")
    g.add_argument("--redundant", type=int, default=8,
                   help="redundant slots per layer (slots beyond one per expert), default 8")
    g.add_argument("--hidden", type=int, default=16, help="hidden size of the toy model, default 16")
    g.add_argument("--top-k", type=int, default=2, help="experts per token, default 2")
    g.add_argument("--tokens", type=int, default=128, help="tokens per engine step (whole batch), default 128")
    r = parser.add_argument_group("run")
    r.add_argument("--steps", type=int, default=400, help="engine steps, default 400")
    r.add_argument("--interval", type=int, default=100, help="steps between rearrangements, default 100")
    r.add_argument("--window", type=int, default=40, help="load window (passes), default 40")
    r.add_argument("--mode", choices=("sync", "async"), default="sync", help="transfer mode, default sync")
    r.add_argument("--load", default="zipf",
                   help="load source: zipf (drifting skew), esft (ESFT routing traces) or a load file; default zipf")
    r.add_argument("--drift", type=float, default=0.6, help="lognormal drift sigma per interval (zipf/file), default 0.6")
    r.add_argument("--seed", type=int, default=0, help="seed of weights, batches and load, default 0")
    from eplb_fsm.policy.registry import available_policies  # names only, no torch

    r.add_argument("--policy", default="default", choices=available_policies(),
                   help="placement policy: %(choices)s; default 'default'")
    r.add_argument("--min-gain", type=float, default=0.0,
                   help="skip a rearrangement whose predicted balancedness gain is <= this, default 0")
    r.add_argument("--dummy-every", type=int, default=0, help="every n-th step is a dummy step (0: none), default 0")
    r.add_argument("--collective-timeout", type=float, default=None,
                   help="seconds any wait on other ranks may take before it is a fault, default 20 "
                        "(5 with --inject)")
    r.add_argument("--watchdog", type=float, default=None, metavar="S",
                   help="log a 'stuck' trace record when planning, a transferring layer or committing makes "
                        "no progress for S seconds (0: off); default off, half the collective timeout with "
                        "--inject")
    r.add_argument("--inject", action="append", default=None, metavar="SPEC",
                   help="make a rank misbehave (repeatable; the kinds are listed below)")
    r.add_argument("--scale", action="append", default=None, metavar="STEP:RANKS",
                   help="elastic EP (repeatable): at step STEP the serving ranks scale the EP group to RANKS "
                        "(leaving ranks exit, joiners start as new processes; slots per rank stay fixed). "
                        "STEP:RANKS:absent never starts the joiners (the scale must abort). See docs/elastic.md")
    r.add_argument("--join-timeout", type=float, default=None, metavar="S",
                   help="seconds a scale waits for its new group (joiners arriving), default: the collective "
                        "timeout")
    r.add_argument("--timeout", type=float, default=300.0, help="deadline of the whole run in seconds, default 300")
    parser.epilog = _INJECT_HELP
    o = parser.add_argument_group("output")
    o.add_argument("--trace-dir", dest="log_dir", default=None, metavar="DIR",
                   help="where traces and the PNG go, created if missing (default: a new temp dir)")
    o.add_argument("--log-dir", dest="log_dir", default=argparse.SUPPRESS, help=argparse.SUPPRESS)  # old name
    o.add_argument("--json", action="store_true", help="print the report as one JSON object")
    o.add_argument("--png", default=None, metavar="PATH",
                   help="where the balancedness PNG goes, a .png file (default: <trace-dir>/balancedness.png)")
    o.add_argument("--no-png", action="store_true", help="do not write the PNG")
    o.add_argument("--no-progress", action="store_true", help="no live progress line on stderr")


def _timeouts(args: argparse.Namespace) -> tuple[float, float]:
    """(collective timeout, watchdog deadline) in seconds: shorter defaults while injecting faults."""
    injecting = bool(getattr(args, "inject", None))
    timeout = getattr(args, "collective_timeout", None)
    if timeout is None:
        timeout = 5.0 if injecting else 20.0
    watchdog = getattr(args, "watchdog", None)
    if watchdog is None:
        watchdog = timeout / 2 if injecting else 0.0
    return float(timeout), float(watchdog)


def _hook_specs(args: argparse.Namespace) -> list:
    """Per-rank hooks requested on the command line (fault injection; scaling plugs in here too)."""
    specs = list(getattr(args, "hooks", None) or [])
    if getattr(args, "inject", None):
        specs.append(("eplb_fsm.sim.inject:make_injector",
                      {"specs": list(args.inject), "collective_timeout_s": _timeouts(args)[0]}))
    return specs


def build_options(args: argparse.Namespace):
    """Check the arguments and build the ``SimOptions`` every rank runs with (load targets included)."""
    from eplb_fsm.sim.run import SimOptions, load_targets

    for name in ("ranks", "layers", "experts", "hidden", "top_k", "tokens", "steps", "interval", "window"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.redundant < 0:
        raise ValueError(f"--redundant must be >= 0, got {args.redundant}")
    if (args.experts + args.redundant) % args.ranks:
        raise ValueError(f"--experts + --redundant ({args.experts + args.redundant}) must be divisible by "
                         f"--ranks ({args.ranks})")
    if args.top_k > args.experts:
        raise ValueError(f"--top-k ({args.top_k}) must be <= --experts ({args.experts})")
    if args.dummy_every < 0:
        raise ValueError(f"--dummy-every must be >= 0, got {args.dummy_every}")
    if not (args.drift >= 0 and math.isfinite(args.drift)):
        raise ValueError(f"--drift must be a finite number >= 0, got {args.drift}")
    timeout, watchdog = _timeouts(args)
    if not (timeout > 0 and math.isfinite(timeout)):
        raise ValueError(f"--collective-timeout must be a finite number > 0, got {timeout}")
    if not (watchdog >= 0 and math.isfinite(watchdog)):
        raise ValueError(f"--watchdog must be a finite number >= 0 (0: off), got {watchdog}")
    run_timeout = getattr(args, "timeout", 300.0)
    if not (run_timeout > 0 and math.isfinite(run_timeout)):
        raise ValueError(f"--timeout must be a finite number of seconds > 0, got {run_timeout}")
    check_png_path(getattr(args, "png", None), getattr(args, "no_png", False))  # before any work
    injections = []
    if getattr(args, "inject", None):
        from eplb_fsm.sim.inject import parse_specs

        injections = parse_specs(args.inject, args.ranks, args.steps, args.layers)
    log_dir = prepare_trace_dir(args.log_dir)
    opts = SimOptions(
        ranks=args.ranks, layers=args.layers, experts=args.experts, redundant=args.redundant, hidden=args.hidden,
        top_k=args.top_k, tokens=args.tokens, steps=args.steps, interval=args.interval, window=args.window,
        mode=args.mode, load=args.load, seed=args.seed, drift=args.drift, dummy_every=args.dummy_every,
        policy=args.policy, min_balancedness_gain=args.min_gain, collective_timeout_s=timeout,
        watchdog_deadline_s=watchdog, log_dir=str(log_dir), hooks=tuple(_hook_specs(args)),
    )
    if injections:
        opts.extra["inject"] = [inj.spec for inj in injections]
    if getattr(args, "scale", None):
        from eplb_fsm.sim.elastic import parse_scale_specs

        if injections:
            raise ValueError("--scale and --inject cannot be combined yet (the injector assumes a fixed group)")

        events = parse_scale_specs(args.scale, args.ranks, args.steps, args.experts, args.redundant)
        opts.extra["scale"] = [e.spec for e in events]
        join_timeout = getattr(args, "join_timeout", None)
        if join_timeout is not None and not (join_timeout > 0 and math.isfinite(join_timeout)):
            raise ValueError(f"--join-timeout must be a finite number > 0, got {join_timeout}")
        opts.extra["join_timeout_s"] = join_timeout
    from eplb_fsm.config import EplbConfig
    from eplb_fsm.policy import get_policy

    get_policy(opts.policy)  # an unknown name fails here, not in four processes
    EplbConfig(window_size=opts.window, step_interval=opts.interval, num_redundant_experts=opts.redundant,
               min_balancedness_gain=opts.min_balancedness_gain, collective_timeout_s=opts.collective_timeout_s)
    return load_targets(opts)


# --------------------------------------------------------------------------- progress


class _Progress:
    """Polls the ranks' progress files and redraws one stderr line (``\\r``)."""

    def __init__(self, opts, stream: TextIO, interval_s: float = 0.25) -> None:
        self.opts = opts
        self.stream = stream
        # a log file (CI, a pipe) gets a plain line every few seconds instead of \r redraws
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.interval_s = interval_s if self.tty else max(interval_s, 5.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="simulate-progress", daemon=True)
        self._width = 0

    def line(self) -> str:
        from eplb_fsm.sim.run import progress_path

        parts, step, committed = [], None, 0
        for rank in range(self.opts.ranks):
            try:
                info = json.loads(progress_path(self.opts.log_dir, rank).read_text())
            except (OSError, ValueError):
                parts.append(f"r{rank}:starting")
                continue
            state = info.get("state", "?")
            if state == "transferring":
                state = f"transferring[{info.get('layer')}]"
            parts.append(f"r{rank}:{state}")
            step = info.get("step") if step is None else min(step, info.get("step", step))
            committed = max(committed, info.get("rearrangements", 0))
        shown = "-" if step is None else step
        return f"simulate step {shown}/{self.opts.steps} | {' '.join(parts)} | rearrangements {committed}"

    def draw(self) -> None:
        text = self.line()
        if not self.tty:
            self.stream.write(text + "\n")
            self.stream.flush()
            return
        pad = max(0, self._width - len(text))
        self._width = len(text)
        self.stream.write("\r" + text + " " * pad)
        self.stream.flush()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.draw()

    def __enter__(self) -> "_Progress":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(2.0)
        self.draw()
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


# --------------------------------------------------------------------------- run + report


def run_simulation(opts, progress: bool = True, stream: TextIO | None = None, timeout: float = 300.0,
                   png: str | None = None, want_png: bool = True) -> dict:
    """Run every rank, then build the report (see :func:`build_report`).

    When ranks fail (a rank raised, died, or missed the deadline ``timeout``) the report is
    :func:`build_failed_report`'s instead, with ``ok`` false; the traces stay in
    ``opts.log_dir``. With injected faults, with ``--scale`` (elastic EP: the replay follows
    the group swaps), or after a failure, the report ends with the replay verdict of the
    traces (``report["replay"]``).
    """
    from eplb_fsm.sim.launcher import RankFailedError, RanksTimeoutError, run_ranks
    from eplb_fsm.sim.run import run_rank

    stream = stream if stream is not None else sys.stderr
    scaling = bool(opts.extra.get("scale"))

    def launch() -> list:
        if scaling:  # elastic EP: processes leave and join (eplb_fsm.sim.elastic)
            from eplb_fsm.sim.elastic import run_elastic

            return run_elastic(opts, timeout=timeout)
        return run_ranks(run_rank, opts.ranks, args=(opts,), timeout=timeout)

    t0 = time.perf_counter()
    try:
        if progress:
            with _Progress(opts, stream):
                results = launch()
        else:
            results = launch()
    except (RankFailedError, RanksTimeoutError) as exc:
        report = build_failed_report(opts, exc, time.perf_counter() - t0)
        report["replay"] = replay_verdict(opts.log_dir)
        report["png"], report["png_note"] = None, None
        return report
    wall = time.perf_counter() - t0
    if scaling:
        from eplb_fsm.sim.elastic import elastic_report, final_members

        everyone, results = results, final_members(results)
        report = elastic_report(opts, everyone, build_report(opts, results, wall))
    else:
        report = build_report(opts, results, wall)
    if opts.extra.get("inject"):
        report["inject"] = list(opts.extra["inject"])
    if opts.extra.get("inject") or scaling:
        report["replay"] = replay_verdict(opts.log_dir)
        # every rank finished, but traces that diverge (an injected fault, or a group swap the
        # ranks did not make alike) are not ok
        report["ok"] = bool(report["ok"] and report["replay"]["verdict"] == "healthy")
    report["png"], report["png_note"] = None, None
    if want_png:
        report["png"], report["png_note"] = _write_plot(opts, report, results, png)
    return report


def _write_plot(opts, report: dict, results: list[dict], png: str | None) -> tuple[str | None, str | None]:
    """Draw the balancedness PNG; a failure becomes a note, never an exception (the report must come out)."""
    from eplb_fsm.sim.plot import plot_balancedness, rank_timeline

    path = png or str(Path(opts.log_dir) / "balancedness.png")
    timeline = rank_timeline(opts.ranks, report.get("scalings", ()))
    ranks = " -> ".join(str(n) for _, n in timeline) if len(timeline) > 1 else str(opts.ranks)
    load = Path(opts.load).name if opts.load not in ("zipf", "esft") else opts.load
    title = f"{ranks} ranks, {opts.layers} layers, {opts.experts}+{opts.redundant} slots, {opts.mode}, load {load}"
    drifts = opts.load != "esft" and opts.drift > 0
    try:
        return plot_balancedness(results[0]["balancedness"], report["rearrangements"], path, title=title,
                                 phase_start=opts.phase_start if drifts else None, phase_steps=opts.phase_steps,
                                 window=opts.window, scalings=report.get("scalings", ()), ranks=opts.ranks)
    except Exception as exc:  # noqa: BLE001 - a plot problem must not cost the report
        return None, f"the plot could not be written to {path}: {type(exc).__name__}: {exc}"


def _last_record(path: Path) -> dict | None:
    """The last readable record of a trace file (a half-written last line is skipped)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            size = fh.tell()
            fh.seek(max(0, size - 65536))
            lines = fh.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return None


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


def build_failed_report(opts, exc: Exception, wall_s: float) -> dict:
    """The report of a run whose ranks did not all finish: what each rank did and where it stopped."""
    from eplb_fsm.sim.launcher import RanksTimeoutError
    from eplb_fsm.trace import trace_path

    failures = dict(getattr(exc, "failures", {}) or {})
    values = dict(getattr(exc, "values", {}) or {})
    pending = set(getattr(exc, "pending", []) or [])
    ranks = []
    for r in range(opts.ranks):
        path = trace_path(opts.log_dir, r)
        last = _last_record(path) if path.is_file() else None
        if r in values:
            status, reason = "finished", None
        elif r in failures:
            reason = _reason(failures[r])
            status = "died" if reason.startswith("process exited with code") else "failed"
        elif r in pending:
            status, reason = "timed_out", f"still running at the {getattr(exc, 'timeout', 0):.0f} s deadline (killed)"
        else:
            status, reason = "stopped", "stopped by the launcher after another rank failed"
        if last and last.get("event") == "rearrangement":  # its `step` is the due step
            last = dict(last, step=last.get("end_step", last.get("step")))
        ranks.append({"rank": r, "status": status, "reason": reason,
                      "last_step": last.get("step") if last else None,
                      "last_state": last.get("state") if last else None,
                      "last_event": last.get("event") if last else None,
                      "trace": str(path) if path.is_file() else None})
    report = {
        "config": opts.config_dict(),
        "ok": False,
        "failed": True,
        "error": "timeout" if isinstance(exc, RanksTimeoutError) else "ranks_failed",
        "ranks": ranks,
        "failed_ranks": [e["rank"] for e in ranks if e["status"] in ("failed", "died", "timed_out")],
        "final_states": [e["last_state"] for e in ranks],
        "log_dir": opts.log_dir,
        "traces": [e["trace"] for e in ranks if e["trace"]],
        "wall_s": _r(wall_s, 2),
    }
    if opts.extra.get("inject"):
        report["inject"] = list(opts.extra["inject"])
    return report


def replay_verdict(log_dir: str) -> dict:
    """Replay the traces of ``log_dir`` (eplb_fsm.inspect.replay): the verdict and where it points."""
    try:
        from eplb_fsm.inspect.replay import replay_dir

        rep = replay_dir(log_dir)
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
    states: set[str] = set()
    for r in results:
        states |= set(r["state_seconds"])
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
    extras = {r["rank"]: r["extra"] for r in results if r.get("extra")}
    if extras:
        report["hooks"] = extras
    return report


def _format_failed(report: dict) -> list[str]:
    c = report["config"]
    what = "did not finish in time" if report.get("error") == "timeout" else "failed"
    lines = [
        f"eplb-fsm simulate: {c['ranks']} ranks, {c['layers']} layers, {c['experts']} experts + {c['redundant']} "
        f"redundant, {c['steps']} steps, interval {c['interval']}, window {c['window']}, {c['mode']}, load {c['load']}",
    ]
    if report.get("inject"):
        lines.append("injected: " + " ".join(report["inject"]))
    lines += ["", f"the run {what}: rank(s) {', '.join(map(str, report['failed_ranks'])) or '-'}"]
    for e in report["ranks"]:
        where = (f"last record: step {e['last_step']}, {e['last_state']} ({e['last_event']})"
                 if e["last_event"] else "no trace")
        lines.append(f"  rank {e['rank']}: {e['status']:<9} {where}" + (f"; {e['reason']}" if e["reason"] else ""))
    lines += ["", f"traces: {report['log_dir']}", f"wall time: {report['wall_s']} s"]
    return lines


def _format_replay(report: dict) -> list[str]:
    rep = report.get("replay")
    if not rep:
        return []
    return [f"replay: {rep['verdict']}: {rep['summary']}"]


def _format_scalings(report: dict) -> list[str]:
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
        outcome = r["outcome"] if not r["reason"] or r["outcome"] == "committed" else f"{r['outcome']}"
        lines.append(f"  {r['index']:>2} {r['step']:>5} {outcome:<10} {planned:>15} {measured:>15} "
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
        f"traces: {report['log_dir']}",
    ]
    if report.get("png"):
        lines.append(f"balancedness plot: {report['png']}")
    elif report.get("png_note"):
        lines.append(f"no plot: {report['png_note']}")
    lines += _format_scalings(report)
    lines.append(f"wall time: {report['wall_s']} s")
    if report.get("inject"):
        lines.append("injected: " + " ".join(report["inject"]))
    return "\n".join(lines + _format_replay(report))


def run(args: argparse.Namespace) -> int:
    try:
        opts = build_options(args)
        note = load_note(opts)
    except ValueError as exc:
        print(f"eplb-fsm simulate: error: {exc}", file=sys.stderr)
        return 2
    if note:
        print(f"eplb-fsm simulate: {note}", file=sys.stderr)
    report = run_simulation(opts, progress=not args.no_progress, timeout=args.timeout, png=args.png,
                            want_png=not args.no_png)
    if note:
        report["load_note"] = note
    if report.get("png_note"):
        print(f"eplb-fsm simulate: {report['png_note']}", file=sys.stderr)
    if args.json:
        print(json.dumps(report))
    else:
        print(format_report(report))
    return 0 if report["ok"] else 1
