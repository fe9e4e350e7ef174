"""The fields of trace records beyond the base fields: header, collectives, ``end``, ``alive``.

Pure builders (no I/O): the fields, a record's line (:func:`encode_record`) and a rank's
file name (:func:`trace_path`); :mod:`eplb_fsm.trace` re-exports each of them and writes the
records. docs/events.md documents every field.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, NamedTuple

SCHEMA_VERSION = 1
END_HOWS = ("closed", "exception", "signal")
# the machine events whose `before` hook sets / clears scale_pending (eplb_fsm.fsm.machine.TRANSITIONS; a test
# keeps them equal): the trace tracks the flag from its own transition records, without importing the machine
PENDING_SET = frozenset({"scale_requested", "groups_ready", "salvaged", "resumed"})
PENDING_CLEARED = frozenset({"switched", "fault"})


class OpenCollective(NamedTuple):
    """A collective whose start is written and whose end is not (``EventTrace.open_collective``)."""

    start: dict          # the collective_start record
    info: dict           # the fields its end or error record repeats
    key: tuple           # (thread id, group): its entry in ``open_collectives``
    t0: float            # perf_counter at the start


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


def trace_path(trace_dir: str | os.PathLike, rank: int, generation: int = 0) -> Path:
    """``rank<NNNNN>.jsonl`` (zero-padded); a joiner of generation g writes its own
    ``rank<NNNNN>.g<g>.jsonl`` (docs/elastic.md)."""
    return Path(trace_dir) / (f"rank{rank:05d}.g{int(generation)}.jsonl" if generation else f"rank{rank:05d}.jsonl")


def encode_record(record: dict) -> str:
    """One record as the JSON text of its trace line (no newline), as :class:`~eplb_fsm.trace.EventTrace` writes
    it: compact, values JSON does not know through :func:`json_default`."""
    return json.dumps(record, default=json_default, separators=(",", ":"))


def json_default(value: Any) -> Any:
    """How values JSON does not know are written: numpy / torch scalars and shapes, sets, tuples."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    return str(value)


def end_fields(how: str, error: str | None = None, signal: str | None = None) -> dict:
    """The fields of an ``end`` record (beyond the base fields); ValueError on a bad combination.

    ``how``: ``closed`` (an orderly close), ``exception`` (``error`` = ``"Type: message"``)
    or ``signal`` (``signal`` = the signal's name, e.g. ``"SIGTERM"``).
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
    return fields


def exception_text(exc: BaseException) -> str:
    """``"Type: message"``: how an ``end`` record and ``collective_error`` name an exception."""
    return f"{type(exc).__name__}: {exc}"


def alive_fields(interval_s: float, steps_seen: int | None, waiting_on: dict | None) -> dict:
    """The fields of an ``alive`` record: the writer's rate, the step at its previous record, the open collective."""
    return {"interval_s": float(interval_s), "steps_seen": steps_seen, "waiting_on": waiting_on}


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
