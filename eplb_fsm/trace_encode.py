"""A trace record as its line of strict JSON, whatever its fields hold (docs/events.md, "Values JSON cannot hold").

A trace never stops the engine (:mod:`eplb_fsm.trace_file`), and that includes a record a
caller filled with something JSON cannot hold. :func:`encode_record` always returns one
line of strict JSON (RFC 8259: no ``NaN`` / ``Infinity`` tokens):

- numpy / torch scalars and arrays go out as their ``tolist()``, sets and tuples as lists,
  any other unknown object as its ``str()`` (:func:`json_default`);
- a float that is not finite is written as the string ``"nan"``, ``"inf"`` or ``"-inf"``
  (``float()`` of each gives the value back);
- a dict key JSON cannot hold (a tuple, a numpy integer) is written as its ``str()``;
- a field that still cannot be encoded (a circular reference, nesting too deep, a value
  whose conversion raises) is written as the string of its ``repr()``.

The common record takes one ``json.dumps`` call; only a record that fails it is walked.
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["RESERVED_FIELDS", "check_fields", "encode_record", "json_default"]

# base fields the trace itself stamps: a caller's record cannot replace them (``state``/``step`` it may)
RESERVED_FIELDS = frozenset({"ts", "rank", "world", "event", "seq"})
_KEY_TYPES = (str, int, float, bool)


def check_fields(fields: dict, where: str) -> None:
    """ValueError naming a field of ``fields`` that would replace a base field the trace stamps."""
    if RESERVED_FIELDS.isdisjoint(fields):
        return
    taken = sorted(RESERVED_FIELDS.intersection(fields))
    if taken:
        raise ValueError(f"{where}: field {taken[0]!r} is a base field the trace stamps itself "
                         f"({', '.join(sorted(RESERVED_FIELDS))}); give the value another name")


def json_default(value: Any) -> Any:
    """How values JSON does not know are written: numpy / torch scalars and shapes, sets, tuples."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    return str(value)


def _dumps(value: Any) -> str:
    return json.dumps(value, default=json_default, separators=(",", ":"), allow_nan=False)


def encode_record(record: dict) -> str:
    """One record as the JSON text of its trace line (no newline), as :class:`~eplb_fsm.trace.EventTrace` writes
    it: compact, strict JSON; never raises for what a field holds (module docstring)."""
    try:
        return _dumps(record)
    except Exception:   # a key, a non-finite float, a cycle, a conversion that raises: walk the fields
        pass
    out = {}
    for key, value in record.items():
        try:
            out[_key(key)] = _finite(value, 0)
        except Exception:   # a cycle, too deep, a conversion that raises: the field as its repr
            out[_key(key)] = _repr(value)
    try:
        return _dumps(out)
    except Exception:
        return _dumps({key: _field(value) for key, value in out.items()})


def _field(value: Any) -> Any:
    try:
        _dumps(value)
        return value
    except Exception:
        return _repr(value)


def _repr(value: Any) -> str:
    try:
        return repr(value)
    except Exception as exc:   # a repr that raises: its type, and why
        return f"<{type(value).__name__}: repr failed: {type(exc).__name__}>"


def _float(value: float) -> Any:
    if math.isfinite(value):
        return value
    return "nan" if value != value else ("inf" if value > 0 else "-inf")


def _key(key: Any) -> Any:
    if key is None or isinstance(key, _KEY_TYPES):
        return _float(key) if isinstance(key, float) else key
    if hasattr(key, "item"):   # a numpy scalar: its Python value, as JSON would write that
        return _key(key.item())
    return str(key)


_DEPTH = 200   # nesting past this is written as its repr (json's own recursion would fail further down)


def _finite(value: Any, depth: int) -> Any:
    """``value`` with non-finite floats as names and dict keys JSON can hold; raises on a cycle (too deep)."""
    if depth > _DEPTH:
        raise RecursionError("trace field nested too deep")
    if isinstance(value, float):
        return _float(value)
    if value is None or isinstance(value, (str, int)):
        return value
    if isinstance(value, dict):
        return {_key(k): _finite(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_finite(v, depth + 1) for v in value]
    converted = json_default(value)
    if isinstance(converted, str):
        return converted
    return _finite(converted, depth + 1)
