"""Tools that read the machine and the traces: diagrams, replay and hang diagnosis.

This module only re-exports; see ``diagrams`` (mermaid/DOT from the live machine),
``summary`` (one rank file re-driven through the machine: ``walker``, ``model``,
``records``, and ``bulk`` for stretches read without parsing them), ``replay``
(diagnosis across ranks: ``checks``, ``collective_checks``, ``findings``, ``liveness``
for ranks that died, froze, crashed or lagged (``signal_death``: a death the launcher
answered with SIGTERM; ``stalled``: a link that stopped passing packets or was reset
under live ranks), ``lost`` for findings that rest on lines a trace lost
(``lost_records``; ``torn`` for traces whose writing stopped mid-line), ``stepseq`` for a
session's own step numbers (they break ``step_count_mismatch`` ties), ``identity`` for run ids
and misnamed or duplicated files, and ``elastic`` for group swaps, joiners and leaving ranks)
and ``render`` (text report, timeline). The synthetic-trace writer it re-exports
(``SyntheticJob``, ``Faults``, ...) lives in :mod:`eplb_fsm.testing`; those names load on first use,
because that package imports torch and reading traces needs none (``eplb-fsm replay`` on a login node).
"""

from eplb_fsm.inspect.diagrams import machine_edges, render_dot, render_mermaid, stale_files
from eplb_fsm.inspect.render import format_report, format_timeline
from eplb_fsm.inspect.replay import (
    Finding,
    MachineOracle,
    MixedRuns,
    NoTraces,
    RankSummary,
    Report,
    diagnose,
    load_dir,
    read_records,
    replay_dir,
    summarize_rank,
    summarize_text,
)

_FROM_TESTING = ("Faults", "Stop", "SyntheticJob", "hang_faults", "write_traces")


def __getattr__(name: str):   # PEP 562: the testing names without importing torch for a replay
    if name in _FROM_TESTING:
        import eplb_fsm.testing

        return getattr(eplb_fsm.testing, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Faults",
    "Finding",
    "MachineOracle",
    "MixedRuns",
    "NoTraces",
    "RankSummary",
    "Report",
    "Stop",
    "SyntheticJob",
    "diagnose",
    "format_report",
    "format_timeline",
    "hang_faults",
    "load_dir",
    "machine_edges",
    "read_records",
    "render_dot",
    "render_mermaid",
    "replay_dir",
    "stale_files",
    "summarize_rank",
    "summarize_text",
    "write_traces",
]
