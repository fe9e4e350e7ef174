"""Order a rank's local copies so that most rows move once, weights to weights.

A *local* row (docs/design.md §6.1) gets an expert this rank already holds, from the first old
row holding it. Staging every such copy through the buffer costs two copies per row
(weights → buffer while the messages fly, buffer → weights at commit). At commit time
every message of the layer has completed, so nothing may still be sent from a row; a
local copy can then go straight from its source row, provided that row has not yet been
overwritten. Copies are therefore ordered so that every copy that reads a row runs
before the copy that writes it (Kahn's algorithm on "d reads s"). What is left after
that are in-rank cycles (row a takes b's expert while b takes a's): one copy per cycle
is *staged* (its source read into the buffer during the layer's messages, as before),
which turns the cycle into a chain.

Commit order is then: the direct copies in the order given here, then every row written
from the buffer (staged local, primary and duplicate rows), whose old contents no direct
copy reads any more.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

__all__ = ["LocalCopyOrder", "order_local_copies"]


@dataclass(frozen=True)
class LocalCopyOrder:
    """How one rank's local rows of one layer are filled. All arrays are int64.

    ``direct_rows``/``direct_src_rows``: (D,) copies weights[src] → weights[row], to run in
    this order at commit. ``staged_rows``/``staged_src_rows``: (C,) copies that go through
    the buffer (weights[src] → buffer[row] while the messages fly, buffer[row] →
    weights[row] at commit), one per in-rank cycle, ascending by row.
    """

    direct_rows: np.ndarray
    direct_src_rows: np.ndarray
    staged_rows: np.ndarray
    staged_src_rows: np.ndarray


def order_local_copies(local_rows: np.ndarray, local_src_rows: np.ndarray) -> LocalCopyOrder:
    """Split ``(local_rows, local_src_rows)`` (each (N,), destination rows distinct) into direct and staged copies.

    Deterministic: among the copies that may run, the lowest destination row goes first;
    a cycle is broken at its lowest destination row. Every rank computing the same plan
    gets the same order (only this rank's weights are involved, but tests rely on it).
    """
    dst_a = np.asarray(local_rows, dtype=np.int64).reshape(-1)
    src_a = np.asarray(local_src_rows, dtype=np.int64).reshape(-1)
    dst, src = dst_a.tolist(), src_a.tolist()
    if len(dst) != len(src):
        raise ValueError(f"local_src_rows: length {len(src)} must equal local_rows' {len(dst)}")
    if not dst:
        return _NO_COPIES
    if len(set(dst)) != len(dst):
        raise ValueError("local_rows: destination rows must be distinct")
    if set(dst).isdisjoint(src):
        # no copy reads a row another one writes: every copy may run at once, so the
        # lowest destination row first is the whole order (what the loop below gives too)
        order = np.argsort(dst_a, kind="stable")
        return LocalCopyOrder(dst_a[order], src_a[order], _NO_ROWS, _NO_ROWS)
    readers: dict[int, list[int]] = {}  # row -> pending copies that still need its old contents
    for i, s in enumerate(src):
        readers.setdefault(s, []).append(i)
    waiting = {d: len(readers.get(d, ())) for d in dst}
    writer = {d: i for i, d in enumerate(dst)}
    ready = [(d, i) for i, d in enumerate(dst) if waiting[d] == 0]
    heapq.heapify(ready)
    done = [False] * len(dst)
    direct: list[int] = []
    staged: list[int] = []

    def release(i: int) -> None:
        """Copy i has read its source: the copy writing that row may be ready now."""
        j = writer.get(src[i])
        if j is not None:
            waiting[dst[j]] -= 1
            if waiting[dst[j]] == 0 and not done[j]:
                heapq.heappush(ready, (dst[j], j))

    while len(direct) + len(staged) < len(dst):
        while ready:
            _, i = heapq.heappop(ready)
            if done[i]:
                continue
            done[i] = True
            direct.append(i)
            release(i)
        left = [i for i in range(len(dst)) if not done[i]]
        if not left:
            break
        # Every copy left writes a row that a copy left still reads. Walking from one to
        # a pending reader of its row must close a cycle; stage the cycle's lowest row.
        i = min(left, key=lambda c: dst[c])
        path: dict[int, int] = {}
        while i not in path:
            path[i] = len(path)
            i = min((r for r in readers.get(dst[i], ()) if not done[r]), key=lambda c: dst[c])
        cycle = [c for c, pos in path.items() if pos >= path[i]]
        x = min(cycle, key=lambda c: dst[c])
        done[x] = True
        staged.append(x)
        release(x)
    staged.sort(key=lambda i: dst[i])
    return LocalCopyOrder(_pick(direct, dst), _pick(direct, src), _pick(staged, dst), _pick(staged, src))


_NO_ROWS = np.zeros(0, dtype=np.int64)
_NO_ROWS.flags.writeable = False  # shared by every empty result
_NO_COPIES = LocalCopyOrder(_NO_ROWS, _NO_ROWS, _NO_ROWS, _NO_ROWS)


def _pick(order: list[int], values: list[int]) -> np.ndarray:
    return np.asarray([values[i] for i in order], dtype=np.int64)
