"""What the replay works with: the machine as an oracle, and one trace session's summary.

``MachineOracle`` answers what the machine does with an event in a context. ``RankSummary``
is what stage 1 (``eplb_fsm.inspect.summary``) keeps from one session of a rank file:
the state-changing transitions, the collectives per group and sequence number, illegal
transitions, watchdog and fault records, and for elastic EP the session's role, its
``group_switch`` records and scale outcomes. ``Collective`` and ``Transition`` are its entries.
"""

from __future__ import annotations

import bisect
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from eplb_fsm.fsm.machine import TRANSFERRING, EplbMachine, IllegalTransition

# ops whose tensor shape legitimately differs per rank (point-to-point traffic)
PER_RANK_SHAPE = re.compile(r"send|recv|p2p|all_?to_?all", re.I)
# a group every rank of the world is a member of (others are named by the headers)
WORLD_GROUP = "world"
# transitions that belong to a scale: their records carry the generation
SCALE_TRIGGERS = frozenset({"scale_requested", "groups_ready", "switched", "salvaged", "resumed"})

_PER_RANK_OPS: dict[Any, bool] = {}


# ---------------------------------------------------------------------------------------
# the machine, as an oracle


class MachineOracle:
    """What the machine does with an event in a context: (dest, layer, scale_pending) or an error.

    Answers come from firing a fresh ``EplbMachine`` set to the context, memoised by
    (state, layer, num_layers, scale_pending, trigger, data): the guards and counter
    updates depend on nothing else, so the memo is exact and a long trace costs a dict
    lookup per record.
    """

    def __init__(self) -> None:
        self._memo: dict[tuple, tuple | str] = {}
        self.fired = 0

    def outcome(self, state: str, layer: int, num_layers: int, pending: bool, trigger: str,
                data: dict) -> tuple[str, int, bool] | str:
        try:
            # the type is part of the key: 1 == True == 1.0 hash alike, but fire() takes only one of them
            typed = tuple(sorted((k, type(v).__name__, v) for k, v in data.items()))
            key = (state, layer, num_layers, pending, trigger, typed)
            hit = self._memo.get(key)
        except TypeError:  # unhashable event data: fire without the memo
            key, hit = None, None
        if hit is not None:
            return hit
        self.fired += 1
        try:
            m = EplbMachine(num_layers, state=state, layer=layer, scale_pending=pending)
            m.fire(trigger, **data)
            out: tuple | str = (m.state, m.layer, m.scale_pending)
        except IllegalTransition as exc:
            out = str(exc)
        except ValueError as exc:  # unknown event, unexpected data, bad state
            out = str(exc)
        except TypeError as exc:  # a datum of the wrong type (``moves: null``, ``layer: [0]``) fails a guard's int()
            out = f"event data of the wrong type ({exc})"
        if key is not None:
            self._memo[key] = out
        return out


# stage 1: one rank ----------------------------------------------------------------------
@dataclass
class Collective:
    """One rank's view of one collective: the start record and how it ended."""

    op: str | None
    group: str
    cseq: int
    shape: Any
    dtype: Any
    step: int | None
    state: str | None
    layer: Any
    seq: int | None
    wave: Any = None
    parts: Any = None             # what an all-reduce carries (``parts``: e.g. loads, balancedness)
    ts: Any = None                # when this rank started it
    status: str = "open"          # open | ended | error
    duration_s: float | None = None
    error: str | None = None
    error_ts: Any = None          # when this rank's wait in it failed (its ``collective_error`` record)
    posted: bool = False          # issued without waiting (async ready flags), read back at a later step
    peers: Any = None             # a point-to-point batch's partners (group ranks), from its start record

    def signature(self) -> tuple:
        """What must agree across ranks: op, shape (not for point-to-point ops), layer, wave, parts."""
        op, layer, wave = self.op, self.layer, self.wave
        # a list or object where a name or number belongs (a damaged record) still compares, by value
        if type(op) is not str and op is not None:
            op = freeze(op)
        if type(layer) is list or type(layer) is dict:
            layer = freeze(layer)
        if type(wave) is list or type(wave) is dict:
            wave = freeze(wave)
        per_rank = _PER_RANK_OPS.get(op)
        if per_rank is None:
            per_rank = _PER_RANK_OPS[op] = bool(op and PER_RANK_SHAPE.search(str(op)))
        shape = self.shape
        if per_rank:
            shape = None
        elif type(shape) is list:
            shape = tuple(shape) if all(type(d) is int for d in shape) else freeze(shape)
        elif shape is not None:
            shape = freeze(shape)
        parts = self.parts
        if type(parts) is list:
            parts = tuple(parts) if all(type(p) is str for p in parts) else freeze(parts)
        elif parts is not None:
            parts = freeze(parts)
        return (op, shape, layer, wave, parts)

    def describe(self) -> dict:
        return {"op": self.op, "group": self.group, "cseq": self.cseq, "shape": self.shape, "dtype": self.dtype}


class CollRun:
    """Collectives ``first..last`` of one group that all ended and share one signature (read in bulk).

    A long trace that all-reduces every step (``log_balancedness`` at interval 1) holds one
    such run per stretch between two other records; keeping it as one object instead of a
    ``Collective`` per cseq is what keeps the replay of 2M records in seconds. ``template``
    is the collective at ``first - 1`` (read record by record); cseq ``c`` of the run is it
    ``c - template.cseq`` steps later.
    """

    __slots__ = ("first", "last", "template", "steps_per")

    def __init__(self, first: int, last: int, template: Collective, steps_per: int) -> None:
        self.first, self.last, self.template, self.steps_per = first, last, template, steps_per

    def at(self, c: int) -> Collective:
        t = self.template
        step = t.step + (c - t.cseq) * self.steps_per if type(t.step) is int else t.step
        return Collective(t.op, t.group, c, t.shape, t.dtype, step, t.state, t.layer, None, t.wave, t.parts, None,
                          "ended", t.duration_s, peers=t.peers)


class CollectiveIndex:
    """cseq -> ``Collective`` for one group: entries read one by one, plus ``CollRun``s read in bulk.

    Behaves as a read-only mapping (``get``, ``in``, ``[c]``, iteration in cseq order, ``len``);
    ``max_cseq`` and ``run_at`` answer without visiting every cseq.
    """

    __slots__ = ("one", "runs")

    def __init__(self) -> None:
        self.one: dict[int, Collective] = {}
        self.runs: list[CollRun] = []          # in cseq order, disjoint from ``one``

    def run_at(self, c: int) -> CollRun | None:
        runs = self.runs
        if not runs:
            return None
        i = bisect.bisect_right(runs, c, key=lambda r: r.first) - 1
        return runs[i] if i >= 0 and runs[i].last >= c else None

    def get(self, c: Any, default: Any = None) -> Any:
        e = self.one.get(c)
        if e is not None:
            return e
        run = self.run_at(c) if type(c) is int else None
        return run.at(c) if run is not None else default

    def __getitem__(self, c: int) -> Collective:
        e = self.get(c)
        if e is None:
            raise KeyError(c)
        return e

    def __setitem__(self, c: int, e: Collective) -> None:
        self.one[c] = e

    def __contains__(self, c: Any) -> bool:
        return c in self.one or (type(c) is int and self.run_at(c) is not None)

    def __iter__(self):
        keys = list(self.one)
        for r in self.runs:
            keys.extend(range(r.first, r.last + 1))
        return iter(sorted(keys))

    def __len__(self) -> int:
        return len(self.one) + sum(r.last - r.first + 1 for r in self.runs)

    def __bool__(self) -> bool:
        return bool(self.one) or bool(self.runs)

    def keys(self):
        return list(self)

    def items(self):
        return [(c, self[c]) for c in self]

    def values(self):
        return [self[c] for c in self]

    def max_cseq(self) -> int:
        return max(max(self.one, default=-1), self.runs[-1].last if self.runs else -1)

    def min_cseq(self) -> float:
        return min(min(self.one, default=math.inf), self.runs[0].first if self.runs else math.inf)


@dataclass(frozen=True)
class Transition:
    """A state-changing transition of one rank (internal steps are only counted)."""

    step: int | None
    trigger: str
    source: str
    dest: str
    layer: Any
    seq: int | None
    generation: int | None = None     # a transition of a scale (SCALE_TRIGGERS): the scale's

    @property
    def layer_k(self) -> Any:
        """The layer when it means something (a transition into, out of or within transferring)."""
        return self.layer if TRANSFERRING in (self.source, self.dest) else None

    def key(self) -> tuple:
        key = (self.trigger, self.source, self.dest, self.layer_k, self.generation)
        try:
            hash(key)
        except TypeError:  # a list as source, dest, layer or generation (a damaged record) compares by value
            return tuple(freeze(v) for v in key)
        return key

    def text(self) -> str:
        lay = f" layer {self.layer}" if self.layer_k is not None else ""
        gen = f" (generation {self.generation})" if self.generation is not None else ""
        return f"{self.trigger}: {self.source} -> {self.dest}{lay}{gen}"


@dataclass
class RankSummary:
    """Everything the cross-rank stage needs from one session of a rank file (usually the whole file)."""

    rank: int
    path: str | None = None
    records: int = 0
    bad_lines: int = 0
    truncated: bool = False
    header: dict | None = None
    world: int | None = None
    num_layers: int | None = None
    first_step: int | None = None
    last_step: int | None = None
    last: dict | None = None                  # compact copy of the last record
    final_state: str | None = None
    final_layer: int | None = None
    step_records: int = 0
    transitions: list[Transition] = field(default_factory=list)
    collectives: dict[str, CollectiveIndex] = field(default_factory=dict)
    illegal: list[dict] = field(default_factory=list)
    events: Counter = field(default_factory=Counter)
    stuck: list[dict] = field(default_factory=list)
    faults: list[dict] = field(default_factory=list)
    progress_after_stuck: bool = True
    warnings: list[str] = field(default_factory=list)
    # groups that records name as re-created for every rank (``transfer_group_reset``)
    named_groups: set[str] = field(default_factory=set)
    # elastic EP: which session of the file this is (0 first), how it started and ended
    session: int = 0
    role: str = "member"                      # member (a first rank) or joiner (header role)
    generation: int = 0                       # the group generation the session started in
    switches: list[dict] = field(default_factory=list)    # its group_switch records
    left: dict | None = None                  # the group_switch that ended it on purpose (role leaving)
    scalings: list[dict] = field(default_factory=list)    # its `scaling` summaries
    scale_aborts: list[dict] = field(default_factory=list)  # its `scale_aborted` records
    scale_requests: list[dict] = field(default_factory=list)  # its scale_requested transitions (who leaves)
    # issue 12: how the session ended (its ``end`` record), its liveness records, the injector's notes
    end: dict | None = None                   # compact `end`: how, error, signal, ts, step, state, seq
    alive: list[tuple] = field(default_factory=list)   # (ts, step, state, waiting_on, engine_wait, main_wait)
    alive_interval: float | None = None       # the `interval_s` its alive records announce
    write_errors: int = 0                     # the largest `write_errors` its alive/end records carry
    injected: list[dict] = field(default_factory=list)  # `fault_injected` records (simulator only)
    silences: list[tuple] = field(default_factory=list)   # (from ts, to ts, step, state[, layer]): see Walker.saw
    # input problems found while reading, each with the file line: seq going backwards, wrong field types
    disorder: list[dict] = field(default_factory=list)
    # stretches of lines lost by seq (``seqcheck.SeqCheck.gaps``): the seqs lost, the step and ts either side
    gaps: list[dict] = field(default_factory=list)
    # where the session's own engine-step numbers skip or go back (``stepseq.StepSeq``)
    step_breaks: list[dict] = field(default_factory=list)
    # earlier sessions of the same rank number in the same job (a rank that left, then a joiner that took
    # its number: in its own file, or in older traces the same one); filled on the rank's last session only
    previous: list["RankSummary"] = field(default_factory=list)
    # the history starts at a `continued` header (oldest segments deleted): {"step": its step, "next_cseq": its
    # {group: next cseq}, None from writers that did not say}; the ranks are compared from the latest such step
    cut: dict | None = None

    def kept_from(self, group: str) -> float:
        """The first cseq of ``group`` the kept history can hold: 0 for a whole history; after a cut the
        header's next one (or the first kept, if lower: a start written after the roll), inf if unknown."""
        if self.cut is None:
            return 0
        entries = self.collectives.get(group)
        first = (entries.min_cseq() if isinstance(entries, CollectiveIndex) else min(entries)) if entries \
            else math.inf
        nxt = self.cut.get("next_cseq")
        if isinstance(nxt, dict):
            given = nxt.get(group, 0)
            return min(given, first) if type(given) is int else first
        return first

    def open_collectives(self) -> list[Collective]:
        # runs read in bulk only hold ended collectives
        return [c for g in self.collectives.values() for c in getattr(g, "one", g).values() if c.status == "open"]

    def max_cseq(self, group: str) -> int:
        entries = self.collectives.get(group)
        if isinstance(entries, CollectiveIndex):
            return entries.max_cseq()
        return max(entries) if entries else -1

    def rearrangements(self) -> int:
        return sum(1 for t in self.transitions if t.trigger == "plan_ready" and t.dest == TRANSFERRING)

    def to_dict(self) -> dict:
        return {
            "rank": self.rank, "path": self.path,
            "records": self.records,
            "bad_lines": self.bad_lines,
            "truncated": self.truncated,
            "world": self.world,
            "first_step": self.first_step,
            "last_step": self.last_step,
            "final_state": self.final_state,
            "final_layer": self.final_layer,
            "step_records": self.step_records,
            "transitions": len(self.transitions),
            "rearrangements": self.rearrangements(),
            "collectives": sum(len(g) for g in self.collectives.values()),
            "open_collectives": [c.describe() for c in self.open_collectives()],
            "illegal_transitions": len(self.illegal),
            "stuck_reports": len(self.stuck),
            "faults": len(self.faults),
            "last": self.last,
            "session": self.session,
            "role": self.role,
            "generation": self.generation,
            "left_step": None if self.left is None else self.left.get("step"),
            "end": self.end,
            "alive_records": len(self.alive),
            "last_ts": self.last_ts,
            "write_errors": self.write_errors,
            "run_id": (self.header or {}).get("run_id"),
        }

    @property
    def last_ts(self) -> float | None:
        """When the session wrote its last readable record (its ``ts``)."""
        ts = (self.last or {}).get("ts")
        return ts if type(ts) in (int, float) else None

    @property
    def ended_on_purpose(self) -> bool:
        """The session stopped writing by design: it left the group (or was leaving when the old
        group broke: its last ``scaling`` says role leaving, outcome failed), or it was a joiner
        whose scale aborted (``join`` raises)."""
        if self.left is not None:
            return True
        last = self.scalings[-1] if self.scalings else {}
        if last.get("role") == "leaving":
            return last.get("outcome") in ("left", "failed")
        return self.role == "joiner" and last.get("outcome") == "aborted"


_LAST_KEYS = ("seq", "step", "state", "event", "trigger", "source", "dest", "layer", "op", "group", "cseq", "ts")


def compact_record(rec: dict) -> dict:
    """The identifying fields of a record (seq, step, state, event, ...), for findings and ``last``."""
    return {k: rec[k] for k in _LAST_KEYS if k in rec}


def freeze(value: Any) -> Any:
    """A JSON value made hashable (lists and objects as tuples), to compare or count it."""
    if isinstance(value, list):
        return tuple(freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, freeze(v)) for k, v in value.items()))
    return value

