"""Stage 1 of the replay: one rank's trace, re-driven through the machine and indexed.

``summarize_rank(records)`` walks one rank's records once. Every ``transition`` record is
re-driven through the machine definition (``MachineOracle``: a real ``EplbMachine`` per
distinct (state, layer, counters, event) context, memoised, since guards read only event
data and shared counters); a compact ``step`` record is the internal ``step`` transition
of its ``state`` and goes through the same oracle; every other record is checked against
the replayed state. An illegal transition is recorded with its reason and the walk
resynchronises on what the record claims, so one bad record is reported once.

The result, ``RankSummary``, keeps only what the cross-rank stage (``replay.diagnose``)
needs: the state-changing transitions, the collectives per group and sequence number,
the first and last records, illegal transitions, watchdog and fault records.

``summarize_text(text)`` is the same walk over a JSONL file's text, with the runs of
compact step lines (most of a long trace) checked in bulk.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from eplb_fsm.fsm.machine import COMMITTING, EVENT_DATA, TRANSFERRING, EplbMachine, IllegalTransition

# ops whose tensor shape legitimately differs per rank (point-to-point traffic)
PER_RANK_SHAPE = re.compile(r"send|recv|p2p|all_?to_?all", re.I)
# a group every rank of the world is a member of (others are named by the headers)
WORLD_GROUP = "world"

_TRACE_NAME = re.compile(r"^rank(\d+)\.jsonl$")
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
            key = (state, layer, num_layers, pending, trigger, tuple(sorted(data.items())))
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
        if key is not None:
            self._memo[key] = out
        return out


# ---------------------------------------------------------------------------------------
# stage 1: one rank


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
    status: str = "open"          # open | ended | error
    duration_s: float | None = None
    error: str | None = None

    def signature(self) -> tuple:
        """What must agree across ranks: op, shape (not for point-to-point ops), layer, wave."""
        per_rank = _PER_RANK_OPS.get(self.op)
        if per_rank is None:
            per_rank = _PER_RANK_OPS[self.op] = bool(self.op and PER_RANK_SHAPE.search(str(self.op)))
        shape = self.shape
        if per_rank:
            shape = None
        elif type(shape) is list:
            shape = tuple(shape) if all(type(d) is int for d in shape) else _freeze(shape)
        elif shape is not None:
            shape = _freeze(shape)
        return (self.op, shape, self.layer, self.wave)

    def describe(self) -> dict:
        return {"op": self.op, "group": self.group, "cseq": self.cseq, "shape": self.shape, "dtype": self.dtype}


@dataclass(frozen=True)
class Transition:
    """A state-changing transition of one rank (internal steps are only counted)."""

    step: int | None
    trigger: str
    source: str
    dest: str
    layer: Any
    seq: int | None

    @property
    def layer_k(self) -> Any:
        """The layer when it means something (a transition into, out of or within transferring)."""
        return self.layer if TRANSFERRING in (self.source, self.dest) else None

    def key(self) -> tuple:
        return (self.trigger, self.source, self.dest, self.layer_k)

    def text(self) -> str:
        lay = f" layer {self.layer}" if self.layer_k is not None else ""
        return f"{self.trigger}: {self.source} -> {self.dest}{lay}"


@dataclass
class RankSummary:
    """Everything the cross-rank stage needs from one rank's trace."""

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
    collectives: dict[str, dict[int, Collective]] = field(default_factory=dict)
    illegal: list[dict] = field(default_factory=list)
    events: Counter = field(default_factory=Counter)
    stuck: list[dict] = field(default_factory=list)
    faults: list[dict] = field(default_factory=list)
    progress_after_stuck: bool = True
    warnings: list[str] = field(default_factory=list)
    # groups that records name as re-created for every rank (``transfer_group_reset``)
    named_groups: set[str] = field(default_factory=set)

    def open_collectives(self) -> list[Collective]:
        return [c for g in self.collectives.values() for c in g.values() if c.status == "open"]

    def max_cseq(self, group: str) -> int:
        entries = self.collectives.get(group)
        return max(entries) if entries else -1

    def rearrangements(self) -> int:
        return sum(1 for t in self.transitions if t.trigger == "plan_ready" and t.dest == TRANSFERRING)

    def to_dict(self) -> dict:
        return {
            "rank": self.rank,
            "path": self.path,
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
        }


_LAST_KEYS = ("seq", "step", "state", "event", "trigger", "source", "dest", "layer", "op", "group", "cseq", "ts")


def _compact(rec: dict) -> dict:
    return {k: rec[k] for k in _LAST_KEYS if k in rec}


def _freeze(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    return value


class _Walker:
    """The replay of one rank, fed record by record (or by runs of validated step lines)."""

    def __init__(self, rank: int | None, oracle: MachineOracle, path: str | None = None,
                 bad_lines: int = 0, truncated: bool = False) -> None:
        self.rank_given = rank is not None
        self.s = RankSummary(rank=-1 if rank is None else int(rank), path=path, bad_lines=bad_lines,
                             truncated=truncated)
        self.oracle = oracle
        self.sessions = 1
        self._begin()

    def _begin(self) -> None:
        """Start (or restart, at a later controller's header) the replay of a session."""
        self.state: str | None = None
        self.layer = 0
        self.pending = False
        self.num_layers: int | None = None
        self.world = None
        self.n_steps = 0
        self.records = 0
        self.first: dict | None = None     # first record that is not a header
        # a compact step record (due false) keeps the current (state, layer, pending): known good
        self.plain_ok = False
        self._step_ok: dict[tuple, bool] = {}
        self._mismatch = 0
        self._mismatch_example = None
        self._warned_layers = False
        # lost lines: seq must advance by one per record (checked at every non-step record)
        self._prev_seq: int | None = None
        self._steps_at_prev = 0
        self._lost = 0
        self._lost_between: tuple[int, int] | None = None

    def _new_session(self, header: dict) -> None:
        """A second header: another controller appended to this file. Replay the last one."""
        old = self.s
        self.sessions += 1
        self.s = RankSummary(rank=old.rank, path=old.path, bad_lines=old.bad_lines, truncated=old.truncated,
                             warnings=old.warnings)
        self.s.warnings.append(
            f"the file holds {self.sessions} runs (a header at seq {header.get('seq')}, step "
            f"{header.get('step')}); replaying the last one"
        )
        self._begin()

    # -- helpers ---------------------------------------------------------
    def _illegal(self, rec: dict, reason: str, replayed: str | None) -> None:
        self.s.illegal.append({
            "rank": self.s.rank, "seq": rec.get("seq"), "step": rec.get("step"),
            "trigger": rec.get("trigger", rec.get("event")),
            "source": rec.get("source", rec.get("state")), "dest": rec.get("dest", rec.get("state")),
            "replayed_state": replayed, "layer": rec.get("layer", self.layer), "reason": reason,
        })

    def _steps_keep_state(self, due: Any) -> bool:
        key = (self.state, self.layer, self.pending, due)
        ok = self._step_ok.get(key)
        if ok is None:
            out = self.oracle.outcome(self.state, self.layer, self.num_layers or 1 << 20, self.pending, "step",
                                      {"due": due})
            ok = isinstance(out, tuple) and out[0] == self.state and out[1] == self.layer
            self._step_ok[key] = ok
        return ok

    # -- feeding ---------------------------------------------------------
    def plain_steps(self, count: int) -> bool:
        """``count`` compact step records (due false) stamped with the current state, already
        validated by the reader; False (nothing counted) when the replay can't take them as a run."""
        if self.state is None:
            return False
        if not self.plain_ok:
            if not self._steps_keep_state(False):
                return False
            self.plain_ok = True
        self.n_steps += count
        self.records += count
        return True

    def step_record(self, rec: dict) -> None:
        self.records += 1
        if self.first is None:
            self.first = rec
        st = rec.get("state")
        due = rec.get("due", False)
        if self.state is None:
            self.state = st
        elif st != self.state:
            self._illegal(rec, f"step record stamped {st!r} but the replayed state is {self.state!r}", self.state)
            self.state = st
            self.plain_ok = False
        ok = self._steps_keep_state(due)
        if not ok:
            self._illegal(rec, f"a step record says the state stayed {self.state!r}, the machine does not keep it",
                          self.state)
        self.plain_ok = ok and not due
        self.n_steps += 1

    def record(self, rec: dict) -> None:
        ev = rec.get("event")
        if ev == "step":
            self.step_record(rec)
            return
        if ev == "header" and self.s.header is not None:
            self._new_session(rec)
        self.records += 1
        self.plain_ok = False
        if self.first is None and ev != "header":
            self.first = rec
        seq = rec.get("seq")
        if type(seq) is int:
            if self._prev_seq is not None:
                expected = self._prev_seq + 1 + self.n_steps - self._steps_at_prev
                if seq > expected:
                    self._lost += seq - expected
                    if self._lost_between is None:
                        self._lost_between = (self._prev_seq, seq)
            self._prev_seq = seq
            self._steps_at_prev = self.n_steps
        s = self.s
        s.events[ev] += 1
        if self.world is None and "world" in rec:
            self.world = rec.get("world")
        if ev == "transition":
            self._transition(rec)
            return

        # every other record: its stamped state should be the replayed one
        st = rec.get("state")
        if self.state is None:
            self.state = st
        elif st is not None and st != self.state and ev != "header" and ev != "stuck":
            self._mismatch += 1
            if self._mismatch_example is None:
                self._mismatch_example = (rec.get("seq"), ev, st, self.state)

        if ev == "collective_start":
            group = str(rec.get("group", WORLD_GROUP))
            cseq = rec.get("cseq")
            entries = s.collectives.setdefault(group, {})
            if cseq in entries:
                s.warnings.append(f"collective {group}#{cseq} started twice (seq {rec.get('seq')})")
            entries[cseq] = Collective(rec.get("op"), group, cseq, rec.get("shape"), rec.get("dtype"),
                                       rec.get("step"), st, rec.get("layer"), rec.get("seq"), rec.get("wave"))
        elif ev == "collective_end" or ev == "collective_error":
            group = str(rec.get("group", WORLD_GROUP))
            entry = s.collectives.get(group, {}).get(rec.get("cseq"))
            if entry is None:
                s.warnings.append(f"{ev} for {group}#{rec.get('cseq')} without a start (seq {rec.get('seq')})")
            else:
                if ev == "collective_end":
                    entry.status = "ended"
                    entry.duration_s = rec.get("duration_s")
                else:
                    entry.status = "error"
                    entry.error = rec.get("error")
                if rec.get("op") != entry.op:
                    s.warnings.append(f"{group}#{entry.cseq}: started as {entry.op!r}, ended as {rec.get('op')!r}")
        elif ev == "header":
            if s.header is None:
                s.header = rec
                if rec.get("world") is not None:
                    self.world = rec.get("world")
                cfg = rec.get("config") if isinstance(rec.get("config"), dict) else {}
                nl = rec.get("num_layers", cfg.get("num_layers"))
                if self.num_layers is None and isinstance(nl, int):
                    self.num_layers = nl
            if not self.rank_given and s.rank < 0 and "rank" in rec:
                s.rank = int(rec["rank"])
        elif ev == "transfer_group_reset" and rec.get("group") is not None:
            s.named_groups.add(str(rec["group"]))
        elif ev == "model_added" and isinstance(rec.get("num_layers"), int):
            self.num_layers = rec["num_layers"]
        elif ev == "stuck":
            s.stuck.append(_compact(rec) | {k: rec.get(k) for k in ("seconds", "last_collective") if k in rec})
            s.progress_after_stuck = False
        elif ev == "fault":
            s.faults.append(_compact(rec) | {k: rec.get(k) for k in ("error", "reason") if k in rec})

    def _transition(self, rec: dict) -> None:
        s = self.s
        trig = rec.get("trigger")
        src = rec.get("source")
        dst = rec.get("dest")
        rec_layer = rec.get("layer")
        if rec.get("num_layers") is not None:
            self.num_layers = int(rec["num_layers"])
        allowed = EVENT_DATA.get(trig)
        data_src = rec.get("data") if isinstance(rec.get("data"), dict) else rec
        data = {} if allowed is None else {k: data_src[k] for k in allowed if k in data_src}
        if self.state is None:  # the trace starts here: trust the first source
            self.state = src
            if src == TRANSFERRING and isinstance(rec_layer, int):
                self.layer = rec_layer
        reasons = []
        replayed = self.state
        if src != self.state:
            reasons.append(f"recorded source {src!r} but the replayed state is {self.state!r}")
            self.state = src
        nl = self.num_layers
        if nl is None:
            if trig == "layer_done" and dst == COMMITTING and isinstance(data.get("layer"), int):
                nl = data["layer"] + 1
            else:
                nl = 1 << 20
            if not self._warned_layers:
                s.warnings.append("transition records carry no num_layers; layer guards are checked loosely")
                self._warned_layers = True
        if allowed is None:
            out: tuple | str = f"unknown event {trig!r}"
        else:
            out = self.oracle.outcome(self.state, self.layer, nl, self.pending, trig, data)
        layer_after = rec.get("layer_after")
        if isinstance(out, str):
            reasons.append(f"the machine refuses it: {out}")
        elif out[0] != dst:
            reasons.append(f"the machine goes to {out[0]!r}, the trace says {dst!r}")
        elif isinstance(layer_after, int) and out[1] != layer_after and dst == TRANSFERRING:
            reasons.append(f"the machine is at layer {out[1]} after it, the trace says {layer_after}")
        if reasons:
            self._illegal(rec, "; ".join(reasons), replayed)
            # resynchronise on what the trace claims
            self.state = dst
            if dst == TRANSFERRING:
                if isinstance(layer_after, int):
                    self.layer = layer_after
                elif trig == "layer_done" and isinstance(data.get("layer"), int):
                    self.layer = data["layer"] + 1
                elif isinstance(rec_layer, int):
                    self.layer = rec_layer
                else:
                    self.layer = 0
            if trig == "scale_requested":
                self.pending = True
            elif trig == "switched":
                self.pending = False
        else:
            self.state, self.layer, self.pending = out
        if not (trig == "step" and src == dst):
            s.transitions.append(Transition(rec.get("step"), trig, src, dst, rec_layer, rec.get("seq")))
            if trig == "fault":
                s.faults.append(_compact(rec))
            s.progress_after_stuck = True

    def finish(self, last: dict | None) -> RankSummary:
        """The summary, given the rank's last readable record."""
        s = self.s
        first = self.first
        if s.rank < 0 and last is not None and "rank" in last:
            s.rank = int(last["rank"])
        s.records = self.records
        s.step_records = self.n_steps
        s.world = self.world
        s.num_layers = self.num_layers
        s.first_step = first.get("step") if first is not None else None
        if last is not None:
            s.last = _compact(last)
            s.last_step = last.get("step")
        s.final_state = self.state
        s.final_layer = self.layer if self.state == TRANSFERRING else None
        if self._lost:
            a, b = self._lost_between
            s.warnings.append(f"{self._lost} record(s) missing by seq (lost lines), the first between seq {a} "
                              f"and seq {b}")
        if self._mismatch:
            seq, ev, st, rep = self._mismatch_example
            s.warnings.append(
                f"{self._mismatch} record(s) stamped with a state other than the replayed one "
                f"(first: seq {seq} {ev} says {st!r}, replay is in {rep!r})"
            )
        return s


def summarize_rank(
    records: Iterable[dict],
    rank: int | None = None,
    *,
    path: str | None = None,
    bad_lines: int = 0,
    truncated: bool = False,
    oracle: MachineOracle | None = None,
) -> RankSummary:
    """Walk one rank's records once: re-drive its transitions, index its collectives.

    ``rank`` defaults to the ``rank`` of the header (or last record). Illegal transitions
    are collected (with the reason) and the replay continues from the state the record
    claims, so one bad record is reported once rather than poisoning the rest.
    """
    w = _Walker(rank, oracle or MachineOracle(), path, bad_lines, truncated)
    last = None
    for rec in records:
        last = rec
        # hot path: the compact record of a step that kept the state
        if w.plain_ok and rec.get("event") == "step" and rec.get("state") == w.state and not rec.get("due"):
            w.n_steps += 1
            w.records += 1
            continue
        w.record(rec)
    return w.finish(last)


# A compact step record exactly as EventTrace writes it (keys in emit order, nothing but
# an optional dummy flag after seq). A run of such lines in the replayed state is checked
# by one regex match in C instead of a json.loads per line; anything else is parsed.
_NUM = r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?"
_STEP_LINE = (r'\{"ts":' + _NUM + r',"rank":-?\d+,"world":\d+,"event":"step","state":"%s","step":-?\d+,'
              r'"seq":\d+(?:,"dummy":(?:true|false))?\}[ \t\r]*\n')
_STEP_RUNS: dict[str, re.Pattern] = {}


def _step_run(state: str) -> re.Pattern:
    pattern = _STEP_RUNS.get(state)
    if pattern is None:
        pattern = _STEP_RUNS[state] = re.compile("(?:" + _STEP_LINE % re.escape(state) + ")*")
    return pattern


def summarize_text(text: str, rank: int | None = None, *, path: str | None = None,
                   oracle: MachineOracle | None = None) -> RankSummary:
    """``summarize_rank`` over a JSONL file's text, with runs of compact step lines checked in bulk.

    Gives the same summary as parsing every line and calling ``summarize_rank``
    (unreadable lines are skipped and counted, an unreadable last line marks the file
    truncated), faster: the other lines are parsed by one ``json.loads``, and each run of
    step lines between two of them is matched, in C, against the exact form of a compact
    step record stamped with the replayed state. A run that does not match (another
    state, a ``due`` flag, extra fields, a blank or broken line) is parsed and replayed
    line by line.
    """
    lines = text.split("\n")
    other = [i for i, line in enumerate(lines) if '"event":"step"' not in line and line.strip()]
    try:
        parsed: list = json.loads("[" + ",".join([lines[i] for i in other]) + "]") if other else []
        if not all(type(r) is dict for r in parsed):
            raise ValueError("a line is not a JSON object")
    except ValueError:
        parsed = [_parse_line(lines[i]) for i in other]
    w = _Walker(rank, oracle or MachineOracle(), path)
    bad = 0
    prev = -1
    for i, rec in zip(other, parsed):
        if i > prev + 1:
            bad += _feed_run(w, lines, prev + 1, i)
        if rec is None:
            bad += 1
        else:
            w.record(rec)
        prev = i
    if prev + 1 < len(lines):
        bad += _feed_run(w, lines, prev + 1, len(lines))
    last, last_bad = _ends(text)
    summary = w.finish(last)
    summary.bad_lines = bad
    summary.truncated = last_bad
    return summary


def _parse_line(line: str) -> dict | None:
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    return rec if type(rec) is dict else None


def _feed_run(w: _Walker, lines: list[str], start: int, end: int) -> int:
    """Replay lines[start:end] (step lines between two other records); returns unreadable lines."""
    while end > start and not lines[end - 1].strip():
        end -= 1  # the empty string after the file's final newline, trailing blank lines
    if end <= start:
        return 0
    if w.state is not None:
        run = "\n".join(lines[start:end]) + "\n"
        if _step_run(w.state).fullmatch(run) is not None and w.plain_steps(end - start):
            if w.first is None:
                w.first = _parse_line(lines[start])
            return 0
    bad = 0
    for line in lines[start:end]:
        if line.strip():
            rec = _parse_line(line)
            if rec is None:
                bad += 1
            else:
                w.record(rec)
    return bad


def _ends(text: str) -> tuple[dict | None, bool]:
    """(last readable record, whether the last non-blank line is unreadable)."""
    last, last_bad, seen = None, False, False
    end = len(text)
    while end > 0 and last is None:
        begin = text.rfind("\n", 0, end - 1) + 1
        line = text[begin:end].strip()
        end = begin
        if not line:
            continue
        rec = _parse_line(line)
        if rec is None:
            last_bad = last_bad or not seen
        else:
            last = rec
        seen = True
    return last, last_bad


# ---------------------------------------------------------------------------------------
# reading files


def find_trace_files(logdir: str | os.PathLike) -> dict[int, Path]:
    """rank -> path for every ``rank<N>.jsonl`` in ``logdir``."""
    found = {}
    for path in Path(logdir).iterdir():
        m = _TRACE_NAME.match(path.name)
        if m and path.is_file():
            found[int(m.group(1))] = path
    return dict(sorted(found.items()))


def read_records(path: str | os.PathLike) -> tuple[list[dict], int, bool]:
    """(records, unreadable lines, whether the last line was the unreadable one).

    The whole file is parsed as one JSON array when it is clean (twice as fast as a
    ``json.loads`` per line); a file with a bad line is read line by line.
    """
    with open(path, encoding="utf-8", errors="replace") as fh:
        text = fh.read()
    body = text.strip()
    if not body:
        return [], 0, False
    try:
        records = json.loads("[" + body.replace("\n", ",") + "]")
        if all(type(r) is dict for r in records):
            return records, 0, False
    except ValueError:
        pass
    records, bad, last_bad = [], 0, False
    for line in body.split("\n"):
        line = line.strip()
        if not line:
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        if type(rec) is dict:
            records.append(rec)
            last_bad = False
        else:
            bad += 1
            last_bad = True
    return records, bad, last_bad and bad > 0
