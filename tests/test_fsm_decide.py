"""The pure decisions of fsm/decide.py: what a step does, how an all-reduce's flags are read."""

from __future__ import annotations

import pytest

from eplb_fsm.fsm.decide import (
    ABORT,
    COMMIT_LAYER,
    TAKE_PLAN,
    WAIT,
    Counters,
    decide_layer,
    decide_plan,
    decide_progress,
    decide_salvage,
    decide_step,
    decide_poll,
    JOIN,
    POST,
    Progress,
    StepDecision,
)
from eplb_fsm.fsm.machine import COLLECTING, COMMITTING, FAILED, PLANNING, SCALING, TRANSFERRING


def test_a_step_is_due_only_while_collecting_with_models_at_the_threshold():
    """due needs collecting, since >= threshold and at least one model; below it, only recording."""
    assert decide_step(COLLECTING, 10, 10, True, False).due
    assert not decide_step(COLLECTING, 9, 10, True, False).due
    assert not decide_step(COLLECTING, 10, 10, False, False).due
    for state in (PLANNING, TRANSFERRING, COMMITTING, SCALING, FAILED):
        assert not decide_step(state, 99, 10, True, False).due


def test_a_step_polls_only_an_async_job_in_planning_or_transferring_or_the_closing_agreement():
    """The ready flags are asked for in planning, transferring and committing (every layer written), never otherwise."""
    assert decide_poll(PLANNING, True, True, False) == POST
    assert decide_poll(TRANSFERRING, True, True, False) == POST
    assert decide_poll(COMMITTING, True, True, False) == POST
    assert decide_poll(TRANSFERRING, False, True, False) is None
    for state in (COLLECTING, SCALING, FAILED):
        assert decide_poll(state, True, True, False) is None


def test_the_flags_join_the_steps_all_reduce_when_it_has_one_or_overlap_is_off():
    """A step that all-reduces anyway (or async_overlap_poll=False) reads the flags at once; else they are posted."""
    assert decide_poll(TRANSFERRING, True, True, True) == JOIN
    assert decide_poll(TRANSFERRING, True, False, False) == JOIN
    assert decide_poll(PLANNING, True, False, True) == JOIN


def test_a_job_handed_over_on_this_step_is_not_asked_about_until_the_next():
    """fresh: a posted poll of a job started this step could only say 'not yet', so nothing is posted."""
    assert decide_poll(TRANSFERRING, True, True, False, fresh=True) is None
    assert decide_poll(PLANNING, True, True, False, fresh=True) is None
    assert decide_poll(TRANSFERRING, True, True, False, fresh=False) == POST
    assert decide_poll(TRANSFERRING, True, True, True, fresh=True) == JOIN


def test_a_job_that_cannot_be_ready_yet_is_asked_about_only_by_a_step_that_all_reduces_anyway():
    """early: no flags are posted or waited on; a step with its own all-reduce still carries them."""
    assert decide_poll(TRANSFERRING, True, True, False, early=True) is None
    assert decide_poll(TRANSFERRING, True, False, False, early=True) is None     # not even a blocking one
    assert decide_poll(TRANSFERRING, True, True, True, early=True) == JOIN
    assert decide_poll(TRANSFERRING, True, True, False, early=False) == POST
    assert decide_poll(COLLECTING, True, True, True, early=True) is None


def test_a_step_logs_only_when_asked():
    """log follows log_now alone: a plain recording step neither logs nor is due."""
    assert decide_step(COLLECTING, 1, 10, True, False) == StepDecision(due=False, log=False)
    assert decide_step(COLLECTING, 1, 10, True, True).log
    assert decide_step(COLLECTING, 10, 10, True, False) == StepDecision(due=True, log=False)


def test_a_failed_machine_logs_no_balancedness():
    """In failed a logging step does not all-reduce its balancedness over the group that broke; elsewhere it does."""
    assert decide_step(FAILED, 1, 10, True, True) == StepDecision(due=False, log=False)
    for state in (COLLECTING, PLANNING, TRANSFERRING, COMMITTING, SCALING):
        assert decide_step(state, 1, 10, True, True).log, state


@pytest.mark.parametrize("summed, state, action", [
    ([4, 0, 0, 0], PLANNING, TAKE_PLAN),
    ([4, 0, 0, 0], TRANSFERRING, COMMIT_LAYER),
    ([3, 0, 0, 0], TRANSFERRING, WAIT),
    ([3, 1, 0, 0], TRANSFERRING, ABORT),
    ([2, 0, 2, 0], PLANNING, ABORT),
])
def test_progress_reads_the_summed_ready_failed_late_flags(summed, state, action):
    """All four ready: take the result; fewer: wait; any failure or lateness: abort."""
    verdict = decide_progress([float(v) for v in summed], 4, state)
    assert verdict.action == action
    assert (verdict.ready, verdict.failed, verdict.late, verdict.broken) == tuple(summed)


def test_progress_before_the_ready_step_aborts_on_a_failure_but_not_on_lateness():
    """early (a paced layer's flags joined before its ready step): late ranks wait, a failed rank still aborts."""
    assert decide_progress([0.0, 0.0, 2.0, 0.0], 2, TRANSFERRING, early=True).action == WAIT
    assert decide_progress([1.0, 1.0, 1.0, 0.0], 2, TRANSFERRING, early=True).action == ABORT
    assert decide_progress([0.0, 0.0, 2.0, 0.0], 2, TRANSFERRING).action == ABORT


def test_a_sync_layer_commits_unless_a_rank_failed():
    """The per-layer agreement aborts on any failure and commits otherwise."""
    assert decide_layer([2.0, 0.0, 0.0, 0.0]).action == COMMIT_LAYER
    assert decide_layer([1.0, 1.0, 0.0, 0.0]).action == ABORT


def test_a_broken_commit_on_any_rank_aborts_every_agreement():
    """A fourth flag, ranks whose write raised part-way, aborts sync and async agreements whatever else they say."""
    assert decide_layer([2.0, 0.0, 0.0, 1.0]) == Progress(ABORT, 2, 0, 0, 1)
    assert decide_layer([2.0, 0.0, 0.0, 0.0]).action == COMMIT_LAYER
    for state in (PLANNING, TRANSFERRING, COMMITTING):
        assert decide_progress([2.0, 0.0, 0.0, 1.0], 2, state, early=True).action == ABORT
    assert decide_progress([2.0, 0.0, 0.0, 0.0], 2, COMMITTING).action == COMMIT_LAYER
    with pytest.raises(ValueError, match="summed flags must be"):
        decide_layer([1.0, 0.0, 0.0])   # the old three flags, without broken


def test_a_plan_is_worth_moving_only_above_the_gain_threshold_unless_a_scale_forces_it():
    """Worth needs moves and gain > min_gain; a scale's plan is always worth it."""
    assert decide_plan(3, 0.05, 0.01)
    assert not decide_plan(3, 0.01, 0.01)
    assert not decide_plan(0, 0.5, 0.0)
    assert decide_plan(0, -1.0, 0.5, forced_scale=True)


def _salvage_sums(counts, losing=0):
    """What the salvage all-reduce sums over ranks with these committed counts: [sum c, losing, sum c^2, ranks]."""
    return [float(sum(counts)), float(losing), float(sum(c * c for c in counts)), float(len(counts))]


def test_salvage_is_safe_only_when_every_rank_committed_alike_and_none_loses_an_expert():
    """[committed sum, losing ranks, squares sum, ranks]: equal committed layers everywhere and no loss."""
    assert decide_salvage(_salvage_sums([3, 3]), 2)
    assert not decide_salvage(_salvage_sums([3, 2]), 2)
    assert not decide_salvage(_salvage_sums([3, 3], losing=1), 2)
    assert decide_salvage(_salvage_sums([0, 0, 0]), 3)


def test_salvage_refuses_counts_whose_mean_is_one_ranks_count():
    """Counts 1, 2, 3 average to 2: the sums alone decide, so no rank (the one with 2 included) says safe."""
    assert not decide_salvage(_salvage_sums([1, 2, 3]), 3)
    assert not decide_salvage(_salvage_sums([2, 2, 0, 4]), 4)


def test_counters_restart_the_interval():
    """restart() zeroes since and sets the new threshold; until_due never goes negative."""
    c = Counters(steps=40, since=12, threshold=10)
    assert c.until_due == 0
    c.restart(25)
    assert (c.since, c.threshold, c.until_due, c.steps) == (0, 25, 25, 40)


def test_steps_before_the_first_model_do_not_count_toward_the_interval():
    """count_step advances steps always but since only with a model: a late add_model is not due at once."""
    counters = Counters(steps=0, since=0, threshold=10)
    for _ in range(50):
        counters.count_step(has_models=False)
    assert counters.steps == 50 and counters.since == 0 and counters.until_due == 10
    assert not decide_step(COLLECTING, counters.since, counters.threshold, True, False).due
    for _ in range(9):
        counters.count_step(has_models=True)
    assert not decide_step(COLLECTING, counters.since, counters.threshold, True, False).due
    counters.count_step(has_models=True)
    assert counters.steps == 60 and decide_step(COLLECTING, counters.since, counters.threshold, True, False).due


def test_salvage_votes_summed_over_ranks_decide_alike_everywhere():
    """Summed salvage_vote: the ranks are counted, equal counts are safe, 1, 2, 3 layers or a lost expert are not."""
    from eplb_fsm.fsm.decide import agreed_ranks, counts_equal, salvage_vote

    def summed(votes):
        return [sum(column) for column in zip(*votes)]

    agreed = summed([salvage_vote(2, []), salvage_vote(2, []), salvage_vote(2, [])])
    assert agreed_ranks(agreed) == 3 and decide_salvage(agreed, 3)
    assert not decide_salvage(summed([salvage_vote(c, []) for c in (1, 2, 3)]), 3)
    assert not decide_salvage(summed([salvage_vote(2, []), salvage_vote(2, [(0, 1, 5)])]), 2)
    assert len(salvage_vote(1, False, count=False)) == 3
    assert counts_equal(6.0, 12.0, 3) and not counts_equal(6.0, 14.0, 3)
