"""What the replay keeps of each kind of record, and the field types it relies on.

``last_step`` says at which step a record stands; ``keep_record`` files the records that
do not move the replayed machine (elastic-EP records, watchdog reports, liveness and
endings, faults) into the session's ``RankSummary``; ``wrong_fields`` tells a record whose
fields have the wrong type (a warning with file and line, never a traceback);
``start_from_header`` sets where a joiner's machine starts. ``walker.Walker`` uses them.
``trace_items`` checks what ``replay.diagnose`` is given before it does any work.
"""

from __future__ import annotations

import json
import numbers
import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from eplb_fsm.engine_wait import COLLECTIVES
from eplb_fsm.inspect.model import RankSummary, compact_record

if TYPE_CHECKING:
    from eplb_fsm.inspect.walker import Walker

# silences longer than this between two records of a rank are kept (liveness judges them)
SILENCE_S = 2.0
# once a rank's alive records announce its interval, only silences over this many intervals are kept: a live
# rank is silent up to 1.5 intervals (eplb_fsm.liveness), a freeze is judged past 2.5 (inspect.liveness)
SILENCE_INTERVALS = 2.0
MAX_SILENCES = 100        # kept per session: the longest (a long run's normal gaps must not crowd out a freeze)
# ts, state and step of a line as the trace writer lays it out (read without parsing the line)
LINE_HEAD = re.compile(r'\{"ts":(-?[0-9.eE+-]+),"rank":-?\d+,"world":\d+,"event":"[^"]*","state":"([^"]*)",'
                       r'"step":(-?\d+),')

# what a summary keeps of the elastic-EP records (docs/events.md, "Elastic EP")
_SWITCH_KEYS = ("step", "seq", "generation", "phase", "role", "kind", "old_group", "new_group", "transfer_group",
                "old_rank", "new_rank", "old_world", "new_world")
_SCALING_KEYS = ("step", "generation", "kind", "from_ranks", "to_ranks", "requested_ranks", "role", "outcome",
                 "reason", "degraded", "lost_experts", "partial", "phase", "layers_committed")
_ABORT_KEYS = ("step", "generation", "phase", "reason", "lost_experts")
COLLECTIVE_EVENTS = frozenset({"collective_start", "collective_end", "collective_error"})
_END_KEYS = ("how", "error", "signal", "sender", "ts", "step", "state", "seq")
_INJECTED_KEYS = ("kind", "target_rank", "at_step", "ts", "step", "state", "seconds")
# records stamped with their own view of the state: a header, a watchdog report, the liveness
# thread (which can read the state while a transition is being written)
OWN_STATE = frozenset({"header", "stuck", "alive", "end", "fault_injected"})
# the types the replay relies on; a record with another type in one of these is warned about (a transition's
# dest becomes the replayed state, which keys the step-run and block templates; a source of another type is
# reported as it is, by the illegal transition it makes)
_NUM = (int, float)
_FIELD_TYPES = (("ts", _NUM), ("rank", (int,)), ("world", (int,)), ("event", (str,)), ("state", (str,)),
                ("step", (int,)), ("seq", (int,)), ("cseq", (int,)), ("group", (str,)), ("trigger", (str,)),
                ("num_layers", (int,)), ("interval_s", _NUM), ("how", (str,)), ("count", (int,)),
                ("dest", (str,)))
TYPED_KEYS = tuple(k for k, _ in _FIELD_TYPES)
TYPES_OK: set[tuple] = set()   # combinations of field types already found fine (most records share a few)


def wrong_fields(rec: dict, seen: tuple) -> list[str]:
    wrong = [k for (k, types), t in zip(_FIELD_TYPES, seen) if t is not type(None) and t not in types]
    if not wrong:
        TYPES_OK.add(seen)
    return wrong


TYPE_NAMES = {k: " or ".join("a number" if t is float else "an integer" if t is int else "a string"
                              for t in types if not (t is int and float in types))
               for k, types in _FIELD_TYPES}
REQUEST_KEYS = ("step", "rank", "generation", "kind", "from_ranks", "to_ranks", "leaving", "joiners", "salvage",
                "rank_mapping")


def last_step(rec: dict | None) -> int | None:
    """The step ``rec`` stands at; None without an integer step. A ``steps`` run: its last step. A
    ``rearrangement`` summary: its ``end_step`` (its ``step`` is the due step, long past in async mode)."""
    if rec is None:
        return None
    step, ev = rec.get("step"), rec.get("event")
    if ev == "steps" and type(step) is int and type(count := rec.get("count")) is int:
        return step + max(0, count - 1)
    if ev == "rearrangement" and type(end := rec.get("end_step")) is int:
        return end
    return step if type(step) is int else None


def start_from_header(w: "Walker", header: dict) -> None:
    """A joiner's header says where its machine starts (``machine``: scaling, scale pending)."""
    if header.get("role") == "joiner":
        w.s.role = "joiner"
        gen = header.get("generation")
        w.s.generation = gen if type(gen) is int else 0
    machine = header.get("machine")
    if header.get("continued") is True:
        # the session's history starts atop a rotated segment (the older ones deleted): the stamped state is where
        # the machine is; the layer in flight and the scale flag come from `machine` (older writers: from the
        # first transition, ``Walker.layer_known``), and the ranks are compared from here on only
        step = header.get("step")
        nxt = header.get("next_cseq")
        w.s.cut = {"step": step if type(step) is int else None, "next_cseq": nxt if isinstance(nxt, dict) else None}
        w.layer_known = isinstance(machine, dict) and type(machine.get("layer")) is int
    if isinstance(machine, dict) and isinstance(machine.get("state"), str):
        w.state = machine["state"]
        w.pending = bool(machine.get("scale_pending", False))
        if type(machine.get("layer")) is int:
            w.layer = machine["layer"]


def keep_silence(s: RankSummary, silence: tuple) -> None:
    """Keep ``(from ts, to ts, step, state[, layer])`` if it is a long one: past ``MAX_SILENCES`` the shortest goes."""
    if s.alive_interval is not None and silence[1] - silence[0] <= SILENCE_INTERVALS * s.alive_interval:
        return
    if len(s.silences) < MAX_SILENCES:
        s.silences.append(silence)
        return
    shortest = min(range(len(s.silences)), key=lambda i: s.silences[i][1] - s.silences[i][0])
    if silence[1] - silence[0] > s.silences[shortest][1] - s.silences[shortest][0]:
        del s.silences[shortest]
        s.silences.append(silence)


def keep_record(s: RankSummary, ev: str, rec: dict, st: str | None) -> None:
    """Keep what the cross-rank stage needs of a record that does not move the replayed machine."""
    if ev == "group_switch":
        switch = {k: rec.get(k) for k in _SWITCH_KEYS}
        s.switches.append(switch)
        if rec.get("role") == "leaving" or (rec.get("new_rank") == -1 and rec.get("new_group") is None):
            s.left = switch
    elif ev == "scaling":
        s.scalings.append({k: rec.get(k) for k in _SCALING_KEYS})
    elif ev == "scale_aborted":
        s.scale_aborts.append({k: rec.get(k) for k in _ABORT_KEYS})
    elif ev == "transfer_group_reset" and rec.get("group") is not None:
        s.named_groups.add(str(rec["group"]))
    elif ev == "stuck":
        s.stuck.append(compact_record(rec) | {k: rec.get(k) for k in ("seconds", "last_collective") if k in rec})
        s.progress_after_stuck = False
    elif ev == "alive":
        _count_write_errors(s, rec)
        waiting = rec.get("waiting_on")
        # only a wait on a group's members (not a set-up, whatever the writer), and whether on the controller's
        engine, on = rec.get("engine_wait"), rec.get("engine_wait_group")
        call, main = rec.get("engine_wait_call"), rec.get("engine_wait_main")   # absent in older traces: None
        # the main thread's own wait, when engine_wait names another (a rooted one, another group's)
        mine, mine_call, mine_on = rec.get("main_wait"), rec.get("main_wait_call"), rec.get("main_wait_group")
        peer = rec.get("main_wait_peer") if type(rec.get("main_wait_peer")) is int else None   # a send's, a recv's
        s.alive.append((rec.get("ts"), rec.get("step"), st, waiting if isinstance(waiting, dict) else None,
                        (engine, on == "same", call if type(call) is str else None,
                         main if type(main) is bool else None) if type(engine) is str and engine in COLLECTIVES
                        else None,
                        (mine, mine_call if type(mine_call) is str else None, mine_on == "same", mine in COLLECTIVES,
                         peer) if type(mine) is str else None))
        iv = rec.get("interval_s")
        if type(iv) in (int, float) and iv > 0:
            s.alive_interval = float(iv)
    elif ev == "end":
        _count_write_errors(s, rec)
        s.end = {k: rec.get(k) for k in _END_KEYS if k in rec}
    elif ev == "fault_injected":
        s.injected.append({k: rec.get(k) for k in _INJECTED_KEYS if k in rec})
    elif ev == "fault":
        s.faults.append(compact_record(rec) | {k: rec.get(k) for k in ("error", "reason") if k in rec})


def _count_write_errors(s: RankSummary, rec: dict) -> None:
    """The largest ``write_errors`` the session's alive and end records carry (the writer's count only grows)."""
    n = rec.get("write_errors")
    if type(n) is int and n > s.write_errors:
        s.write_errors = n


def parse_line(line: str) -> dict | None:
    try:
        rec = json.loads(line)
    except (ValueError, RecursionError):   # nested past json's depth limit: as unreadable as garbage
        return None
    return rec if type(rec) is dict else None


_TRACE_RULE = "an iterable of record dicts (the records of one rank file) or a RankSummary"


def trace_items(traces: Any) -> list[tuple[int | None, Any]]:
    """``diagnose``'s input as (rank, records list or RankSummary) pairs, checked before any work.

    A mapping's keys must be integer ranks >= 0 (rank None for the items of a plain iterable: the
    header's rank is used), each value ``_TRACE_RULE``; else a ValueError naming the rank and the rule.
    ``read_trace(path)`` returns ``(records, bad_lines)``: its ``records`` is the value to pass.
    """
    if isinstance(traces, Mapping):
        items = list(traces.items())
        for r, _ in items:
            if not isinstance(r, numbers.Integral) or isinstance(r, bool) or r < 0:
                raise ValueError(f"diagnose: rank key {r!r} ({type(r).__name__}) is not a rank: keys must be "
                                 f"integers >= 0, each mapped to {_TRACE_RULE}")
        items = [(int(r), t) for r, t in items]
    elif isinstance(traces, Iterable) and not isinstance(traces, (str, bytes)):
        items = [(None, t) for t in traces]
    else:
        raise ValueError(f"diagnose: traces must be a mapping rank -> {_TRACE_RULE}, or an iterable of "
                         f"RankSummary; got {type(traces).__name__}")
    return [(r, t if isinstance(t, RankSummary) else _records_of(t, r, n)) for n, (r, t) in enumerate(items)]


def _records_of(value: Any, rank: int | None, n: int) -> list:
    who = f"rank {rank}" if rank is not None else f"item #{n}"
    hint = ""
    if isinstance(value, tuple) and len(value) == 2 and type(value[1]) is int and not isinstance(value[0], dict):
        hint = "; read_trace(path) returns (records, bad_lines): pass its records, read_trace(path)[0]"
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise ValueError(f"diagnose: {who} is {type(value).__name__}, expected {_TRACE_RULE}{hint}")
    records = value if type(value) is list else list(value)
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise ValueError(f"diagnose: {who}: record {i} is {type(rec).__name__}, expected {_TRACE_RULE}{hint}")
    return records


def runs_note(count: int | None, header: Mapping, earlier: Any) -> str:
    """The warning of a file that holds several runs: the one replayed, and the ``--run-id`` of the one before it
    (``earlier``: that run's header). A restarted job (torchrun ``--max-restarts``) appends its runs so."""
    text = (f"the file holds {count} runs" if count else "the file holds several runs") + \
        f" (a header at seq {header.get('seq')}, step {header.get('step')}); replaying the last one"
    new, old = header.get("run_id"), earlier.get("run_id") if isinstance(earlier, Mapping) else None
    if isinstance(new, str) and isinstance(old, str) and new != old:
        text += f" (run {new}); --run-id {old} replays the one before it"
    return text
