"""Checks ``eplb-fsm simulate`` makes before any work: output paths, and what a load of another shape becomes.

Each check raises ``ValueError`` whose message starts with the option it is about
(``--trace-dir: ...``, ``--png: ...``); the command prints it as one line and exits 2,
so a path that cannot be written is found before a rank starts, not after the run.
Nothing here imports torch.

A ``--trace-dir`` that already holds traces is appended to, as a restarted engine appends a
session to its rank file: :func:`prepare_trace_dir` returns a :class:`TraceDir`, which
remembers how long each trace file was before this run and so finds this run's id, and the
report, the replay and the injection check read only this run's sessions.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

__all__ = ["TraceDir", "check_png_path", "load_note", "prepare_trace_dir", "run_id_after", "trace_sizes"]

RANK0_FILE = "rank00000.jsonl"  # eplb_fsm.trace.trace_path(dir, 0).name, without importing torch


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
        try:
            with open(path, "rb") as fh:
                fh.seek(start.get(path.name, 0))
                for raw in fh:
                    if b'"header"' not in raw:
                        continue
                    try:
                        rec = json.loads(raw)
                    except ValueError:
                        continue
                    if isinstance(rec, dict) and rec.get("event") == "header" and rec.get("run_id"):
                        return str(rec["run_id"])
        except OSError:
            continue
    return None


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
    """The trace folder, created if missing and checked writable; ValueError naming ``--trace-dir`` otherwise.

    A folder that already holds traces is kept: the run appends (see :class:`TraceDir`).
    """
    if path is None:
        return TraceDir(tempfile.mkdtemp(prefix="eplb-simulate-"))
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"--trace-dir: {p} exists and is not a directory")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--trace-dir: cannot create {p}: {exc.strerror or exc}") from None
    why = _writable(p)
    if why:
        raise ValueError(f"--trace-dir: cannot write in {p}: {why}")
    return TraceDir(str(p), trace_sizes(p))


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
        from eplb_fsm.sim.run import default_esft_dir

        layers, experts, what = len(esft_layers(default_esft_dir())), 64, "the ESFT intent traces have"
    else:
        from eplb_fsm.sim.loads import load_matrix

        try:
            (layers, experts), what = load_matrix(opts.load).shape, f"{opts.load} has"
        except ValueError as exc:  # a missing or malformed file: a usage error naming the option
            raise ValueError(f"--load: {exc}") from None
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
