"""Fault checks for the synthetic job: a fault that could not fire is refused before a run writes anything."""

from __future__ import annotations

import pytest

from eplb_fsm.testing import Faults, Stop, SyntheticJob, hang_faults


def _counts(job: SyntheticJob) -> dict[int, int]:
    return {r: len(recs) for r, recs in job.records().items()}


@pytest.mark.parametrize("faults, match", [
    (Faults(stop={1: Stop(4, "in_collective")}), "does not rearrange at step 4"),
    (Faults(wrong_collective={0: (3, {"op": "broadcast"})}), "does not rearrange at step 3"),
    (Faults(illegal={1: 5}), "does not rearrange at step 5"),
    (Faults(transfer_error={1: (9, 5)}), "below num_layers=2"),
    (Faults(transfer_error={1: (29, 0)}), "moves nothing"),
    (Faults(stop={9: Stop(3)}), "rank 9 is not a serving rank"),
    (Faults(stop=[Stop(3)]), "must be a dict"),
    (Faults(stop={1: 5}), r"Stop\(step, where\)"),
    (Faults(skip_count={1: True}), "skip_count step"),
    (Faults(wrong_collective={0: [9, {}]}), r"\(step, overrides\)"),
    (Faults(wrong_collective={0: (9, {"rank": 1})}), r"must not name a field the trace stamps itself.*\['rank'\]"),
    ({"stop": {}}, "faults must be a Faults"),
])
def test_faults_that_could_not_fire_are_refused_before_any_step(faults, match):
    """Each malformed or unfireable fault is a ValueError naming the field; the job has not moved."""
    _assert_refused(SyntheticJob(world=2, interval=10), 30, faults, match)


def _assert_refused(job: SyntheticJob, steps: int, faults, match: str) -> None:
    before = _counts(job)
    with pytest.raises(ValueError, match=match):
        job.run(steps, faults)
    assert job.step_no == 0 and _counts(job) == before


def test_due_steps_follow_the_counter_across_runs_and_a_skipped_step():
    """A fault at the step a rank actually rearranges passes: after an earlier run, and one step late after a skip."""
    job = SyntheticJob(world=2, interval=5)
    job.run(7)
    job.run(10, Faults(wrong_collective={0: (9, {"op": "broadcast"})}))
    job.run(10, Faults(skip_count={1: 17}, stop={1: Stop(20, "in_collective")}))
    assert job.ranks[1].stopped and not job.ranks[0].stopped
    with pytest.raises(ValueError, match="does not rearrange at step 19"):
        SyntheticJob(world=2, interval=5).run(20, Faults(skip_count={1: 17}, stop={1: Stop(19, "in_collective")}))


def test_a_fault_outside_the_run_waits_for_its_run_and_a_stopped_rank_is_named():
    """The same Faults may span several runs; a fault on a rank that has stopped is refused."""
    job = SyntheticJob(world=2, interval=5)
    faults = Faults(stop={1: Stop(14, "in_collective")})
    job.run(5, faults)
    job.run(10, faults)
    assert job.ranks[1].stopped
    with pytest.raises(ValueError, match="rank 1 has stopped"):
        job.run(10, Faults(illegal={1: 19}))


def test_stop_and_hang_faults_check_their_arguments():
    """Stop needs an int step >= 0; hang_faults needs a culprit below the world."""
    with pytest.raises(ValueError, match="Stop.step"):
        Stop("19")
    with pytest.raises(ValueError, match="culprit must be a rank below world=4"):
        hang_faults(4, culprit=9, step=19)
    assert hang_faults(2, culprit=1, step=3).stop[0] == Stop(3, "in_collective")


@pytest.mark.parametrize("faults, match", [
    # the reviewer's case: rank 1 is gone from step 2, so nothing of it runs at 3 or 9
    (Faults(stop={1: Stop(2)}, wrong_collective={1: (9, {"op": "broadcast"})}, skip_count={1: 3}),
     r"Faults\.(wrong_collective|skip_count): rank 1 stops at step 2 \(before_step, Faults\.stop\) in this run"),
    (Faults(stop={1: Stop(9)}, skip_count={1: 9}), "its fault at step 9 could not fire"),  # before_step: not even this
    (Faults(stop={1: Stop(9, "before_collective")}, wrong_collective={1: (9, {"op": "broadcast"})}),
     r"Faults\.wrong_collective: rank 1 stops at step 9 \(before_collective"),
    (Faults(stop={1: Stop(9, "in_collective")}, illegal={1: 9}), r"Faults\.illegal: rank 1 stops at step 9"),
    (Faults(stop={0: Stop(4, "in_collective")}, transfer_error={0: (14, 1)}), r"Faults\.transfer_error: rank 0 stops"),
])
def test_a_fault_after_its_ranks_stop_in_the_same_run_is_refused(faults, match):
    """A fault on a rank at a step at or after that rank's stop (where the stop comes first) is a ValueError."""
    job = SyntheticJob(world=2, num_layers=2, num_experts=4, interval=5)
    before = _counts(job)
    with pytest.raises(ValueError, match=match):
        job.run(20, faults)
    assert job.step_no == 0 and _counts(job) == before


def test_a_fault_before_its_ranks_stop_point_still_fires():
    """The wrong collective a rank stops inside is issued; a fault before a later stop passes too."""
    job = SyntheticJob(world=2, num_layers=2, num_experts=4, interval=5)
    job.run(12, Faults(stop={1: Stop(9, "in_collective")}, wrong_collective={1: (9, {"op": "broadcast"})},
                       illegal={1: 4}))
    assert job.ranks[1].stopped
    assert any(r.get("op") == "broadcast" and r.get("step") == 9 for r in job.records()[1])


@pytest.mark.parametrize("faults, match", [
    # rank 2's layer-0 failure aborts step 9's rearrangement everywhere before rank 1's illegal commit after layer 0
    (Faults(illegal={1: 9}, transfer_error={2: (9, 0)}),
     r"Faults\.illegal and Faults\.transfer_error: rank 1's illegal commit at step 9 comes after layer 0"),
    # rank 1's layer-0 failure stops every rank's transfer, so rank 2 never reaches layer 1
    (Faults(transfer_error={1: (9, 0), 2: (9, 1)}),
     r"Faults\.transfer_error: at step 9 ranks fail different layers \(layer 0 on rank\(s\) \[1\]; layer 1 on "
     r"rank\(s\) \[2\]\)"),
    # the illegal commit ends rank 1's rearrangement after layer 0, before its own layer-1 failure
    (Faults(illegal={1: 9}, transfer_error={1: (9, 1)}),
     r"Faults\.illegal and Faults\.transfer_error: rank 1's illegal commit at step 9 ends its rearrangement"),
])
def test_a_fault_another_transfer_error_pre_empts_is_refused(faults, match):
    """A fault that a transfer_error (or an illegal commit) of the same rearrangement pre-empts is a ValueError."""
    _assert_refused(SyntheticJob(world=4, interval=10), 20, faults, match)


def test_faults_of_one_rearrangement_that_all_fire_are_accepted():
    """Two ranks failing the same layer, or an illegal commit before another rank's layer-1 failure: both fire."""
    job = SyntheticJob(world=4, interval=10)
    job.run(20, Faults(transfer_error={1: (9, 1), 2: (9, 1)}))
    waves = {r: [x["event"] for x in recs if x.get("op") == "batch_isend_irecv" and x.get("layer") == 1
                 and x["step"] == 9]
             for r, recs in job.records().items()}
    assert waves == {0: ["collective_start", "collective_error"], 1: [], 2: [], 3: ["collective_start",
                                                                                     "collective_error"]}
    job = SyntheticJob(world=4, interval=10)
    job.run(20, Faults(illegal={1: 9}, transfer_error={2: (9, 1)}))
    records = job.records()
    assert any(x.get("trigger") == "committed" and x["source"] == "transferring" for x in records[1])
    assert [x["step"] for x in records[0] if x.get("trigger") == "fault"] == [9]
