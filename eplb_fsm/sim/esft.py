"""ESFT routing traces as load matrices: per-sequence token counts and per-batch windows.

Bundled with the package (``data/esft_routing.npz``, MIT, see ``data/ESFT-SOURCE.md``):
per-sequence token counts for the tasks ``intent`` (26 layers), ``law``, ``summary`` and
``translation`` (layers 1, 13, 26), named ``"esft:<task>"`` wherever a trace directory is
accepted. A task directory of the original traces holds one
``expert_weights_<layer>.txt`` per layer: one line per sequence, ``ids<TAB><TAB>gate
weights`` with ``ids`` the flat, tab-separated top-k expert ids of its tokens. Every
layer file of a task lists the same sequences in the same order.

- :func:`has_esft_traces`, :func:`trace_file_layer`: whether a directory is such a task
  directory, which layer a file holds;
- :func:`esft_sequence_loads`: per-sequence counts ``(S, L, N)`` int64;
- :func:`iter_esft_windows` / :func:`esft_load_windows`: sums of consecutive sequences,
  one ``(L, N)`` window per batch.

Bad files raise ``ValueError`` naming the file (and line) and the problem; an expert id must
be at most :data:`MAX_EXPERT_ID` (the ids size the count arrays, so a huge one would
ask for terabytes).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Iterator

import numpy as np

__all__ = [
    "BUNDLED_ESFT",
    "ESFT_PREFIX",
    "ESFT_TASKS",
    "MAX_COUNT_CELLS",
    "MAX_EXPERT_ID",
    "bundled_sequence_loads",
    "bundled_task",
    "esft_layers",
    "esft_load_windows",
    "esft_sequence_loads",
    "esft_token_scores",
    "expert_id_rule",
    "has_esft_traces",
    "iter_esft_windows",
    "trace_file_layer",
]

#: bundled ESFT routing traces: per-sequence token counts (see data/ESFT-SOURCE.md)
BUNDLED_ESFT = Path(__file__).resolve().parent.parent / "data" / "esft_routing.npz"
#: the tasks of the bundled traces ("esft:<task>")
ESFT_TASKS = ("intent", "law", "summary", "translation")
#: prefix naming a bundled task where a trace directory is accepted
ESFT_PREFIX = "esft:"
#: largest expert id a trace or summary.json may name: `plan` allows at most 16,384 slots per
#: layer (its MAX_SLOTS) and every expert needs a slot, so no plannable layer has more experts
MAX_EXPERT_ID = 16_384 - 1
#: most cells (sequences x layers x experts) of the per-sequence counts a trace folder may need:
#: 2^27 int64 cells is 1 GiB, ample for real traces (the bundled ESFT intent trace needs about 0.2M)
MAX_COUNT_CELLS = 1 << 27

_TRACE_FILE = re.compile(r"^expert_weights_(\d+)\.txt$")


def trace_file_layer(path: Path) -> int | None:
    """The layer number of an ``expert_weights_<layer>.txt`` path; None for any other name."""
    match = _TRACE_FILE.match(path.name)
    return int(match.group(1)) if match else None


def has_esft_traces(directory: Path) -> bool:
    """Whether ``directory`` holds at least one ``expert_weights_<layer>.txt`` file."""
    return any(_TRACE_FILE.match(child.name) for child in directory.iterdir())


def bundled_task(source: Any) -> str | None:
    """The task of an ``"esft:<task>"`` reference, else None (a directory path)."""
    text = str(source)
    if not text.startswith(ESFT_PREFIX):
        return None
    task = text[len(ESFT_PREFIX):]
    if task not in ESFT_TASKS:
        raise ValueError(f"{text}: unknown bundled ESFT task {task!r}; choose from {', '.join(ESFT_TASKS)}")
    return task


def bundled_sequence_loads(task: str) -> tuple[np.ndarray, list[int]]:
    """The bundled per-sequence counts of ``task``: ((S, L, 64) int64, layer numbers)."""
    with np.load(BUNDLED_ESFT, allow_pickle=False) as data:
        return data[f"{task}.sequences"].astype(np.int64), [int(x) for x in data[f"{task}.layers"]]


def esft_token_scores(task: str) -> np.ndarray:
    """The bundled ``summary.json`` ``token_scores`` of ``task``: (26, 64) float64 fractions per layer."""
    bundled_task(ESFT_PREFIX + task)
    with np.load(BUNDLED_ESFT, allow_pickle=False) as data:
        return data[f"{task}.token_scores"].copy()


def esft_layers(source: str | os.PathLike) -> list[int]:
    """Layer numbers available in a trace directory or a bundled ``"esft:<task>"``, ascending."""
    task = bundled_task(source)
    if task is not None:
        return bundled_sequence_loads(task)[1]
    return [layer for layer, _ in _trace_files(Path(source), None)]



def _trace_files(directory: Path, layers: list[int] | None) -> list[tuple[int, Path]]:
    found = {}
    for child in directory.iterdir():
        m = _TRACE_FILE.match(child.name)
        if m:
            found[int(m.group(1))] = child
    if not found:
        raise ValueError(f"{directory}: no expert_weights_<layer>.txt trace files")
    if layers is None:
        layers = sorted(found)
    missing = [layer for layer in layers if layer not in found]
    if missing:
        raise ValueError(f"{directory}: no trace file for layer(s) {missing}; present: {sorted(found)}")
    return [(layer, found[layer]) for layer in layers]


def expert_id_rule() -> str:
    """The rule every expert id of a load file must follow, as error messages state it."""
    return (f"expert ids must be 0..{MAX_EXPERT_ID} (at most {MAX_EXPERT_ID + 1} experts per layer, "
            "the most slots per layer `plan` allows)")


def _read_trace(path: Path) -> list[np.ndarray]:
    """Expert ids of every sequence (one int64 array per line) of one layer file."""
    sequences = []
    try:
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                line = line.rstrip("\n")
                if not line.strip():
                    continue
                ids_text = line.split("\t\t", 1)[0]
                try:
                    ids = np.array(ids_text.split("\t"), dtype=np.int64) if ids_text else np.zeros(0, np.int64)
                except ValueError:
                    raise ValueError(f"{path}:{line_no}: expert ids are not integers") from None
                except OverflowError:  # past int64: over the limit below as well
                    raise ValueError(f"{path}:{line_no}: an expert id does not fit in 64 bits; "
                                     f"{expert_id_rule()}") from None
                if ids.size and ids.min() < 0:
                    raise ValueError(f"{path}:{line_no}: negative expert id")
                if ids.size and ids.max() > MAX_EXPERT_ID:
                    raise ValueError(f"{path}:{line_no}: expert id {int(ids.max())} is too large; "
                                     f"{expert_id_rule()}")
                sequences.append(ids)
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read trace: {exc}") from None
    return sequences


def esft_sequence_loads(
    directory: str | os.PathLike,
    num_experts: int | None = None,
    layers: list[int] | None = None,
) -> np.ndarray:
    """Per-sequence token counts of an ESFT trace directory: ``(S, L, N)`` int64.

    ``layers`` selects layer numbers (default: every ``expert_weights_<l>.txt`` present,
    in numeric order); ``num_experts`` defaults to the largest id seen + 1 (64 for the
    ESFT data). Raises ``ValueError`` when files disagree on the number of sequences.
    ``directory`` may also be ``"esft:<task>"``: the traces bundled with the package.
    """
    task = bundled_task(directory)
    if task is not None:
        counts, present = bundled_sequence_loads(task)
        chosen = present if layers is None else layers
        missing = [layer for layer in chosen if layer not in present]
        if missing:
            raise ValueError(f"{directory}: no trace for layer(s) {missing}; present: {present}")
        counts = counts[:, [present.index(layer) for layer in chosen]]
        if num_experts is not None:
            if num_experts < counts.shape[2] and counts[:, :, num_experts:].any():
                raise ValueError(f"{directory}: expert id >= num_experts {num_experts}")
            out = np.zeros(counts.shape[:2] + (num_experts,), dtype=np.int64)
            width = min(num_experts, counts.shape[2])
            out[:, :, :width] = counts[:, :, :width]
            counts = out
        return counts
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"{directory}: not a directory")
    files = _trace_files(directory, layers)
    per_layer = [_read_trace(path) for _, path in files]
    counts = {len(seqs) for seqs in per_layer}
    if len(counts) != 1:
        sizes = {layer: len(seqs) for (layer, _), seqs in zip(files, per_layer)}
        raise ValueError(f"{directory}: layer files have different numbers of sequences: {sizes}")
    num_sequences = counts.pop()
    if num_sequences == 0:
        raise ValueError(f"{directory}: trace files are empty")
    largest = max((int(ids.max()) for seqs in per_layer for ids in seqs if ids.size), default=-1)
    if num_experts is None:
        num_experts = largest + 1
    elif largest >= num_experts:
        raise ValueError(f"{directory}: expert id {largest} >= num_experts {num_experts}")
    cells = num_sequences * len(files) * num_experts
    if cells > MAX_COUNT_CELLS:
        raise ValueError(f"{directory}: {num_sequences} sequences x {len(files)} layers x {num_experts} experts "
                         f"is {cells} counts; at most {MAX_COUNT_CELLS} (1 GiB) per trace folder")
    out = np.zeros((num_sequences, len(files), num_experts), dtype=np.int64)
    for li, seqs in enumerate(per_layer):
        for si, ids in enumerate(seqs):
            out[si, li] = np.bincount(ids, minlength=num_experts)
    return out


def iter_esft_windows(
    directory: str | os.PathLike,
    sequences_per_window: int,
    num_experts: int | None = None,
    layers: list[int] | None = None,
    drop_last: bool = True,
) -> Iterator[np.ndarray]:
    """Yield per-batch loads (L, N): sums of ``sequences_per_window`` consecutive sequences.

    A last, shorter batch is dropped unless ``drop_last`` is False.
    """
    if sequences_per_window < 1:
        raise ValueError(f"sequences_per_window must be >= 1, got {sequences_per_window}")
    per_sequence = esft_sequence_loads(directory, num_experts=num_experts, layers=layers)
    for start in range(0, per_sequence.shape[0], sequences_per_window):
        chunk = per_sequence[start : start + sequences_per_window]
        if drop_last and chunk.shape[0] < sequences_per_window:
            return
        yield chunk.sum(axis=0)


def esft_load_windows(
    directory: str | os.PathLike,
    sequences_per_window: int,
    num_experts: int | None = None,
    layers: list[int] | None = None,
    drop_last: bool = True,
) -> np.ndarray:
    """Per-batch load windows ``(steps, L, N)`` int64 from consecutive sequences (see :func:`iter_esft_windows`)."""
    windows = list(iter_esft_windows(directory, sequences_per_window, num_experts, layers, drop_last))
    if not windows:
        raise ValueError(f"{directory}: fewer than {sequences_per_window} sequences, no full window")
    return np.stack(windows)


