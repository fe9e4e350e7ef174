"""The data a schedule is made of: copy runs, a wave's messages, a prepared layer, a commit.

Plain frozen records shared by the Python planner (:mod:`.schedule`), the C one
(:mod:`.native_schedule`) and the executor; :mod:`.schedule` re-exports them.

Rows and runs: a :data:`Run` ``(dst_start, src_start, length)`` copies ``length``
consecutive rows; copy runs are what the executor turns into tensor copies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from eplb_fsm.transfer.batching import Wave
from eplb_fsm.transfer.plan import LayerPlan

__all__ = ["Commit", "PreparedLayer", "Run", "WaveOps", "row_runs"]


Run = tuple[int, int, int]


def row_runs(dst_rows: np.ndarray, src_rows: np.ndarray, *, same_tensor: bool = False) -> tuple[Run, ...]:
    """(dst_start, src_start, length) runs where both row sequences advance by one.

    ``same_tensor``: the copies read and write one tensor, in the given order; a run then
    grows only while its destination and source ranges stay disjoint (a slice copy over
    overlapping rows would read rows it writes).
    """
    runs: list[Run] = []
    for d, s in zip(dst_rows.tolist(), src_rows.tolist()):
        if runs:
            a, b, n = runs[-1]
            if a + n == d and b + n == s and (not same_tensor or abs(a - b) > n):
                runs[-1] = (a, b, n + 1)
                continue
        runs.append((d, s, 1))
    return tuple(runs)


@dataclass(frozen=True)
class WaveOps:
    """One wave's messages per local rank: ((peer, row), ...) in posting order."""

    sends: dict[int, tuple[tuple[int, int], ...]]
    recvs: dict[int, tuple[tuple[int, int], ...]]


@dataclass(frozen=True)
class PreparedLayer:
    """A layer's plans (one per local rank), waves, messages and copy runs: nothing moved."""

    layer: int
    plans: Mapping[int, LayerPlan]  # a dict, or planned on first access for a C-planned layer
    waves: list[Wave]
    ops: tuple[WaveOps, ...] = ()
    local_runs: dict[int, tuple[Run, ...]] = field(default_factory=dict)  # staged local rows: weights -> buffer
    commit: dict[int, "Commit"] = field(default_factory=dict)
    staged: dict[int, np.ndarray] = field(default_factory=dict)  # buffer rows the local copies write


@dataclass(frozen=True)
class Commit:
    """One rank's commit of one layer.

    ``direct``: weights → weights copies of local rows, in the order that reads every
    source row before it is overwritten (:func:`order_local_copies`); they run first.
    ``dst``/``src``: then weight rows written from buffer rows (staged local, primary and
    duplicate rows; ascending by ``dst``), ``runs`` the same as coalesced runs.
    """

    direct: tuple[Run, ...]
    direct_reads: np.ndarray
    dst: np.ndarray
    src: np.ndarray
    runs: tuple[Run, ...]

    def part(self, keep: np.ndarray, with_direct: bool) -> "Commit":
        """The direct copies (or none) and the buffer writes selected by ``keep``."""
        d, s = self.dst[keep], self.src[keep]
        direct = self.direct if with_direct else ()
        reads = self.direct_reads if with_direct else _NO_ROWS
        return Commit(direct, reads, d, s, row_runs(d, s))

    @property
    def empty(self) -> bool:
        return not self.direct and not self.runs


_NO_ROWS = np.zeros(0, dtype=np.int64)
