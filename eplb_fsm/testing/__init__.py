"""Test support shipped with the package: synthetic traces and an in-process multi-rank harness.

- :mod:`.ranks`, :mod:`.job`, :mod:`.elastic`: :class:`SyntheticJob` drives W ranks through
  the real machine and the real trace writer (:mod:`eplb_fsm.trace`, the one owner of the
  record schema), with faults per rank and elastic scale-down / scale-up; tests, the docs
  and ``eplb-fsm bench replay`` use its traces. The reader side is :mod:`eplb_fsm.inspect`.
- :mod:`.threads`: G ranks played by threads of one process (a barrier all-reduce and
  queue point-to-point messages), the group object the controller accepts for tests.
"""

from eplb_fsm.testing.elastic import scale
from eplb_fsm.testing.job import Faults, Stop, SyntheticJob, hang_faults, write_traces
from eplb_fsm.testing.ranks import SyntheticClock, SyntheticRank
from eplb_fsm.testing.threads import ThreadCommunicator, ThreadGroup, ThreadWorld, run_threads

__all__ = [
    "Faults",
    "Stop",
    "SyntheticClock",
    "SyntheticJob",
    "SyntheticRank",
    "ThreadCommunicator",
    "ThreadGroup",
    "ThreadWorld",
    "hang_faults",
    "run_threads",
    "scale",
    "write_traces",
]
