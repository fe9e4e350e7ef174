"""Stage 1 of the replay, record by record: one session of a rank file re-driven through the machine.

``Walker`` is fed a rank file's records in order (``summary.summarize_rank`` and
``summary.summarize_text`` drive it; the latter hands it whole runs of compact step lines at
once). Every ``transition`` is re-driven through the machine definition (``MachineOracle``),
a compact ``step`` record is the internal ``step`` transition of its state (a ``steps`` run
record is ``count`` of them, counted, never expanded), every other
record is checked against the replayed state; collectives are indexed by group and
sequence number. An illegal transition is recorded with its reason and the walk
resynchronises on what a transition record claims (a step record stamped with another
state, when the machine keeps the replayed one on that step, leaves the replay as it was),
so one bad record is reported once (a source that lines lost just before it explain is not
illegal: ``transition_replay``).

A later header starts a new session. A joiner's header (``role: joiner``, elastic EP) starts
one that belongs to the same job: the session before it is kept (a rank that left, whose
number the joiner took), and the joiner's machine starts where its header's ``machine``
says (``scaling``, scale pending). Any other header means a new job appended to the file:
the earlier runs are dropped with a warning.
"""

from __future__ import annotations

from typing import Any

from eplb_fsm.fsm.machine import TRANSFERRING
from eplb_fsm.inspect.model import WORLD_GROUP, Collective, CollectiveIndex, MachineOracle, RankSummary, compact_record
from eplb_fsm.inspect.records import (
    COLLECTIVE_EVENTS, LINE_HEAD, OWN_STATE, SILENCE_S, TYPED_KEYS, TYPES_OK, TYPE_NAMES, keep_record, keep_silence,
    last_step, parse_line, runs_note, start_from_header, wrong_fields,
)
from eplb_fsm.inspect.seqcheck import SeqCheck
from eplb_fsm.inspect.stepseq import StepSeq
from eplb_fsm.inspect.transition_replay import (
    lost_change, lost_since, replay_steps_run, replay_transition, settle_lost_changes,
)
from eplb_fsm.trace_segments import segment_line


class Walker:
    """The replay of one rank file, session by session, fed record by record (or by runs of validated step lines)."""

    def __init__(self, rank: int | None, oracle: MachineOracle, path: str | None = None,
                 bad_lines: int = 0, truncated: bool = False) -> None:
        self.rank_given = rank is not None
        self.s = RankSummary(rank=-1 if rank is None else int(rank), path=path, bad_lines=bad_lines,
                             truncated=truncated)
        self.oracle = oracle
        self.sessions = 1
        self.done: list[RankSummary] = []  # earlier sessions of the file that belong to the same job
        # the last record fed (or, after a bulk run of step lines, the run's last line, parsed on demand)
        self.last: dict | None = None
        self.last_line: str | None = None
        self.line: int | None = None       # the file line of the record being fed (the driver sets it)
        # (file name, lines before it) per segment of a rotated file (trace_segments.read_rank_segments): where names
        # the segment a line lies in; None: the lines are the file's own
        self.segments: list[tuple[str, int]] | None = None
        self._begin()

    def _begin(self) -> None:
        """Start (or restart, at a later controller's header) the replay of a session."""
        self.state: str | None = None
        self.layer = 0
        self.layer_known = True            # False: a continued header without `machine` began the history
        self.pending = False
        self.num_layers: int | None = None
        self.world = None
        self.n_steps = 0                   # step records (runs counted in bulk, or read one by one)
        self.run_steps = 0                 # steps that `steps` run records stand for
        self.records = 0
        self.first: dict | None = None     # first record that is not a header
        # a compact step record (due false) keeps the current (state, layer, pending): known good
        self.plain_ok = False
        self._step_ok: dict[tuple, bool] = {}
        self.mismatches = 0
        self._mismatch_example = None
        self.warned_layers = False
        # lost lines: seq must advance by one per record (a run of step lines: checked as a whole)
        self.seqs = SeqCheck()
        self.s.disorder, self.s.gaps = self.seqs.disorder, self.seqs.gaps
        self.trans_seq: int | None = None    # seq of the session's last transition record (lines lost after it)
        self.lost_changes: list[tuple] = []  # mismatches lost lines may explain (transition_replay.lost_change)
        self.step_seq = StepSeq(self.s.step_breaks)   # the session's own step numbers: where they skip or go back
        self.seen_at: tuple | None = None    # (ts, step, state) of the last record whose time was seen
        self.early_ends: dict[tuple, tuple[dict, bool]] = {}   # (group, cseq) -> (end read first, warn if unmet)
        self.step_before: int | None = None  # the last integer step before a record whose step is unusable

    def _new_session(self, header: dict) -> None:
        """A later header: another controller appended to this file.

        A joiner's header (``role: joiner``) continues the same job: the session before it is real (a rank
        that left, whose number the joiner took) and is kept as its own participant. Any other header starts
        a new job: what came before is stale and only the last run is replayed.
        """
        old = self.s
        self.sessions += 1
        if header.get("role") == "joiner":
            self.done.append(self.finish(self.last_record()))
            self.s = RankSummary(rank=old.rank, path=old.path, session=len(self.done))
        else:
            self.done = []
            self.s = RankSummary(rank=old.rank, path=old.path, bad_lines=old.bad_lines, truncated=old.truncated,
                                 warnings=old.warnings)
            self.s.warnings.append(runs_note(self.sessions, header, old.header))
        self._begin()

    # -- helpers ---------------------------------------------------------
    def illegal(self, rec: dict, reason: str, replayed: str | None) -> None:
        self.s.illegal.append({
            "rank": self.s.rank, "seq": rec.get("seq"), "step": rec.get("step"),
            "trigger": rec.get("trigger", rec.get("event")),
            "source": rec.get("source", rec.get("state")), "dest": rec.get("dest", rec.get("state")),
            "replayed_state": replayed, "layer": rec.get("layer", self.layer), "reason": reason,
        })

    def steps_keep_state(self, due: Any) -> bool:
        key = (self.state, self.layer, self.pending, due)
        ok = self._step_ok.get(key)
        if ok is None:
            out = self.oracle.outcome(self.state, self.layer, self.num_layers or 1 << 20, self.pending, "step",
                                      {"due": due})
            ok = isinstance(out, tuple) and out[0] == self.state and out[1] == self.layer
            self._step_ok[key] = ok
        return ok

    # -- elastic EP: is the session still writing, and what comes next -----
    def live(self) -> bool:
        """Whether the current session may still write (it has records and did not end on purpose)."""
        return bool(self.records) and not self.s.ended_on_purpose

    def next_seq(self) -> int | None:
        """The ``seq`` this session's next record will carry (None before any)."""
        return self.seqs.next_seq(self.n_steps)

    def last_record(self) -> dict | None:
        return self.last if self.last is not None else parse_line(self.last_line or "")

    # -- feeding ---------------------------------------------------------
    def plain_steps(self, count: int) -> bool:
        """``count`` compact step records (due false) stamped with the current state, already
        validated by the reader; False (nothing counted) when the replay can't take them as a run."""
        if self.state is None:
            return False
        if not self.plain_ok:
            if not self.steps_keep_state(False):
                return False
            self.plain_ok = True
        self.n_steps += count
        self.records += count
        return True

    def saw(self, ts, step, state) -> None:
        """A record written at ``ts``: a silence over ``SILENCE_S`` before it is kept (``keep_silence``; ``liveness``
        judges it), with the replayed layer (not yet moved by this record: the one in flight as it began; None out
        of transferring) unless the replay does not know it (layer unknown, or the record before stamped another)."""
        if type(ts) is not float and type(ts) is not int:
            return
        before = self.seen_at
        if before is not None and ts - before[0] > SILENCE_S:
            known = self.layer_known and self.state == before[2]
            layer = (self.layer if self.state == TRANSFERRING else None,) if known else ()
            keep_silence(self.s, (before[0], ts, before[1], before[2]) + layer)
        self.seen_at = (ts, step, state)

    def saw_line(self, line: str) -> None:
        """``saw`` for a line read in bulk (its ts, step and state found without parsing it)."""
        m = LINE_HEAD.match(line)
        if m is not None:
            self.saw(float(m.group(1)), int(m.group(3)), m.group(2))

    def saw_run(self, first_line: str, last_line: str) -> None:
        """``saw`` for a run of lines read in bulk with no silence inside (checked by the reader): its first
        line is compared with what came before, its last becomes the latest time seen."""
        self.saw_line(first_line)
        m = LINE_HEAD.match(last_line)
        if m is not None:
            self.seen_at = (float(m.group(1)), int(m.group(3)), m.group(2))

    def took_bulk(self, records: int, steps: int, last_seq: int, last_line: str) -> None:
        """Account a stretch read in bulk (``bulk.feed_units``): ``records`` lines, ``steps`` of them
        step records, the last carrying ``last_seq``."""
        self.n_steps += steps
        self.records += records
        self.seqs.skip_to(last_seq, self.n_steps)
        self.last, self.last_line = None, last_line

    def step_record(self, rec: dict, seen: tuple | None = None) -> None:
        """A compact step record (``seen``: the (ts, step, state) of the record before it)."""
        self.records += 1
        if self.first is None:
            self.first = rec
        st = rec.get("state")
        due = rec.get("due", False)
        # its seq first: lines lost just before it are then a known gap when its stamp is judged
        seq, seqs = rec.get("seq"), self.seqs
        if seqs.jump is None and seqs.prev is not None and seq == seqs.prev + 1 + self.n_steps - seqs.steps_at_prev:
            seqs.prev, seqs.steps_at_prev = seq, self.n_steps + 1   # in order: the common case, inline
        else:
            seqs.check(seq, self.n_steps, self._locate, "step", (seen, rec.get("step"), rec.get("ts")), True)
        stamped = None
        if self.state is None:
            self.state = st
        elif st != self.state:
            self.illegal(rec, f"step record stamped {st!r} but the replayed state is {self.state!r}", self.state)
            self.plain_ok = False
            # a step the machine keeps in the replayed state, with no lines lost since the last transition that
            # could hold a change: the stamp is wrong, not the replay, which goes on as it was (taking the stamp
            # would make the next, rightly stamped record illegal too)
            if lost_since(self) or not self.steps_keep_state(due):
                stamped, self.state = self.s.illegal[-1], st
        ok = self.steps_keep_state(due)
        if not ok:
            self.illegal(rec, f"a step record says the state stayed {self.state!r}, the machine does not keep it",
                          self.state)
        elif stamped is not None:   # right after lost lines, they held the state change(s)
            lost_change(self, rec, stamped)
        self.plain_ok = ok and not due
        step, before, ss = rec.get("step"), self.n_steps + self.run_steps, self.step_seq
        if type(step) is not int or step - before != ss.base or len(self.s.transitions) != ss.tlen:   # else: runs on
            ss.run(step, step, 1, before, self.s.transitions)
        self.n_steps += 1

    def _check_seq(self, rec: dict, ev: Any, seen: tuple | None = None) -> bool:
        """``seq`` must advance by one per record (``SeqCheck``); disorder and lost lines (with ``seen``, the
        time and step of the record before, and this one's) go to the summary."""
        return self.seqs.check(rec.get("seq"), self.n_steps, self._locate, ev, (seen, rec.get("step"), rec.get("ts")))

    def _locate(self) -> tuple[str, int | None]:
        return self.where(), self.line

    def where(self) -> str:
        name = self.s.path.rsplit("/", 1)[-1] if self.s.path else f"rank {self.s.rank}"
        if self.line is not None and self.segments:
            return "%s:%d" % segment_line(self.segments, self.line)
        return f"{name}:{self.line}" if self.line is not None else name

    def record(self, rec: dict) -> None:
        seen = tuple(map(type, map(rec.get, TYPED_KEYS)))
        wrong = () if seen in TYPES_OK else wrong_fields(rec, seen)
        if wrong:
            # a well-formed record with a field of the wrong type: warn with file and line, drop the field
            self.s.warnings.append(f"{self.where()}: " + ", ".join(
                f"field {k!r} is {type(rec[k]).__name__} {rec[k]!r}, expected {TYPE_NAMES[k]}" for k in wrong)
                + "; the field is ignored")
            rec = {k: v for k, v in rec.items() if k not in wrong}
        ts, step, ev = rec.get("ts"), rec.get("step"), rec.get("event")
        if (ev == "steps" or ev == "rearrangement") and type(step) is int:
            step = last_step(rec)   # a run's last step, a summary's end step: a silence after it starts there
        elif type(step) is not int:   # damaged or missing: if this is the last record, the one before says how far
            before = last_step(self.last_record())
            self.step_before = self.step_before if before is None else before
        seen = self.seen_at
        if seen is not None and type(ts) is float and ts - seen[0] <= SILENCE_S:
            self.seen_at = (ts, step, rec.get("state"))   # the common case, inline
        else:
            self.saw(ts, step, rec.get("state"))
        if ev == "step":
            self.last = rec
            self.step_record(rec, seen)
            return
        if ev == "end":
            # a process that ended in order is silent by design until the next session's header
            # (an elastic rank that left, then rejoined): that wait is no freeze
            self.seen_at = None
        if ev == "header" and (self.s.header is not None or self.records) and rec.get("continued") is not True:
            self._new_session(rec)   # (a `continued` header only repeats the header atop a rotated segment)
        self.last = rec
        self.records += 1
        self.plain_ok = False
        if self.first is None and ev != "header":
            self.first = rec
        seq, seqs = rec.get("seq"), self.seqs
        if seqs.jump is None and seqs.prev is not None and seq == seqs.prev + 1 + self.n_steps - seqs.steps_at_prev:
            seqs.prev, seqs.steps_at_prev = seq, self.n_steps   # in order: the common case, inline
        else:
            self._check_seq(rec, ev, seen)
        s = self.s
        s.events[ev] += 1
        if self.world is None and "world" in rec:
            self.world = rec.get("world")
        if ev == "transition":
            replay_transition(self, rec)
            return
        if ev == "steps":
            replay_steps_run(self, rec)
            return

        # every other record: its stamped state should be the replayed one
        st = rec.get("state")
        if self.state is None:
            self.state = st
        elif st is not None and st != self.state and ev not in OWN_STATE:
            self.mismatches += 1
            if self._mismatch_example is None:
                self._mismatch_example = (rec.get("seq"), ev, st, self.state)

        if ev in COLLECTIVE_EVENTS and type(rec.get("cseq")) is not int:
            s.warnings.append(f"{self.where()}: {ev} without an integer cseq; not matched across ranks")
        elif ev == "collective_start":
            group = str(rec.get("group", WORLD_GROUP))
            cseq = rec.get("cseq")
            entries = s.collectives.get(group)
            if entries is None:
                entries = s.collectives[group] = CollectiveIndex()
            if cseq in entries:   # a copied line: the first start stays (a finished collective is not reopened)
                s.warnings.append(f"collective {group}#{cseq} started twice (seq {rec.get('seq')})")
                return
            entry = entries[cseq] = Collective(rec.get("op"), group, cseq, rec.get("shape"), rec.get("dtype"),
                                               rec.get("step"), st, rec.get("layer"), rec.get("seq"), rec.get("wave"),
                                               rec.get("parts"), rec.get("ts"), posted=rec.get("posted") is True,
                                               peers=rec.get("peers"))
            if self.early_ends and (early := self.early_ends.pop((group, cseq), None)) is not None:
                self._close(entry, early[0])
        elif ev == "collective_end" or ev == "collective_error":
            group = str(rec.get("group", WORLD_GROUP))
            entries = s.collectives.get(group)
            entry = entries.get(rec.get("cseq")) if entries else None
            if entry is None:
                # its start may follow (two lines swapped: out of order by seq): it ends that collective then;
                # warned about at the end of the session if none came (not one started before the cut)
                self.early_ends[(group, rec.get("cseq"))] = (
                    rec, s.cut is None or bool(entries and rec.get("cseq") > entries.min_cseq()))
            else:
                self._close(entry, rec)
        elif ev == "header":
            if s.header is None:
                s.header = rec
                if rec.get("world") is not None:
                    self.world = rec.get("world")
                cfg = rec.get("config") if isinstance(rec.get("config"), dict) else {}
                nl = rec.get("num_layers", cfg.get("num_layers"))
                if self.num_layers is None and isinstance(nl, int):
                    self.num_layers = nl
                start_from_header(self, rec)
            elif rec.get("continued") is True and lost_since(self) and isinstance(rec.get("machine"), dict):
                # lines lost before a rotated segment's header: its `machine` says where the machine is now
                machine = rec["machine"]
                if isinstance(machine.get("state"), str):
                    self.state, self.pending = machine["state"], bool(machine.get("scale_pending", False))
                    self.layer = machine["layer"] if type(machine.get("layer")) is int else self.layer
            if not self.rank_given and s.rank < 0 and "rank" in rec:
                s.rank = int(rec["rank"])
        elif ev == "model_added" and isinstance(rec.get("num_layers"), int):
            self.num_layers = rec["num_layers"]
        else:
            keep_record(s, ev, rec, st)

    def _close(self, entry: Collective, rec: dict) -> None:
        """A collective_end or collective_error record ends the collective ``entry``."""
        if rec.get("event") == "collective_end":
            entry.status, entry.duration_s = "ended", rec.get("duration_s")
        else:
            entry.status, entry.error, entry.error_ts = "error", rec.get("error"), rec.get("ts")
        if rec.get("op") != entry.op:
            self.s.warnings.append(f"{entry.group}#{entry.cseq}: started as {entry.op!r}, ended as {rec.get('op')!r}")

    def result(self, last: dict | None) -> RankSummary:
        """The file's last session, with the earlier sessions of the same job in ``previous``."""
        summary = self.finish(last)
        summary.previous = self.done
        return summary

    def finish(self, last: dict | None) -> RankSummary:
        """The summary of the current session, given its last readable record."""
        s = self.s
        first = self.first
        if s.rank < 0 and last is not None and "rank" in last:
            s.rank = int(last["rank"])
        s.records = self.records
        s.step_records = self.n_steps + self.run_steps
        s.world = self.world
        s.num_layers = self.num_layers
        s.first_step = first.get("step") if first is not None else None
        if last is not None:
            s.last = compact_record(last)
            # a last record whose step is unusable (the field is ignored) has not undone the steps before it
            s.last_step = self.step_before if (step := last_step(last)) is None else step
        s.final_state = self.state
        s.final_layer = self.layer if self.state == TRANSFERRING else None
        s.warnings += [f"{rec.get('event')} for {g}#{c} without a start (seq {rec.get('seq')})"
                       for (g, c), (rec, warn) in self.early_ends.items() if warn]
        s.warnings += self.seqs.warnings()
        settle_lost_changes(self)   # after the seq check settled its last jump: the gaps are final
        if self.mismatches:
            seq, ev, st, rep = self._mismatch_example
            s.warnings.append(
                f"{self.mismatches} record(s) stamped with a state other than the replayed one "
                f"(first: seq {seq} {ev} says {st!r}, replay is in {rep!r})"
            )
        return s
