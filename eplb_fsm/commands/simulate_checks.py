"""Checks ``eplb-fsm simulate`` makes before any work: output paths, and what a load of another shape becomes.

Each check raises ``ValueError`` whose message starts with the option it is about
(``--trace-dir: ...``, ``--png: ...``); the command prints it as one line and exits 2,
so a path that cannot be written is found before a rank starts, not after the run.
Nothing here imports torch.

A ``--trace-dir`` that already holds traces is appended to, as a restarted engine appends a
session to its rank file: :func:`prepare_trace_dir` returns a :class:`TraceDir`, which
remembers how long each trace file was before this run and so finds this run's id, and the
report, the replay and the injection check read only this run's sessions. Its ``progress/``
files are the one thing cleared: the live line reads every rank file there, so an earlier
run's would show as ranks of this one.

With ``--scale``, :func:`check_injections_serve` refuses an ``--inject`` fault on a rank
that provably does not run at its step (a joiner before it joins, a rank after it left, or
at its leaving scale's step for a fault without ``layer=``: it leaves before that engine step).

:func:`check_model_memory` refuses a ``--hidden`` / ``--tokens`` whose toy model could not fit in this
machine's memory (``eplb_fsm.bench.options.memory_rule``): without it every rank started and each
failed on its first allocation.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

__all__ = ["TraceDir", "check_injections_serve", "check_model_memory", "check_png_path", "header_run_ids",
           "load_error", "load_note", "model_bytes_per_rank", "prepare_progress", "prepare_trace_dir", "run_id_after",
           "serving_spans", "split_run_ids", "this_runs_traces", "trace_sizes"]

RANK0_FILE = "rank00000.jsonl"  # eplb_fsm.trace.trace_path(dir, 0).name, without importing torch
PROGRESS_DIR = "progress"       # eplb_fsm.sim.run.progress_path's folder, without importing torch
_SIZE_CAP = 1 << 62              # sizes are capped before the float estimate: 10**400 would not convert


def trace_sizes(directory: str | Path) -> dict[str, int]:
    """The size of each trace file (``*.jsonl``) in ``directory`` now: where a run appending to it starts."""
    sizes = {}
    for path in Path(directory).glob("*.jsonl"):
        try:
            sizes[path.name] = path.stat().st_size
        except OSError:
            continue
    return sizes


def run_id_after(directory: str | Path, start: dict[str, int]) -> str | None:
    """The run id of the first session header written past ``start`` (file name -> size), rank 0's file first."""
    paths = sorted(Path(directory).glob("*.jsonl"), key=lambda p: (p.name != RANK0_FILE, p.name))
    for path in paths:
        rec = _first_header(path, start.get(path.name, 0))
        if rec is not None:
            return str(rec["run_id"])
    return None


def _first_header(path: Path, offset: int) -> dict | None:
    """The first session header with a run id in ``path`` past byte ``offset`` (None: none, or unreadable)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            for raw in fh:
                if b'"header"' not in raw:
                    continue
                try:
                    rec = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(rec, dict) and rec.get("event") == "header" and rec.get("run_id"):
                    return rec
    except OSError:
        pass
    return None


def this_runs_traces(directory: str | Path) -> list[Path]:
    """The trace files (``*.jsonl``) this run wrote to: grown past their size before it (``directory.start``,
    a :class:`TraceDir`'s; a plain path: every non-empty one)."""
    start = getattr(directory, "start", None) or {}
    found = []
    for path in sorted(Path(directory).glob("*.jsonl")):
        try:
            if path.stat().st_size > start.get(path.name, 0):
                found.append(path)
        except OSError:
            continue
    return found


def header_run_ids(directory: str | Path) -> dict[str, tuple[int | None, str]]:
    """File name -> (rank, run id) of the first session header this run wrote in each trace file
    (past ``directory.start``): ranks that agreed on their run identity all show one id."""
    start = getattr(directory, "start", None) or {}
    found: dict[str, tuple[int | None, str]] = {}
    for path in this_runs_traces(directory):
        rec = _first_header(path, start.get(path.name, 0))
        if rec is not None:
            rank = rec.get("rank")
            found[path.name] = (rank if isinstance(rank, int) else None, str(rec["run_id"]))
    return found


def split_run_ids(log_dir: str) -> str | None:
    """When this run's trace headers carry different run ids (the ranks' run-identity agreement failed,
    so each wrote an id of its own): one line naming each id and its ranks; else None."""
    by_id: dict[str, list[str]] = {}
    for name, (rank, run_id) in sorted(header_run_ids(log_dir).items()):
        by_id.setdefault(run_id, []).append(str(rank) if rank is not None else name)
    if len(by_id) < 2:
        return None
    ids = "; ".join(f"{run_id}: rank {', '.join(ranks)}" for run_id, ranks in by_id.items())
    return (f"the run-identity agreement failed: this run's traces carry {len(by_id)} different run ids ({ids}), "
            "so they cannot be replayed as one run; each rank's end record says why")


class TraceDir(str):
    """The trace folder of one ``simulate`` run: its path (a ``str``) and what the folder held before the run.

    ``start``: each trace file already there and its size then; what a rank appends past it
    is this run's. :attr:`run_id` is read from the first session header past ``start`` (the
    id every rank of the run shares), so that reports count this run's records only.
    """

    def __new__(cls, path: str, start: dict[str, int] | None = None) -> "TraceDir":
        self = super().__new__(cls, path)
        self.start = dict(start or {})
        self.found_run_id: str | None = None
        return self

    @property
    def run_id(self) -> str | None:
        """This run's id, or None while (or when) the run has written no session header."""
        if self.found_run_id is None:
            self.found_run_id = run_id_after(self, self.start)
        return self.found_run_id


def _writable(directory: Path) -> str | None:
    """None when a file can be created in ``directory`` (tried, not guessed: root ignores modes), else why not."""
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".eplb-write-check-"):
            return None
    except OSError as exc:
        return exc.strerror or str(exc)


def prepare_trace_dir(path: str | None) -> TraceDir:
    """The trace folder, created if missing and checked writable, with its ``progress/`` folder
    (:func:`prepare_progress`); ValueError naming ``--trace-dir`` otherwise.

    A folder that already holds traces is kept: the run appends (see :class:`TraceDir`).
    """
    if path is None:
        return TraceDir(tempfile.mkdtemp(prefix="eplb-simulate-"))
    p = Path(path)
    _writable_folder(p, parents=True)
    prepare_progress(p)
    return TraceDir(str(p), trace_sizes(p))


def prepare_progress(directory: Path) -> None:
    """``progress/`` in the trace folder: a writable folder, created if missing, an earlier run's files cleared.

    Every rank writes its live-progress file there: a file (or anything else) in its place
    would pass the other checks and then crash every rank, so it is a ValueError naming
    ``--trace-dir`` here, before any rank starts.
    """
    _writable_folder(directory / PROGRESS_DIR, parents=False,
                     not_a_folder="; the ranks write their live-progress files in that folder, so move or remove it")
    clear_progress(directory)


def _writable_folder(folder: Path, parents: bool, not_a_folder: str = "") -> None:
    """``folder`` made if missing and checked writable; ValueError naming ``--trace-dir`` otherwise."""
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--trace-dir: {folder} exists and is not a directory{not_a_folder}")
    try:
        folder.mkdir(parents=parents, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--trace-dir: cannot create {folder}: {exc.strerror or exc}") from None
    why = _writable(folder)
    if why:
        raise ValueError(f"--trace-dir: cannot write in {folder}: {why}")


def clear_progress(directory: Path) -> None:
    """Remove an earlier run's progress files (``progress/rank*.json``); ValueError naming ``--trace-dir``.

    Traces are appended to, but the live line shows every rank file in ``progress/`` (with
    ``--scale`` joiners add theirs during the run), so a stale one would pass for a rank of
    this run, with the earlier run's step and state.
    """
    for path in (directory / PROGRESS_DIR).glob("rank*.json"):
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise ValueError(f"--trace-dir: cannot remove the earlier run's progress file {path}: "
                             f"{exc.strerror or exc}") from None


def check_png_path(png: str | None, no_png: bool = False) -> None:
    """``--png`` must name a ``.png`` file in an existing, writable directory; ValueError naming it otherwise."""
    if png is None:
        return
    if no_png:
        raise ValueError("--png and --no-png cannot be combined")
    p = Path(png)
    if p.is_dir():
        raise ValueError(f"--png: {p} is a directory; give the file to write, e.g. {p / 'balancedness.png'}")
    if p.suffix.lower() != ".png":
        raise ValueError(f"--png: {p} must end in .png")
    parent = p.parent
    if not parent.is_dir():
        raise ValueError(f"--png: directory {parent} does not exist")
    why = _writable(parent)
    if why:
        raise ValueError(f"--png: cannot write in {parent}: {why}")


def load_note(opts) -> str | None:
    """One line saying how a load of another shape was fitted to (--layers, --experts), or None when it fits."""
    if opts.load == "zipf":
        return None
    if opts.load == "esft":
        from eplb_fsm.sim.loads import esft_layers
        from eplb_fsm.sim.targets import default_esft_dir

        layers, experts, what = len(esft_layers(default_esft_dir())), 64, "the ESFT intent traces have"
    else:
        from eplb_fsm.sim.loads import load_matrix

        try:
            (layers, experts), what = load_matrix(opts.load).shape, f"{opts.load} has"
        except ValueError as exc:  # a missing or malformed file: a usage error naming the option
            raise load_error(opts.load, exc) from None
    if (layers, experts) == (opts.layers, opts.experts):
        return None
    how = []
    if layers != opts.layers:
        how.append(f"layer l uses load layer l mod {layers}" if opts.layers > layers else
                   f"only its first {opts.layers} layers are used")
    if experts != opts.experts:
        how.append(f"expert e's load goes to expert e mod {opts.experts}" if experts > opts.experts else
                   f"expert e takes the load of expert e mod {experts}")
    return (f"--load: {what} {layers} layers x {experts} experts, the simulation {opts.layers} x {opts.experts}: "
            f"fitted ({'; '.join(how)})")


def load_error(load: str, exc: Exception) -> ValueError:
    """The usage error for a ``--load`` that cannot be read: ``--load: <why>``, and what it takes if no such path."""
    text = str(exc)
    if text.startswith("--"):  # already names its option (--load esft: ..., --layers x --experts: ...)
        return ValueError(text)
    if load not in ("zipf", "esft") and not Path(load).exists():  # a typo of zipf or esft reads as a file
        text += ("; --load takes zipf, esft, example, esft:<task> or a load file (.npy, .npz, .pt, .json, "
                 "a trace folder)")
    return ValueError(f"--load: {text}")


def serving_spans(ranks: int, steps: int, events, engine: bool = False,
                  ) -> tuple[dict[int, list[tuple[int, int]]], int | None]:
    """Under ``--scale`` with ``--inject``: rank -> [(first, last) step a process of that rank may run], and
    the step of an ``:absent`` or ``:late`` scale-up at whose end the run stops (None: it runs to ``steps - 1``).

    A process keeps the rank it starts or joins as: a scale-down's leaving ranks are the highest,
    a scale-up's joiners take the new ones. A leaving rank's last step is its scale's: it
    transfers then. With ``engine``, the last step it runs an engine step at (and so calls
    the step hooks a fault without ``layer=`` acts in): the one before, as it leaves at the
    start of its scale's step (only a scale that aborts would let it serve that step, and a
    fault is not accepted on that chance). An ``:absent`` scale-up aborts (its joiners never start;
    ``:late`` ones start after the abort and never serve) and, while injecting, every rank
    stops at the end of that step, its first fault. ``events``: ``ScaleEvent``s (``step``,
    ``ranks``, ``absent``, ``late``).
    """
    spans: dict[int, list[list[int]]] = {r: [[0, steps - 1]] for r in range(ranks)}
    size, stop = ranks, None
    for event in events:
        if event.ranks > size and (event.absent or getattr(event, "late", False)):
            stop = event.step
            break
        for r in range(event.ranks, size):  # scale-down: the highest ranks leave
            spans[r][-1][1] = event.step - 1 if engine else event.step
        for r in range(size, event.ranks):  # scale-up: joiners serve from the scale's step on
            spans.setdefault(r, []).append([event.step, steps - 1])
        size = event.ranks
    if stop is not None:
        for runs in spans.values():
            for run in runs:
                run[1] = min(run[1], stop)
    return {r: [(a, b) for a, b in runs if a <= b] for r, runs in spans.items()}, stop


def check_injections_serve(injections, ranks: int, steps: int, events) -> None:
    """Refuse an ``--inject`` fault that cannot fire because its rank does not run then (see :func:`serving_spans`).

    A fault with a step but no layer acts in that very step's engine step, so the rank must
    run it: a leaving rank leaves at the start of its scale's step, so its last such step is
    the one before. A ``kill``/``freeze`` with a layer fires at the first transfer of it at
    a step >= S: the rank must run at S or later (a leaving rank transfers at its scale's
    step; a joiner's transfers all come at or after its join). A ``stall-layer`` needs only
    a process of that rank. ValueError naming ``--inject`` and the rule; ``injections``:
    ``sim.inject.Injection``s.
    """
    spans, stop = serving_spans(ranks, steps, events)
    engine_spans, _ = serving_spans(ranks, steps, events, engine=True)
    drill = "late" if any(getattr(e, "late", False) and e.step == stop for e in events) else "absent"
    ended = (f"; the run stops at the end of step {stop}: its :{drill} scale-up aborts, and with --inject every "
             "rank stops at its first fault") if stop is not None else ""
    for inj in injections:
        at_step = inj.step is not None and inj.layer is None  # acts in the engine step itself
        runs = (engine_spans if at_step else spans).get(inj.rank, [])
        shown = " and ".join(f"{a}-{b}" for a, b in runs)
        leaving = at_step and any(a <= inj.step <= b for a, b in spans.get(inj.rank, []))  # its scale's step
        leaves = (" (it leaves at the start of its scale's step, before that step's engine step, where a fault "
                  "without layer= acts)") if leaving else ""
        where = (f"with --scale, rank {inj.rank} (the rank a process starts or joins as, kept until it leaves) "
                 + (f"may run steps {shown} only" if runs else "never runs") + leaves + ended)
        if inj.step is None:
            if not runs:
                raise ValueError(f"--inject {inj.spec!r}: {where}, so the fault cannot fire")
        elif inj.layer is not None:
            if not any(inj.step <= b for _, b in runs):
                raise ValueError(f"--inject {inj.spec!r}: {where}; with layer= the fault fires at a transfer at "
                                 f"step {inj.step} or later while the rank runs, so it cannot fire")
        elif not any(a <= inj.step <= b for a, b in runs):
            raise ValueError(f"--inject {inj.spec!r}: {where}, so the fault at step {inj.step} cannot fire")


def model_bytes_per_rank(layers: int, experts: int, slots_per_rank: int, hidden: int, tokens: int) -> float:
    """A lower bound on the bytes one rank's toy model allocates (``sim.model.ToyMoE``, float64 throughout).

    Its slots' weights, (L, S, d, d) + (L, S, d); one layer of transfer buffer like them, (S, d, d) + (S, d);
    the reference's every logical expert, cached and then stacked, 2 x (L, N, d, d) + (L, N, d); one layer's
    expert products, (max(N, S), T, d); and the batch, (T, d).
    """
    L, N, S, d, T = (float(min(int(v), _SIZE_CAP)) for v in (layers, experts, slots_per_rank, hidden, tokens))
    expert = d * d + d
    return 8.0 * ((L * S + S) * expert + 2.0 * L * N * expert + max(N, S) * T * d + T * d)


def check_model_memory(ranks: int, layers: int, experts: int, redundant: int, hidden: int, tokens: int,
                       processes: int | None = None) -> None:
    """``ValueError`` naming ``--hidden`` / ``--tokens`` when ``processes`` ranks (default ``ranks``; with
    ``--scale``, the largest group) of the toy model could not fit in this machine's memory.

    Every rank is a local process holding ``(experts + redundant) / ranks`` slots; the bound is
    :func:`model_bytes_per_rank` times the processes, a lower bound, so a refused run could not have run.
    """
    from eplb_fsm.bench.options import memory_rule

    processes = ranks if processes is None else processes
    per_rank = model_bytes_per_rank(layers, experts, (experts + redundant) // ranks, hidden, tokens)
    ok, rule = memory_rule(per_rank * processes,
                           f"--hidden {hidden} / --tokens {tokens}: {processes} rank process(es) of the toy model "
                           f"({layers} layers, {experts} experts, {(experts + redundant) // ranks} slots per rank; "
                           f"each holds its slots' and every expert's {hidden} x {hidden} float64 weights, and a "
                           f"{tokens} x {hidden} product per expert of a layer)")
    if not ok:
        raise ValueError(rule)
