"""One layer's prepared transfer cut into chunks of at most ``max_bytes`` of expert rows (async pacing).

``EplbConfig.async_max_bytes_per_step`` bounds what the async worker moves per engine step:
the layer's messages go in chunks, the worker waiting for the next engine step between two
(``eplb_fsm.fsm.pacing.StepPacer``). Every rank must cut at the same messages, or a send of
one chunk would meet a receive of another: the cuts follow from the layer's global message
list alone (its waves in order, each wave's (src, dst) pairs in order, each pair's messages
in order, one expert row each), which every rank derives alike from the replicated maps.
A rank then runs, per chunk, its own sends and receives among those messages (the k-th
message of a pair is the k-th entry for that peer in its posting order, on both sides).

:func:`message_count` and :func:`chunk_count` give the number of chunks from the maps
alone, before any plan is built: the controller uses it to skip ready polls that could
only say "not yet" (``eplb_fsm.fsm.decide.decide_poll``, ``early``).

The chunks only split the messages: the local copies go with the first chunk, the commit
is the layer's whole commit, and nothing writes the weights, so the buffer ends exactly as
the unchunked transfer leaves it and rollback is unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import torch

from eplb_fsm.transfer.batching import Wave
from eplb_fsm.transfer.schedule import PreparedLayer, WaveOps

__all__ = ["chunk_count", "chunk_layer", "message_count", "row_bytes"]

Piece = tuple[int, tuple[int, int], int, int]   # (wave, (src, dst), first message, end message)


def row_bytes(layer_weights: Sequence[torch.Tensor]) -> int:
    """Bytes one expert row of a layer carries over all its tensors (equal on every rank)."""
    return sum((t[0].numel() if t.shape[0] else 0) * t.element_size() for t in layer_weights)


def message_count(old_row: np.ndarray, new_row: np.ndarray, world_size: int) -> int:
    """Messages a layer's transfer sends over all ranks: one per (rank, expert) the rank needs and lacks.

    ``old_row``, ``new_row``: the layer's (P,) placements, -1 for an empty slot, P = S x G. A
    rank that needs an expert in several of its slots receives it once (the rest are local
    copies); one that already holds it receives nothing.
    """
    old, new = np.asarray(old_row, dtype=np.int64), np.asarray(new_row, dtype=np.int64)
    rank = np.arange(old.size, dtype=np.int64) // (old.size // world_size)
    width = int(max(old.max(initial=-1), new.max(initial=-1))) + 1
    # (G, N) presence tables, not np.unique: numpy 2's unique imports numpy.ma on first use
    # (~20 ms, once per process), and this can run on the engine thread inside a step
    held = np.zeros((world_size, width), dtype=bool)
    needed = np.zeros((world_size, width), dtype=bool)
    held[rank[old >= 0], old[old >= 0]] = True
    needed[rank[new >= 0], new[new >= 0]] = True
    return int(np.count_nonzero(needed & ~held))


def chunk_count(messages: int, row_nbytes: int, max_bytes: int) -> int:
    """How many chunks :func:`chunk_layer` cuts a layer of ``messages`` rows of ``row_nbytes`` into
    (1 when ``max_bytes`` <= 0 or nothing moves): each chunk holds ``max_bytes // row_nbytes``
    rows, at least one."""
    if max_bytes <= 0 or messages <= 0:
        return 1
    per = max(1, int(max_bytes) // max(1, int(row_nbytes)))
    return -(-int(messages) // per)


def chunk_pieces(prep: PreparedLayer, row_nbytes: int, max_bytes: int) -> list[list[Piece]]:
    """The chunks as lists of message ranges: at most ``max_bytes`` each (a row larger than it goes alone)."""
    size = max(1, int(row_nbytes))
    chunks: list[list[Piece]] = [[]]
    used = 0
    for w, wave in enumerate(prep.waves):
        for pair, idx in zip(wave.pairs, wave.transfers):
            n, lo = len(idx), 0
            while lo < n:
                room = (max_bytes - used) // size
                if room <= 0:
                    if used:
                        chunks.append([])
                        used = 0
                        continue
                    room = 1
                take = min(room, n - lo)
                chunks[-1].append((w, pair, lo, lo + take))
                used += take * size
                lo += take
    return [c for c in chunks if c]


def _ops_part(ops: WaveOps, ranges: dict[tuple[int, int], tuple[int, int]]) -> WaveOps:
    """The local ranks' sends and receives among the given message ranges of one wave."""
    def pick(entries: tuple[tuple[int, int], ...], pair_of) -> tuple[tuple[int, int], ...]:
        ordinal: dict[int, int] = {}
        out = []
        for peer, row in entries:
            k = ordinal.get(peer, 0)
            ordinal[peer] = k + 1
            span = ranges.get(pair_of(peer))
            if span is not None and span[0] <= k < span[1]:
                out.append((peer, row))
        return tuple(out)

    sends = {r: pick(e, lambda peer, r=r: (r, peer)) for r, e in ops.sends.items()}
    recvs = {r: pick(e, lambda peer, r=r: (peer, r)) for r, e in ops.recvs.items()}
    return WaveOps(sends, recvs)


def chunk_layer(prep: PreparedLayer, row_nbytes: int, max_bytes: int) -> list[PreparedLayer]:
    """``prep`` as consecutive layers of at most ``max_bytes`` of rows each (``[prep]`` when
    ``max_bytes`` <= 0 or nothing moves). Each chunk's waves are sub-waves of ``prep``'s."""
    if max_bytes <= 0 or not prep.waves:
        return [prep]
    out = []
    for i, pieces in enumerate(chunk_pieces(prep, row_nbytes, max_bytes)):
        waves, ops = [], []
        for w in sorted({p[0] for p in pieces}):
            mine = [p for p in pieces if p[0] == w]
            full = prep.waves[w]
            by_pair = dict(zip(full.pairs, full.transfers))
            waves.append(Wave(tuple(p[1] for p in mine), tuple(by_pair[p[1]][p[2]:p[3]] for p in mine)))
            ops.append(_ops_part(prep.ops[w], {p[1]: (p[2], p[3]) for p in mine}))
        out.append(dataclasses.replace(prep, waves=waves, ops=tuple(ops),
                                       local_runs=prep.local_runs if i == 0 else {}))
    return out
