"""Tests for eplb_fsm.inspect.collective_checks: the wording of the collective findings."""

from __future__ import annotations

from eplb_fsm.inspect.replay import diagnose
from eplb_fsm.testing import SyntheticJob, hang_faults


def test_one_waiting_rank_waits_several_wait():
    """The hang sentence agrees with its subject: 'rank 0 waits inside it', 'ranks 0,2 wait inside it'."""
    for world, who in ((2, "rank 0 waits inside it"), (3, "ranks 0,2 wait inside it")):
        job = SyntheticJob(world=world)
        job.run(12, hang_faults(world, culprit=1, step=9))
        report = diagnose(job.records())
        assert report.verdict == "hang" and report.summary.endswith(who), report.summary

