"""Which ``--inject`` faults fired: read back from the ``fault_injected`` records of a run's traces.

Every injection that fires writes ``fault_injected`` (``sim/inject.py``) before it acts, so
the record is on disk even for a rank that SIGKILLs itself right after. The launcher
reports the specs with no such record, and fails the run: an injection that never fired
tested nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from eplb_fsm.sim.inject import parse_spec

__all__ = ["fired_injections", "unfired_injections"]


def fired_injections(log_dir: str) -> list[dict]:
    """Every ``fault_injected`` record in the traces (``*.jsonl``) of ``log_dir`` (unreadable lines skipped)."""
    out = []
    for path in sorted(Path(log_dir).glob("*.jsonl")):
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if '"fault_injected"' not in line:
                    continue
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if rec.get("event") == "fault_injected":
                    out.append(rec)
    return out


def unfired_injections(specs: Iterable[str], log_dir: str) -> list[str]:
    """The specs of ``specs`` that no trace of ``log_dir`` reports as fired."""
    fired = {rec.get("spec") for rec in fired_injections(log_dir)}
    return [parse_spec(s).spec for s in specs if parse_spec(s).spec not in fired]
