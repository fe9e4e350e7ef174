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
directory); a bad one prints one ``eplb-fsm simulate: error: ...`` line and exits 2, as do
sizes over the limits: ``--ranks`` and each ``--scale`` size at most 64 (``sim.elastic.MAX_RANKS``),
load targets at most 256 MiB (``sim.targets``; a drifting load's phases past 1024 are reused), and a
``--hidden`` / ``--tokens`` whose ranks' toy models could not fit in this machine's memory
(``simulate_checks.check_model_memory``).
A plot that still cannot be written is reported as a note: the report is never lost. SIGTERM
and Ctrl-C exit 143 / 130 wherever they land, the report's replay and plot included.

The command lives here (arguments, options, exit codes); the run is
``eplb_fsm.commands.simulate_run``, the report ``eplb_fsm.commands.simulate_report``, the
progress line ``eplb_fsm.commands.simulate_progress``.

Extension seam: :func:`build_options` turns arguments into a picklable ``SimOptions``;
per-rank behaviour is added through ``SimOptions.hooks`` (see ``eplb_fsm.sim.run``),
e.g. fault injection or elastic scaling, without changing the rank loop.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import threading

from eplb_fsm.commands.simulate_checks import (
    check_injections_serve, check_model_memory, check_png_path, load_error, load_note, prepare_trace_dir,
)
from eplb_fsm.commands.simulate_report import build_failed_report, build_report, format_report, replay_verdict
from eplb_fsm.commands.simulate_run import run_simulation

__all__ = ["add_arguments", "build_options", "run_simulation", "build_report", "build_failed_report", "replay_verdict",
           "format_report", "run", "Interrupted", "interruptible"]


_INJECT_HELP = """\
fault injection (--inject SPEC, repeatable; R rank, S step, K layer, from 0):
  skip-step:rank=R,step=S         rank R's engine does not call controller.step() at
                                  step S: its counters fall one step behind
  stall-layer:rank=R,layer=K      rank R never transfers layer K (its transfer blocks
                                  without posting sends): peers time out
  wrong-collective:rank=R,step=S  rank R broadcasts instead of the controller's
                                  all-reduce at step S (or the next one after S)
  die:rank=R,step=S               rank R's process exits (os._exit) at step S
  kill:rank=R,step=S[,layer=K]    rank R sends itself a real SIGKILL at the start of step
                                  S (with layer=K: before its first transfer of layer K at
                                  a step >= S, in a rearrangement or a scale)
  freeze:rank=R,step=S,seconds=T[,layer=K]
                                  rank R is stopped by a real SIGSTOP for T seconds (a
                                  helper process sends SIGSTOP, then SIGCONT), same points

A die, or a kill without layer, ends rank R at the start of step S: another fault on rank
R at step S or later could never fire and is refused (exit 2).

Every injection that fires writes a 'fault_injected' trace record; one that never fired
is reported and makes the run fail (exit 1); only this run's records count, even in a
--trace-dir that holds earlier runs' traces. With --scale, R is the rank a process
starts as (a joiner: the rank it joins as), and a fault on R at a step R does not run
(a joiner before its scale, a leaving rank after its scale or, for a fault without
layer=, at its scale's step: it leaves at the start of that step, before the engine step;
every rank after an :absent or :late scale-up, which aborts and so stops the run) is
refused (exit 2). SIGTERM or
Ctrl-C stops every rank process (each writes an 'end' record within a 2 s grace, also when
the SIGTERM went to the whole process group, forkserver included), keeps the traces and
exits 143 / 130. A forkserver killed on its own (the OOM killer) stops the run too: each
rank is stopped with its 'end' and reported 'lost', the report's error is 'forkserver_died'.

With --inject, waits are short (--collective-timeout 5, --watchdog 2.5 unless given),
the engine's forward all-reduces are traced too (group 'engine') and each waits at most
3 x the collective timeout + 10 s (so the controller's waits fail first; a controller wait that
times out on the same gloo group closes its connections, and an engine all-reduce in flight
then fails with it, sooner), a rank stops at its
first fault and exits non-zero (not at one its scale then handled: survivors that
salvaged a dead leaving rank serve on), and the report gives the replay verdict of the
traces left in --trace-dir: a failed run's report leads with it when it blames a rank
(exit 1 when ranks failed). The watchdog writes a 'stuck' trace record when planning, a
transferring layer or committing makes no progress for S seconds.
"""

MAX_SECONDS = 1e6   # a wait longer than 11 days is no wait a run needs
MAX_DRIFT = 100.0   # lognormal sigma per interval; far past it the drifting loads overflow to NaN
# EplbConfig's fields that an option sets: its errors name the field, a usage error the option
CONFIG_OPTIONS = {"window_size": "--window", "step_interval": "--interval", "num_redundant_experts": "--redundant",
                  "min_balancedness_gain": "--min-gain", "collective_timeout_s": "--collective-timeout"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("shape")
    g.add_argument("--ranks", type=int, default=4, help="EP ranks (local gloo processes, at most 64), default 4")
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
                   help="load source, default zipf: zipf (a zipf skew that drifts, see --drift); esft (real "
                        "routing, batch by batch: each step routes the next 4 sequences of the bundled ESFT intent "
                        "traces, or of $EPLB_FSM_ESFT_DIR, cycling; no --drift); esft:TASK (TASK intent, law, "
                        "summary or translation: that task's token counts summed over the whole trace, one static "
                        "load, plus the synthetic --drift); example (the bundled ESFT intent aggregate, 26 x 64: "
                        "the same load as esft:intent); or a load file (.npy, .npz, .pt, .json or a trace folder, "
                        "drifting too). A load of another shape is fitted to --layers x --experts (it says so)")
    r.add_argument("--drift", type=float, default=0.6,
                   help="lognormal drift sigma per interval (zipf/file), 0..100, default 0.6")
    r.add_argument("--seed", type=int, default=0, help="seed of weights, batches and load, default 0")
    from eplb_fsm.policy.registry import available_policies  # names only, no torch

    r.add_argument("--policy", default="default", choices=available_policies(),
                   help="placement policy: %(choices)s; default 'default'")
    r.add_argument("--min-gain", type=float, default=0.0,
                   help="skip a rearrangement whose predicted balancedness gain is <= this, default 0")
    r.add_argument("--dummy-every", type=int, default=0,
                   help="every n-th step is a dummy step (0: none, else >= 2), default 0")
    r.add_argument("--collective-timeout", type=float, default=None,
                   help="the controller's collective_timeout_s: seconds its collectives and transfers may wait "
                        "on other ranks before it is a fault (a few waits derived from it are longer, e.g. the "
                        "agreements after a fault: 4 x this + 5 s), default 20 (5 with --inject). The "
                        "engine's forward all-reduce has its own bound: 3 x this + 10 s with --inject (set longer "
                        "than this so that the controller's waits time out first; a controller timeout on the "
                        "same gloo group closes its connections and fails it sooner), else the "
                        "run's --timeout (with --scale also 60 s)")
    r.add_argument("--watchdog", type=float, default=None, metavar="S",
                   help="log a 'stuck' trace record when planning, a transferring layer or committing makes "
                        "no progress for S seconds (0: off); default off, half the collective timeout with "
                        "--inject")
    r.add_argument("--inject", action="append", default=None, metavar="SPEC",
                   help="make a rank misbehave (repeatable; the kinds are listed below)")
    r.add_argument("--scale", action="append", default=None, metavar="STEP:RANKS",
                   help="elastic EP (repeatable): at step STEP the serving ranks scale the EP group to RANKS "
                        "(RANKS at most 64; leaving ranks exit, joiners start as new processes; slots per rank stay "
                        "fixed). "
                        "STEP:RANKS:absent never starts the joiners (the scale must abort); STEP:RANKS:late "
                        "starts them after the abort (they end not joined, no failure). RANKS must differ from the "
                        "group's size at STEP (earlier scales counted as switched, :absent/:late ones as aborted), "
                        "and :absent/:late need a scale-up. See docs/elastic.md")
    r.add_argument("--join-timeout", type=float, default=None, metavar="S",
                   help="seconds a scale waits for its new group (joiners arriving), default: the collective "
                        "timeout")
    r.add_argument("--timeout", type=float, default=300.0,
                   help="deadline of the whole run in seconds (every wait here is at most 1e6 s), default 300")
    parser.epilog = _INJECT_HELP
    o = parser.add_argument_group("output")
    o.add_argument("--trace-dir", dest="log_dir", default=None, metavar="DIR",
                   help="where traces and the PNG go, created if missing (default: a new temp dir); in a "
                        "folder that holds traces already, each rank appends a session to its file and the "
                        "report, replay and injection check read only this run's (by its run id)")
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
    from eplb_fsm.sim.elastic import MAX_RANKS
    from eplb_fsm.sim.run import SimOptions, load_targets

    for name in ("ranks", "layers", "experts", "hidden", "top_k", "tokens", "steps", "interval", "window"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.ranks > MAX_RANKS:  # a process per rank on this machine
        raise ValueError(f"--ranks must be <= {MAX_RANKS} (each rank is a local process), got {args.ranks}")
    if args.redundant < 0:
        raise ValueError(f"--redundant must be >= 0, got {args.redundant}")
    if (args.experts + args.redundant) % args.ranks:
        raise ValueError(f"--experts + --redundant ({args.experts + args.redundant}) must be divisible by "
                         f"--ranks ({args.ranks})")
    if args.top_k > args.experts:
        raise ValueError(f"--top-k ({args.top_k}) must be <= --experts ({args.experts})")
    if args.dummy_every < 0 or args.dummy_every == 1:  # 1: every step a dummy, nothing left to check
        raise ValueError(f"--dummy-every must be 0 (none) or >= 2, got {args.dummy_every}")
    if not (0 <= args.drift <= MAX_DRIFT):  # past it the drifting loads overflow to NaN
        raise ValueError(f"--drift must be a number in [0, {MAX_DRIFT:g}], got {args.drift}")
    if getattr(args, "seed", 0) < 0:
        raise ValueError(f"--seed must be >= 0, got {args.seed}")
    if not 0.0 <= args.min_gain <= 1.0:  # config.min_balancedness_gain's rule, named as the option
        raise ValueError(f"--min-gain must be a number in [0, 1], got {args.min_gain}")
    # gloo and the store overflow past ~9e9 s: "no timeout" is spelled with MAX_SECONDS
    timeout, watchdog = _timeouts(args)
    if not (0 < timeout <= MAX_SECONDS):
        raise ValueError(f"--collective-timeout must be a finite number > 0 and <= {MAX_SECONDS:g} s, got {timeout}")
    if not (0 <= watchdog <= MAX_SECONDS):
        raise ValueError(f"--watchdog must be a finite number >= 0 (0: off) and <= {MAX_SECONDS:g} s, got {watchdog}")
    run_timeout = getattr(args, "timeout", 300.0)
    if not (0 < run_timeout <= MAX_SECONDS):
        raise ValueError(f"--timeout must be a finite number of seconds > 0 and <= {MAX_SECONDS:g}, got {run_timeout}")
    join_timeout = getattr(args, "join_timeout", None)  # checked with or without --scale
    if join_timeout is not None and not (0 < join_timeout <= MAX_SECONDS):
        raise ValueError(f"--join-timeout must be a finite number > 0 and <= {MAX_SECONDS:g} s, got {join_timeout}")
    check_png_path(getattr(args, "png", None), getattr(args, "no_png", False))  # before any work
    injections = []
    events = []
    if getattr(args, "scale", None):
        from eplb_fsm.sim.elastic import parse_scale_specs

        events = parse_scale_specs(args.scale, args.ranks, args.steps, args.experts, args.redundant)
    if getattr(args, "inject", None):
        from eplb_fsm.sim.inject import parse_specs

        # with --scale a joiner can be the target: ranks up to the largest group of the run
        most = max([args.ranks] + [e.ranks for e in events])
        injections = parse_specs(args.inject, most, args.steps, args.layers)
        if events and any(inj.kind == "wrong-collective" for inj in injections):
            raise ValueError("--inject wrong-collective cannot be combined with --scale (its broadcast needs "
                             "the fixed torch.distributed group)")
        if events:  # a joiner before it joins, a rank after it left: the fault would never fire
            check_injections_serve(injections, args.ranks, args.steps, events)
    # before the load targets are built and any rank starts: a model too big for this machine
    check_model_memory(args.ranks, args.layers, args.experts, args.redundant, args.hidden, args.tokens,
                       max([args.ranks] + [e.ranks for e in events]))
    opts = SimOptions(
        ranks=args.ranks, layers=args.layers, experts=args.experts, redundant=args.redundant, hidden=args.hidden,
        top_k=args.top_k, tokens=args.tokens, steps=args.steps, interval=args.interval, window=args.window,
        mode=args.mode, load=args.load, seed=args.seed, drift=args.drift, dummy_every=args.dummy_every,
        policy=args.policy, min_balancedness_gain=args.min_gain, collective_timeout_s=timeout,
        watchdog_deadline_s=watchdog, hooks=tuple(_hook_specs(args)),
    )
    if injections:
        opts.extra["inject"] = [inj.spec for inj in injections]
    if events:
        opts.extra["scale"] = [e.spec for e in events]
        opts.extra["join_timeout_s"] = join_timeout
    from eplb_fsm.config import EplbConfig
    from eplb_fsm.policy import get_policy

    get_policy(opts.policy)  # an unknown name fails here, not in four processes
    try:
        EplbConfig(window_size=opts.window, step_interval=opts.interval, num_redundant_experts=opts.redundant,
                   min_balancedness_gain=opts.min_balancedness_gain, collective_timeout_s=opts.collective_timeout_s)
    except ValueError as exc:  # "window_size must be <= 100000": said as the option that set it
        field, _, rule = str(exc).partition(" ")
        raise ValueError(f"{CONFIG_OPTIONS[field]} {rule}" if field in CONFIG_OPTIONS else str(exc)) from None
    try:
        opts = load_targets(opts)
    except ValueError as exc:  # a missing or malformed --load file: a usage error naming the option
        raise load_error(opts.load, exc) from None
    opts.log_dir = prepare_trace_dir(args.log_dir)  # last: a refused run leaves no folder behind
    return opts



class Interrupted(BaseException):
    """SIGTERM reached ``eplb-fsm simulate`` (or ``bench``): raised in the main thread so the launcher stops its
    ranks and every ``with`` / ``finally`` on the way up runs (a benchmark's temporary folder is removed).

    A ``BaseException``, like ``KeyboardInterrupt``: the ``except Exception`` that keeps a
    report coming out when its plot or replay fails must not swallow a stop request.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"interrupted by {name}")


@contextlib.contextmanager
def interruptible():
    """SIGTERM raises :class:`Interrupted` (once), Ctrl-C KeyboardInterrupt as always, while running.

    Yields the list of the signals that arrived: should the exception still be swallowed on its way
    up (a controller turns an interrupt inside a rearrangement into its fault), the caller sees it there
    and exits as interrupted all the same (``bench replay`` SIGINTed late ran to the end, exit 0). SIGINT
    is noted only where Python's own handler is in place (not where it is ignored).
    """
    fired: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield fired
        return

    def on_term(signum, frame):
        if not fired:  # a second SIGTERM while the ranks are being stopped changes nothing
            fired.append(signum)
            raise Interrupted(signal.Signals(signum).name)

    def on_int(signum, frame):
        fired.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    ours = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    previous_int = signal.signal(signal.SIGINT, on_int) if ours else None
    try:
        yield fired
    finally:
        signal.signal(signal.SIGTERM, previous)
        if ours:
            signal.signal(signal.SIGINT, previous_int)


def _interrupted(opts, name: str) -> int:
    """Say that the run was stopped and where its traces are; the exit code of ``name`` (143 / 130)."""
    from eplb_fsm.commands.simulate_checks import this_runs_traces

    # the launcher's `finally` has stopped every rank process (each wrote its `end` record)
    if this_runs_traces(opts.log_dir):
        kept = f"traces kept in {opts.log_dir} (eplb-fsm replay {opts.log_dir})"
    else:  # stopped while the ranks were starting: nothing to replay
        kept = f"no rank had written a trace yet (trace folder {opts.log_dir})"
    print(f"\neplb-fsm simulate: interrupted by {name}: every rank process was stopped; {kept}", file=sys.stderr)
    return 128 + (signal.SIGTERM if name == "SIGTERM" else signal.SIGINT)


def run(args: argparse.Namespace) -> int:
    from eplb_fsm.sim.launcher import warm_forkserver

    warm_forkserver()   # it imports torch while build_options does here
    try:
        opts = build_options(args)
        note = load_note(opts)
    except ValueError as exc:
        print(f"eplb-fsm simulate: error: {exc}", file=sys.stderr)
        return 2
    if note:
        print(f"eplb-fsm simulate: {note}", file=sys.stderr)
    try:
        with interruptible() as fired:
            report = run_simulation(opts, progress=not args.no_progress, timeout=args.timeout, png=args.png,
                                    want_png=not args.no_png)
    except KeyboardInterrupt:
        return _interrupted(opts, "SIGINT")
    except Interrupted as exc:
        return _interrupted(opts, exc.name)
    if fired:  # a SIGTERM whose exception something swallowed: still a stopped run, not a report
        return _interrupted(opts, signal.Signals(fired[0]).name)
    if note:
        report["load_note"] = note
    # a reused --trace-dir: the report, replay and injection check read this run's sessions only
    report["run_id"] = getattr(opts.log_dir, "run_id", None)
    report["earlier_traces"] = bool(getattr(opts.log_dir, "start", None))
    if report.get("png_note"):
        print(f"eplb-fsm simulate: {report['png_note']}", file=sys.stderr)
    from eplb_fsm.cli import print_stdout

    print_stdout(json.dumps(report) if args.json else format_report(report))  # `| head` ends it quietly
    return 0 if report["ok"] else 1
