"""The schedule's records (transfer/schedule_types.py): copy runs and commit parts."""

from __future__ import annotations

import numpy as np

from eplb_fsm.transfer.schedule_types import Commit, row_runs


def _a(*v: int) -> np.ndarray:
    return np.array(v, dtype=np.int64)


def test_runs_join_rows_that_advance_together():
    """Consecutive (dst, src) pairs that both advance by one form one run; any break starts a new one."""
    assert row_runs(_a(0, 1, 2, 5, 6), _a(4, 5, 6, 1, 9)) == ((0, 4, 3), (5, 1, 1), (6, 9, 1))
    assert row_runs(_a(), _a()) == ()


def test_same_tensor_runs_never_overlap_their_source():
    """Within one tensor a run stops growing before its destination range reaches its source range."""
    # 0<-1, 1<-2, 2<-3 would be one slice copy reading rows it writes
    assert row_runs(_a(0, 1, 2), _a(1, 2, 3), same_tensor=True) == ((0, 1, 1), (1, 2, 1), (2, 3, 1))
    assert row_runs(_a(0, 1), _a(4, 5), same_tensor=True) == ((0, 4, 2),)


def test_commit_part_keeps_selected_writes_and_optionally_the_direct_copies():
    """A part holds the chosen buffer writes with their runs, and the direct copies only when asked."""
    whole = Commit(((3, 7, 1),), _a(7), _a(0, 1, 4), _a(0, 1, 2), row_runs(_a(0, 1, 4), _a(0, 1, 2)))
    keep = np.array([True, True, False])
    first = whole.part(keep, with_direct=True)
    rest = whole.part(~keep, with_direct=False)
    assert first.direct == ((3, 7, 1),) and first.direct_reads.tolist() == [7]
    assert first.dst.tolist() == [0, 1] and first.runs == ((0, 0, 2),)
    assert rest.direct == () and rest.direct_reads.size == 0 and rest.runs == ((4, 2, 1),)
    assert not first.empty and not rest.empty
    assert whole.part(np.zeros(3, dtype=bool), with_direct=False).empty
