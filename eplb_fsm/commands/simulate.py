"""``eplb-fsm simulate``: run the toy MoE engine with the balancer on local gloo ranks.

Each rank (a process, see ``eplb_fsm.sim.launcher``) serves a drifting skewed load (or
real ESFT routing) with a small MoE model, checks every step's output bit for bit
against a placement-free reference, and lets the controller rearrange experts. The
parent shows a live progress line (stderr) with every rank's state, then reports
balancedness before and after each rearrangement, moved slots and bytes, time in each
state, and whether outputs stayed identical; traces go to ``--log-dir`` and a PNG of
balancedness over steps next to them (when matplotlib is installed).

Extension seam: :func:`build_options` turns arguments into a picklable ``SimOptions``;
per-rank behaviour is added through ``SimOptions.hooks`` (see ``eplb_fsm.sim.run``),
e.g. fault injection or elastic scaling, without changing the rank loop.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, TextIO

__all__ = ["add_arguments", "build_options", "run_simulation", "build_report", "format_report", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("shape")
    g.add_argument("--ranks", type=int, default=4, help="EP ranks (local gloo processes), default 4")
    g.add_argument("--layers", type=int, default=4, help="MoE layers, default 4")
    g.add_argument("--experts", type=int, default=32, help="logical experts per layer, default 32")
    g.add_argument("--redundant", type=int, default=8, help="redundant slots per layer, default 8")
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
    r.add_argument("--policy", default="default", help="placement policy name, default 'default'")
    r.add_argument("--min-gain", type=float, default=0.0,
                   help="skip a rearrangement whose predicted balancedness gain is <= this, default 0")
    r.add_argument("--dummy-every", type=int, default=0, help="every n-th step is a dummy step (0: none)")
    r.add_argument("--collective-timeout", type=float, default=20.0,
                   help="seconds any wait on other ranks may take before it is a fault, default 20")
    r.add_argument("--timeout", type=float, default=300.0, help="deadline of the whole run in seconds, default 300")
    o = parser.add_argument_group("output")
    o.add_argument("--log-dir", default=None, help="where traces and the PNG go (default: a new temp dir)")
    o.add_argument("--json", action="store_true", help="print the report as one JSON object")
    o.add_argument("--png", default=None, metavar="PATH",
                   help="where the balancedness PNG goes (default: <log-dir>/balancedness.png)")
    o.add_argument("--no-png", action="store_true", help="do not write the PNG")
    o.add_argument("--no-progress", action="store_true", help="no live progress line on stderr")


def _hook_specs(args: argparse.Namespace) -> list:
    """Per-rank hooks requested on the command line (none yet; fault injection and scaling plug in here)."""
    return list(getattr(args, "hooks", None) or [])


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
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="eplb-simulate-")
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    opts = SimOptions(
        ranks=args.ranks, layers=args.layers, experts=args.experts, redundant=args.redundant, hidden=args.hidden,
        top_k=args.top_k, tokens=args.tokens, steps=args.steps, interval=args.interval, window=args.window,
        mode=args.mode, load=args.load, seed=args.seed, drift=args.drift, dummy_every=args.dummy_every,
        policy=args.policy, min_balancedness_gain=args.min_gain, collective_timeout_s=args.collective_timeout,
        log_dir=str(log_dir), hooks=tuple(_hook_specs(args)),
    )
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
        self.interval_s = interval_s
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
        self.stream.write("\n")
        self.stream.flush()


# --------------------------------------------------------------------------- run + report


def run_simulation(opts, progress: bool = True, stream: TextIO | None = None, timeout: float = 300.0,
                   png: str | None = None, want_png: bool = True) -> dict:
    """Run every rank, then build the report (see :func:`build_report`)."""
    from eplb_fsm.sim.launcher import run_ranks
    from eplb_fsm.sim.run import run_rank

    stream = stream if stream is not None else sys.stderr
    t0 = time.perf_counter()
    if progress:
        with _Progress(opts, stream):
            results = run_ranks(run_rank, opts.ranks, args=(opts,), timeout=timeout)
    else:
        results = run_ranks(run_rank, opts.ranks, args=(opts,), timeout=timeout)
    wall = time.perf_counter() - t0
    report = build_report(opts, results, wall)
    report["png"], report["png_note"] = None, None
    if want_png:
        from eplb_fsm.sim.plot import plot_balancedness

        path = png or str(Path(opts.log_dir) / "balancedness.png")
        title = f"{opts.ranks} ranks, {opts.layers} layers, {opts.experts}+{opts.redundant} slots, {opts.mode}, " \
                f"load {Path(opts.load).name if opts.load not in ('zipf', 'esft') else opts.load}"
        report["png"], report["png_note"] = plot_balancedness(results[0]["balancedness"], report["rearrangements"],
                                                              path, title=title)
    return report


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


def format_report(report: dict) -> str:
    """The report as text for a terminal."""
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
    lines.append(f"wall time: {report['wall_s']} s")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        opts = build_options(args)
    except ValueError as exc:
        print(f"eplb-fsm simulate: error: {exc}", file=sys.stderr)
        return 2
    report = run_simulation(opts, progress=not args.no_progress, timeout=args.timeout, png=args.png,
                            want_png=not args.no_png)
    if report.get("png_note"):
        print(f"eplb-fsm simulate: {report['png_note']}", file=sys.stderr)
    if args.json:
        print(json.dumps(report))
    else:
        print(format_report(report))
    return 0 if report["ok"] else 1
