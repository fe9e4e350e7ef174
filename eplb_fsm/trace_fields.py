"""The fields of trace records beyond the base fields: header, collectives, ``end``, ``alive``.

Pure builders (no I/O; :class:`CollectiveBrackets` writes through the trace's own methods): the
fields, a record's line (:func:`encode_record`, from :mod:`eplb_fsm.trace_encode`) and a rank's
file name (:func:`trace_path`); :mod:`eplb_fsm.trace` re-exports each of them and writes the
records. docs/events.md documents every field.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterator, NamedTuple

from eplb_fsm.maps import as_count
from eplb_fsm.trace_encode import encode_record, json_default  # noqa: F401  (public here since the start)

SCHEMA_VERSION = 1
END_HOWS = ("closed", "exception", "signal")
# the machine events whose `before` hook sets / clears scale_pending (eplb_fsm.fsm.machine.TRANSITIONS; a test
# keeps them equal): the trace tracks the flag from its own transition records, without importing the machine
PENDING_SET = frozenset({"scale_requested", "groups_ready", "salvaged", "resumed"})
PENDING_CLEARED = frozenset({"switched", "fault"})
COLLECTIVE_FIELDS = ("op", "group", "cseq", "shape", "dtype")


class OpenCollective(NamedTuple):
    """A collective whose start is written and whose end is not (``EventTrace.open_collective``)."""

    start: dict          # the collective_start record
    info: dict           # the fields its end or error record repeats
    key: tuple           # (thread id, group): its entry in ``open_collectives``
    t0: float            # perf_counter at the start


class CollectiveBrackets:
    """:class:`~eplb_fsm.trace.EventTrace`'s collective brackets, built on its ``start_collective`` and ``emit``
    and its ``open_collectives`` dict (what ``alive`` records report)."""

    open_collectives: dict

    @contextlib.contextmanager
    def collective(self, op: str, group: str = "world", shape: Any = None, dtype: Any = None,
                   **fields: Any) -> Iterator[dict]:
        """Bracket one collective with start/end records; an exception writes ``collective_error``.

        The yielded dict is the start record; the group's ``cseq`` advances once per call,
        so the n-th collective of a group has the same ``cseq`` on every rank that issues it.
        """
        opened = self.open_collective(op, group, shape, dtype, **fields)
        try:
            yield opened.start
        except BaseException as exc:
            self.close_collective(opened, exc)
            raise
        self.close_collective(opened)

    def open_collective(self, op: str, group: str = "world", shape: Any = None, dtype: Any = None,
                        **fields: Any) -> "OpenCollective":
        """Write a ``collective_start`` and note the collective as open (what ``alive`` reports). For one
        waited on later than issued (a posted all-reduce read next step): :meth:`close_collective` ends it."""
        start = self.start_collective(op, group, shape, dtype, **fields)
        info = {key: start[key] for key in (*COLLECTIVE_FIELDS, *fields)}  # what end/error repeat
        key = (threading.get_ident(), group)
        self.open_collectives[key] = {"op": op, "group": group, "cseq": start["cseq"]}
        return OpenCollective(start, info, key, time.perf_counter())

    def close_collective(self, opened: "OpenCollective", error: BaseException | None = None) -> dict:
        """Write the ``collective_end`` (``duration_s`` since it opened) or, with ``error``, ``collective_error``."""
        self.open_collectives.pop(opened.key, None)
        if error is not None:
            return self.emit("collective_error", error=exception_text(error), **opened.info)
        return self.emit("collective_end", duration_s=round(time.perf_counter() - opened.t0, 6), **opened.info)

    def waiting_on(self) -> dict | None:
        """The oldest collective started and not ended (``{"op", "group", "cseq"}``), or None."""
        try:
            return next(iter(list(self.open_collectives.values())), None)
        except RuntimeError:  # changed size while copied (another thread): report nothing this time
            return None


def machine_after(machine: dict, trigger: Any, dest: Any, fields: dict) -> dict:
    """The writer's view of the machine (``state``, ``layer``, ``scale_pending``) after a ``transition`` record.

    A ``continued`` header repeats it: a replay whose history starts at that header (the older
    segments deleted) needs the layer in flight and the flag, which no base field carries.
    """
    layer = fields.get("layer_after")
    if type(layer) is not int:   # records without layer_after: what the replay itself resynchronises on
        layer = fields.get("layer")
        if trigger == "layer_done" and type(layer) is int:
            layer += 1
        elif type(layer) is not int:
            layer = machine.get("layer", 0)
    pending = machine.get("scale_pending", False)
    if trigger in PENDING_SET:
        pending = True
    elif trigger in PENDING_CLEARED:
        pending = False
    return {"state": dest, "layer": layer, "scale_pending": pending}


def continued_fields(header: dict, segment: int, machine: dict, cseq: dict) -> dict:
    """The fields of the header copy atop a rotated segment: the header's, ``continued``, ``segment``, where the
    machine is (``machine``) and each group's next collective number (``next_cseq``)."""
    return {**header, "continued": True, "segment": segment, "machine": dict(machine), "next_cseq": dict(cseq)}


def check_identity(rank: Any, world: Any, generation: Any, clock: Any) -> tuple[int, int, int]:
    """``(rank, world, generation)`` as ints, checked before a trace makes anything: integers (numpy's too; not
    bools or floats), ``world >= 1``, ``0 <= rank < world``, ``generation >= 0``, and ``clock`` callable.
    ValueError naming the field and the rule otherwise."""
    world = as_count(world, "EventTrace world", minimum=1)
    rank = as_count(rank, "EventTrace rank", minimum=0)
    if rank >= world:
        raise ValueError(f"EventTrace rank must be < world ({world}), got {rank}")
    generation = as_count(generation, "EventTrace generation", minimum=0)
    if not callable(clock):
        raise ValueError(f"EventTrace clock must be a callable that returns seconds (like time.time), got {clock!r}")
    return rank, world, generation


def trace_path(trace_dir: str | os.PathLike, rank: int, generation: int = 0) -> Path:
    """``rank<NNNNN>.jsonl`` (zero-padded); a joiner of generation g writes its own
    ``rank<NNNNN>.g<g>.jsonl`` (docs/elastic.md)."""
    return Path(trace_dir) / (f"rank{rank:05d}.g{int(generation)}.jsonl" if generation else f"rank{rank:05d}.jsonl")


def end_fields(how: str, error: str | None = None, signal: str | None = None, sender: dict | None = None) -> dict:
    """The fields of an ``end`` record (beyond the base fields); ValueError on a bad combination.

    ``how``: ``closed`` (an orderly close), ``exception`` (``error`` = ``"Type: message"``)
    or ``signal`` (``signal`` = the signal's name, e.g. ``"SIGTERM"``; ``sender``, when known:
    ``{"pid": the sending process, "parent": whether it is this process's parent, its launcher}``).
    """
    if how not in END_HOWS:
        raise ValueError(f"end: how must be one of {', '.join(END_HOWS)}, got {how!r}")
    fields: dict[str, Any] = {"how": how}
    if how == "exception":
        if not isinstance(error, str) or not error:
            raise ValueError(f"end: how='exception' needs error as a non-empty string, got {error!r}")
        fields["error"] = error
    elif error is not None:
        raise ValueError(f"end: error is only given with how='exception', got how={how!r}")
    if how == "signal":
        if not isinstance(signal, str) or not signal:
            raise ValueError(f"end: how='signal' needs signal as a name such as 'SIGTERM', got {signal!r}")
        fields["signal"] = signal
    elif signal is not None:
        raise ValueError(f"end: signal is only given with how='signal', got how={how!r}")
    if sender is not None:
        if how != "signal" or not isinstance(sender, dict) or type(sender.get("pid")) is not int \
                or type(sender.get("parent")) is not bool:
            raise ValueError(f"end: sender is {{'pid': int, 'parent': bool}} with how='signal', got {sender!r}")
        fields["sender"] = {"pid": sender["pid"], "parent": sender["parent"]}
    return fields


def exception_text(exc: BaseException) -> str:
    """``"Type: message"``: how an ``end`` record and ``collective_error`` name an exception."""
    return f"{type(exc).__name__}: {exc}"


def alive_fields(interval_s: float, steps_seen: int | None, waiting_on: dict | None,
                 engine_wait: tuple | None = None) -> dict:
    """The fields of an ``alive`` record: the writer's rate, the step at its previous record, the open collective,
    and, only when one was seen, the engine's own collective a thread is blocked in: ``engine_wait`` (its name)
    and ``engine_wait_group`` (``"same"``: on the controller's ranks, ``"other"``; absent when unknown), with
    ``engine_wait_call`` (its group's name and tensor shape, when read) and ``engine_wait_main`` (whether the
    main thread waits in it), from ``engine_wait`` = (name, same group: True, False or None[, call, main[, of main]]);
    a name of None writes none of those. ``of main``: (name, same group, call) of the collective the main thread is
    blocked in when that is not the one named (``engine_wait.main_wait``), written as ``main_wait`` (with
    ``main_wait_group`` and ``main_wait_call`` as above), and ``main_wait_peer``: the controller's rank a ``send``
    or ``recv`` waits on (from a fourth element, when known)."""
    fields = {"interval_s": float(interval_s), "steps_seen": steps_seen, "waiting_on": waiting_on}
    if engine_wait is None:
        return fields
    op, same, *more = engine_wait
    if op is not None:
        fields["engine_wait"] = str(op)
        if same is not None:
            fields["engine_wait_group"] = "same" if same else "other"
        if more:
            call, main = more[:2]
            if call is not None:
                fields["engine_wait_call"] = str(call)
            fields["engine_wait_main"] = bool(main)
    if len(more) > 2 and more[2]:
        op, same, call, *peer = more[2]
        fields["main_wait"] = str(op)
        if peer and type(peer[0]) is int:
            fields["main_wait_peer"] = peer[0]
        if same is not None:
            fields["main_wait_group"] = "same" if same else "other"
        if call is not None:
            fields["main_wait_call"] = str(call)
    return fields


def config_hash(config: dict) -> str:
    """First 16 hex digits of the sha256 of ``config`` as canonical JSON (sorted keys, no spaces)."""
    import hashlib

    text = json.dumps(config, sort_keys=True, separators=(",", ":"), default=json_default)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _package_version() -> str:
    try:
        from importlib.metadata import version

        return version("eplb-fsm")
    except Exception:  # running from a source checkout that is not installed
        return "0+source"


def header_fields(config: dict | None = None, **extra: Any) -> dict:
    """The fields of a ``header`` record after the base fields: schema, pid, versions, config, ``extra``."""
    import numpy
    import structlog
    import torch
    import transitions

    return {
        "schema": SCHEMA_VERSION,
        "pid": os.getpid(),
        "versions": {
            "eplb_fsm": _package_version(),
            "torch": torch.__version__,
            "numpy": numpy.__version__,
            "transitions": transitions.__version__,
            "structlog": structlog.__version__,
        },
        "config": config or {},
        **extra,
    }


def collective_fields(op: str, group: str, cseq: int, shape: Any = None, dtype: Any = None, **fields: Any) -> dict:
    """The fields of a ``collective_*`` record after the base fields (``COLLECTIVE_FIELDS`` first, then ``fields``)."""
    info = {
        "op": op,
        "group": group,
        "cseq": cseq,
        "shape": list(shape) if shape is not None else None,
        "dtype": str(dtype) if dtype is not None else None,
    }
    info.update(fields)
    return info
