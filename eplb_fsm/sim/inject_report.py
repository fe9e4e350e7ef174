"""Which ``--inject`` faults fired: read back from the ``fault_injected`` records of a run's traces.

Every injection that fires writes ``fault_injected`` (``sim/inject.py``) before it acts, so
the record is on disk even for a rank that SIGKILLs itself right after. The launcher
reports the specs with no such record, and fails the run: an injection that never fired
tested nothing.

A trace folder may hold earlier runs too (each rank appends a session to its file): only
the records of this run's sessions count, those whose header carries its ``run_id``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from eplb_fsm.sim.inject import parse_spec

__all__ = ["fired_injections", "unfired_injections"]


def fired_injections(log_dir: str, run_id: str | None = None) -> list[dict]:
    """The ``fault_injected`` records in the traces (``*.jsonl``) of ``log_dir`` (unreadable lines skipped).

    ``run_id``: only the records of the sessions whose header carries it. Default: the run
    ``log_dir`` names when it knows its own (a ``TraceDir`` of ``eplb-fsm simulate``; none
    at all when that run wrote no header), else every record in the folder.
    """
    if run_id is None and getattr(log_dir, "start", None) is not None:  # a TraceDir: this run's records only
        run_id = log_dir.run_id  # type: ignore[attr-defined]
        if run_id is None:
            return []
    out = []
    for path in sorted(Path(log_dir).glob("*.jsonl")):
        session = None  # the run id of the session the line is in (None: before any header)
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                header = run_id is not None and '"header"' in line
                if not header and '"fault_injected"' not in line:
                    continue
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if not isinstance(rec, dict):
                    continue
                if header and rec.get("event") == "header":
                    session = rec.get("run_id")
                elif rec.get("event") == "fault_injected" and (run_id is None or session == run_id):
                    out.append(rec)
    return out


def unfired_injections(specs: Iterable[str], log_dir: str, run_id: str | None = None) -> list[str]:
    """The specs of ``specs`` that no trace of ``log_dir`` (of run ``run_id``, see :func:`fired_injections`)
    reports as fired."""
    fired = {rec.get("spec") for rec in fired_injections(log_dir, run_id)}
    return [parse_spec(s).spec for s in specs if parse_spec(s).spec not in fired]
