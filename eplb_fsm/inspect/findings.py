"""The replay's answer and how it is worded: verdict kinds, ``Finding``, ``Report``, text helpers.

``replay.diagnose`` builds the ``Report``; the checks (``checks``) produce ``Finding``s. A
finding names its culprits two ways: ``culprits``, the rank numbers of their trace files
(what ``eplb-fsm replay DIR --rank N`` shows), and ``sessions``, ``[rank, session]`` pairs
that tell apart the two processes an elastic job may write into one file (docs/elastic.md).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from eplb_fsm.inspect.model import Collective, RankSummary

# verdicts: "healthy" or the kind of the first finding
HEALTHY = "healthy"
KINDS = (
    "illegal_transition",     # a rank's trace has a transition the machine refuses
    "config_mismatch",        # headers (schema, world, config) differ across ranks
    "decision_divergence",    # the n-th state change is a different event/destination on some rank
    "step_divergence",        # the same state change happened at different steps
    "collective_mismatch",    # different op/shape at the same (group, cseq), or a rank skipped one
    "hang",                   # a collective started and never ended on some ranks
    "rank_died",              # a rank's trace stops while the others went on (liveness: no end, silent)
    "frozen",                 # a rank wrote no alive record for a long time while the others did
    "crashed",                # a rank ended with an exception that was not a failed wait (or, with no other
                              # cause found, the first rank whose exception ended one)
    "left_early",             # a rank closed in order while a peer still ran, which then failed waiting for it
    "signalled",              # ranks were stopped by a signal before anything else went wrong
    "lagging",                # alive ranks stalled, some at a lower step: the others wait for them
    "network",                # live ranks' collective stopped delivering, or their connection was reset
    "step_count_mismatch",    # every rank closed in order but their final steps differ
    "failed",                 # a rank ended in the failed state
    "stuck",                  # the watchdog reported no progress and nothing came after
    # the input itself
    "world_mismatch",         # --world differs from the world the traces were written with (explains missing ranks)
    "missing_ranks",          # a rank of the world has no trace file
    "duplicate_rank_file",    # two files claim one rank
    "swapped_rank_file",      # a file's name says one rank, its records another
    "out_of_order",           # records out of order by seq
    "lost_records",           # a hang or mismatch read from a trace whose lost lines (seq gap) held its evidence
)
# liveness causes: ordered by when they happened, ahead of everything they lead to
PRIMARY_KINDS = ("rank_died", "frozen", "crashed", "left_early", "signalled", "lagging", "network")
INPUT_KINDS = ("world_mismatch", "duplicate_rank_file", "swapped_rank_file", "out_of_order", "lost_records")
# at the same step the more causal kind is the verdict: a decision taken differently (or at
# another step) comes before the collectives it leads to, and those before the hang
_PRIORITY = {k: i for i, k in enumerate(KINDS)}
# how many findings a report keeps (the first ones matter; the rest are counted)
MAX_FINDINGS = 50
#: how a hang words a posted collective (async ready flags) that every other member finished: its rank never
#: came back to read it, so it waited in nothing (``replay`` keeps a death its own cause beside such a hang)
UNREAD = "and never read it back (no later step() call of its engine read it)"


class NoTraces(ValueError):
    """The input cannot be replayed at all (no directory, no trace files, nothing readable)."""


@dataclass
class Finding:
    """One problem: what, where, who, and what every rank was doing there."""

    kind: str
    step: int | None
    culprits: list[int]
    summary: str
    state: str | None = None
    layer: Any = None
    collective: dict | None = None
    ranks: list[dict] = field(default_factory=list)   # per-rank position at this point
    details: list[str] = field(default_factory=list)
    sessions: list[list[int]] = field(default_factory=list)  # the culprits as [rank, session]
    members: list = field(default_factory=list)       # who takes part in it (not serialised)

    @classmethod
    def of(cls, kind: str, step: int | None, keys: Iterable[tuple], summary: str, **kw: Any) -> "Finding":
        """A finding whose culprits are participants ``(rank, session)``."""
        keys = sorted(set(keys))
        return cls(kind, step, sorted({k[0] for k in keys}), summary, sessions=[list(k) for k in keys], **kw)

    def keys(self) -> list[tuple]:
        return [tuple(k) for k in self.sessions] or [(r, 0) for r in self.culprits]

    def sort_key(self) -> tuple:
        tier = 0 if self.kind == "config_mismatch" else 2 if self.kind in ("missing_ranks",) + INPUT_KINDS else 1
        step = self.step if isinstance(self.step, (int, float)) else math.inf
        return (tier, step, _PRIORITY.get(self.kind, len(KINDS)), self.culprits[:1])

    def to_dict(self) -> dict:
        out = asdict(self)
        del out["members"]
        return out


@dataclass
class Report:
    """The replay's answer: a verdict (``healthy`` or the first finding's kind) and the detail."""

    verdict: str
    summary: str
    culprit_ranks: list[int]
    step: int | None
    state: str | None
    layer: Any
    collective: dict | None
    at_divergence: list[dict]
    findings: list[Finding]
    illegal_transitions: list[dict]
    ranks: list[dict]
    warnings: list[str]
    world: int | None
    missing_ranks: list[int]
    more_findings: int = 0
    handled: list[Finding] = field(default_factory=list)
    scales: list[dict] = field(default_factory=list)     # elastic EP: one entry per scale request
    consequences: list[str] = field(default_factory=list)  # what followed from the cause (never culprits)
    aborted: list[dict] = field(default_factory=list)    # every aborted rearrangement, with who was late
    injected: list[dict] = field(default_factory=list)   # the simulator's fault_injected records (not used)
    run_id: str | None = None

    @property
    def verdict_detail(self) -> dict:
        """The structured verdict: kind, culprit ranks, step, state, reason, consequences."""
        return {"kind": self.verdict, "culprits": self.culprit_ranks, "step": self.step, "state": self.state,
                "reason": self.summary, "consequences": self.consequences}

    @property
    def healthy(self) -> bool:
        return self.verdict == HEALTHY

    @property
    def unended_ranks(self) -> list[int]:
        """Ranks with a session whose trace has no ``end`` record (running when read, or killed, or frozen)."""
        return sorted({r["rank"] for r in self.ranks if not r.get("end")})

    @property
    def exit_code(self) -> int:
        return 0 if self.healthy else 1

    def to_dict(self) -> dict:
        return {
            "verdict": self.verdict,
            "summary": self.summary,
            "culprit_ranks": self.culprit_ranks,
            "step": self.step,
            "state": self.state,
            "layer": self.layer,
            "collective": self.collective,
            "at_divergence": self.at_divergence,
            "findings": [f.to_dict() for f in self.findings],
            "more_findings": self.more_findings,
            "handled": [f.to_dict() for f in self.handled],
            "illegal_transitions": self.illegal_transitions,
            "ranks": self.ranks,
            "warnings": self.warnings,
            "world": self.world,
            "missing_ranks": self.missing_ranks,
            "unended_ranks": self.unended_ranks,
            "scales": self.scales,
            "verdict_detail": self.verdict_detail,
            "consequences": self.consequences,
            "aborted_rearrangements": self.aborted,
            "injected": self.injected,
            "run_id": self.run_id,
        }


def ranks_text(ranks: Iterable[int]) -> str:
    """0,1,2,3,7 -> '0-3,7'."""
    ranks = sorted(set(ranks))
    if not ranks:
        return "-"
    parts = []
    start = prev = ranks[0]
    for r in ranks[1:] + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ",".join(parts)


def coll_text(c: dict | Collective) -> str:
    d = c.describe() if isinstance(c, Collective) else c
    shape = f", shape {d['shape']}" if d.get("shape") is not None else ""
    layer = f", layer {c.layer}" if isinstance(c, Collective) and c.layer is not None else ""
    return f"{d['op']} (group {d['group']}, cseq {d['cseq']}{shape}{layer})"


def last_seen(s: RankSummary) -> str:
    last = s.last or {}
    what = last.get("event", "?")
    if what == "transition":
        what = f"{last.get('trigger')} {last.get('source')}->{last.get('dest')}"
    elif str(what).startswith("collective"):
        what = f"{what} {last.get('op')} {last.get('group')}#{last.get('cseq')}"
    at = f"step {last.get('step')}"
    if what == "steps" and type(s.last_step) is int and s.last_step != last.get("step"):
        at = f"steps {last.get('step')}-{s.last_step}"   # a run: where the rank had got to when it was written
    elif what == "rearrangement" and type(s.last_step) is int and s.last_step != last.get("step"):
        at, what = f"step {s.last_step}", f"rearrangement due at step {last.get('step')}"   # written as it ended
    text = f"last record at {at} in {last.get('state')} ({what})"
    if s.stuck and not s.progress_after_stuck:
        st = s.stuck[-1]
        text += f"; watchdog: stuck {st.get('seconds')} s in {st.get('state')}"
    if s.truncated:
        text += "; last line truncated"
    return text


def majority(groups: dict[Any, list]) -> Any:
    """The key held by most participants (ties: the one that includes the lowest)."""
    return max(groups, key=lambda k: (len(groups[k]), _neg(min(groups[k]))))


def _neg(key: Any) -> Any:
    return tuple(-x for x in key) if isinstance(key, tuple) else -key


def canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def short_error(text: Any) -> str:
    """An error message without a C++ source location, cut after its first sentence."""
    text = re.sub(r"\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", str(text or "")).strip()
    first = text.split(". ")[0]
    return first if len(first) <= 120 else first[:117] + "..."
