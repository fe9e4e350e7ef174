"""engine_runs: a rank's last alive records read as one run, and the waits it got past before."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from eplb_fsm.inspect.engine_runs import Run, engine_run, held_back, longest_wait_before, waited_or_stopped

IN = ("all_reduce", True, "WORLD:[4]", True)   # the main thread inside the engine's all-reduce
SUB = ("all_reduce", False, "3:[4]", True)     # inside a subgroup's
SIDE = ("all_reduce", True, "WORLD:[4]", False)   # a side thread's wait; the main thread in its own work


def rank(alive: list[tuple], last_step: int | None = None, end: dict | None = None) -> SimpleNamespace:
    """A rank summary with alive records (ts, step, engine wait) and no controller collective."""
    records = [(ts, step, "collecting", None, engine, None) for ts, step, engine in alive]
    return SimpleNamespace(alive=records, collectives={}, alive_interval=1.0, end=end,
                           last_step=records[-1][1] if last_step is None else last_step)


def test_three_records_inside_at_one_step_are_a_run():
    """Three records inside the engine's all-reduce at step 5: a run from the first to the last, ours."""
    assert engine_run(rank([(9.0, 4, None), (10.0, 5, IN), (11.0, 5, IN), (12.0, 5, IN)])) == \
        Run(5, "all_reduce", 10.0, 12.0, "WORLD:[4]", True)


@pytest.mark.parametrize("alive, last_step, why", [
    ([(10.0, 5, IN), (11.0, 5, IN)], None, "two records"),
    ([(10.0, 5, IN), (11.0, 5, IN), (12.0, 5, IN)], 9, "a later step"),
    ([(10.0, 5, IN), (14.0, 5, IN), (15.0, 5, IN)], None, "a silence"),
    ([(10.0, 4, IN), (11.0, 5, IN), (12.0, 5, IN)], None, "two steps"),
    ([(10.0, 5, SUB), (11.0, 5, SUB), (12.0, 5, SUB)], None, "another group"),
])
def test_what_is_no_run_of_ours(alive, last_step, why):
    """Too few records, a later step after them, a silence over 2.5 intervals, two steps or a subgroup's wait."""
    assert engine_run(rank(alive, last_step)) is None, why


def test_the_modes_tell_a_subgroups_wait_and_a_rank_in_its_own_work():
    """`any` takes a subgroup's wait (not ours); `own` takes records whose main thread waits in nothing."""
    sub = engine_run(rank([(10.0, 5, SUB), (11.0, 5, SUB), (12.0, 5, SUB)]), "any")
    assert sub is not None and sub.ours is False
    own = engine_run(rank([(10.0, 5, None), (11.0, 5, SIDE), (12.0, 5, SIDE)]), "own")
    assert own is not None and own.op == "all_reduce"
    assert engine_run(rank([(10.0, 5, None), (11.0, 5, IN), (12.0, 5, None)]), "own") is None


def test_an_uneven_all_to_all_is_one_collective_per_group():
    """Two ranks' all-to-alls with inputs of other shapes are one collective; two all-reduces of other shapes not."""
    a, b = (Run(5, "all_to_all_single", 0.0, 1.0, f"WORLD:[{n}]", True) for n in (3, 6))
    assert a.collective == b.collective == ("all_to_all_single", "WORLD")
    assert Run(5, "all_reduce", 0.0, 1.0, "WORLD:[3]", True).collective != \
        Run(5, "all_reduce", 0.0, 1.0, "WORLD:[6]", True).collective


def test_longest_wait_before_measures_the_waits_the_job_got_past():
    """Waits at steps 2 (3 s) and 3 (1 s) before ts 20: 3 s; a record in its own work or a new step splits them."""
    alive = [(1.0, 2, IN), (2.0, 2, IN), (3.0, 2, None), (4.0, 2, IN), (5.0, 2, IN), (6.0, 2, IN), (7.0, 2, IN),
             (8.0, 3, IN), (9.0, 3, IN), (20.0, 4, IN), (29.0, 4, IN)]
    assert longest_wait_before(rank(alive), 20.0) == 3.0
    assert longest_wait_before(rank(alive), 2.5) == 1.0
    assert longest_wait_before(rank([(1.0, 2, None)]), 20.0) == 0.0


@pytest.mark.parametrize("end, ok", [
    (None, True), ({"how": "signal", "ts": 13.0}, True),
    ({"how": "exception", "ts": 13.0, "error": "RuntimeError: Application timeout caused pair closure"}, True),
    ({"how": "exception", "ts": 11.0, "error": "RuntimeError: Application timeout caused pair closure"}, False),
    ({"how": "exception", "ts": 13.0, "error": "ValueError: bad batch"}, False), ({"how": "closed", "ts": 13.0}, False),
])
def test_the_ends_a_stall_leads_to(end, ok):
    """Running, a signal, or a failed wait after the last alive record; not a crash, a close, or a wait before it."""
    assert waited_or_stopped(rank([(10.0, 5, IN), (12.0, 5, IN)], end=end)) is ok


@pytest.mark.parametrize("lasted, before, held", [(59.0, 0.0, True), (61.0, 0.0, False), (61.0, 31.0, True),
                                                  (63.0, 31.0, False)])
def test_a_wait_under_a_minute_or_twice_the_ones_got_past_is_held_back(lasted, before, held):
    """Under 60 s, or no more than twice the longest earlier wait: too short to name a cause."""
    assert held_back(lasted, before) is held
