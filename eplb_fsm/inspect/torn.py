"""Traces that stop because writing them stopped: every rank's file ends in a half-written line, no ``end``.

A writer whose writes start failing for good (a full disk, a file-size limit: ``ulimit -f``, where Python
ignores SIGXFSZ and the write fails) leaves its last line cut where the bytes ran out, and writes nothing
after it: no ``alive``, no ``end``, while the rank itself may serve on and exit 0. When every rank's trace
stops like that (every participant that did not leave on purpose: no ``end`` record, a truncated last line),
the point where each one stops tells where its writer gave up, not what its rank did next. A collective
"still open" on every rank, a rank that "never joined" one the others started, or a trace that "stops"
before the others' are then read from that cut, and :func:`qualify_torn` tells them as ``lost_records``
(the lines after the cut are lost): the finding as read, then ``but every rank's trace stops in a
half-written last line with no end record ...``, with a first detail ``read as it stands: hang, culprit
...``. The culprits are the ranks whose traces stop (their files). A ``hang`` that a waiter's own ``alive``
record shows it waiting in (``waiting_on``) is a wait the trace wrote down, and stands.

A SIGKILL can cut a line too, but it rarely cuts every rank's at once: a job killed as a whole leaves whole
lines (and reads as before: ``healthy`` with the note that no rank wrote its end, or a ``hang`` with every
rank inside). One complete last line among the ranks' files keeps every finding as it is read.

Whatever the verdict, a warning says that the traces stop so and why that may be. With nothing read from the
cut the verdict stays ``healthy`` (the ranks agree as far as their traces go), with that warning.
"""

from __future__ import annotations

from eplb_fsm.inspect.elastic import Cast, Key
from eplb_fsm.inspect.findings import Finding
from eplb_fsm.inspect.lost import LOST_RECORDS

__all__ = ["TORN_KINDS", "qualify_torn", "torn_parts"]

TORN_KINDS = ("hang", "rank_died")   # the findings an absence after the cut could have made


def torn_parts(cast: Cast) -> list[Key]:
    """The participants when every one that did not leave on purpose ends in a truncated line with no ``end``
    record (their writers stopped: see the module docstring); else []."""
    keys = sorted(k for k, s in cast.parts.items() if not s.ended_on_purpose)
    if not keys or any(cast.parts[k].end is not None or not cast.parts[k].truncated for k in keys):
        return []
    return keys


def _shown_waiting(cast: Cast, f: Finding) -> bool:
    """A member's last ``alive`` record names ``f``'s collective in ``waiting_on``: a wait the trace wrote."""
    coll = f.collective or {}
    want = (coll.get("group"), coll.get("cseq"))
    for s in cast.parts.values():
        waiting = s.alive[-1][3] if s.alive else None
        if isinstance(waiting, dict) and (waiting.get("group"), waiting.get("cseq")) == want:
            return True
    return False


def _text(cast: Cast, keys: list[Key]) -> str:
    steps = [cast.parts[k].last_step for k in keys if type(cast.parts[k].last_step) is int]
    span = "" if not steps else f", last steps {min(steps)}..{max(steps)}"
    return (f"every rank's trace stops in a half-written last line with no end record ({cast.who(keys)}{span}): "
            "their writers stopped there (a full disk? a file-size limit?) or the job was killed as a whole")


def qualify_torn(cast: Cast, findings: list[Finding], warnings: list[str]) -> list[Finding]:
    """``findings`` with those read from where torn traces stop told as ``lost_records`` (kept after the
    findings that stand, in their order), and the warning added; unchanged when the traces did not stop so."""
    keys = torn_parts(cast)
    if not keys:
        return findings
    text = _text(cast, keys)
    warnings.append(f"{text}; nothing after that is in the traces (the ranks' own logs say whether writes "
                    "failed, e.g. 'No space left on device' or 'File too large')")
    for f in findings:
        if f.kind not in TORN_KINDS or (f.kind == "hang" and _shown_waiting(cast, f)):
            continue
        f.details.insert(0, f"read as it stands: {f.kind}, culprit {cast.who(f.keys())}")
        f.kind = LOST_RECORDS
        f.summary += f"; but {text}, so this may be where the traces stop, not what the ranks did"
        f.culprits, f.sessions = sorted({k[0] for k in keys}), [list(k) for k in keys]
    return [f for f in findings if f.kind != LOST_RECORDS] + [f for f in findings if f.kind == LOST_RECORDS]
