"""EplbConfig: the balancer's settings, validated on construction.

Every invalid value raises ``ValueError`` naming the field and the rule, before any
state exists, so a bad setting never reaches a running engine: a wrong type or range,
an unknown policy name (the choices are listed), an unknown field (keyword or dict key).

Construction: ``EplbConfig(**fields)``, :meth:`EplbConfig.from_dict` (a mapping),
:meth:`EplbConfig.from_json` (JSON *text*) and :meth:`EplbConfig.from_file` (a path to a
JSON file).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import numbers
import os
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from eplb_fsm.maps import MAX_SECONDS, as_finite_float

LOAD_ESTIMATORS = ("window_sum", "decayed_sum", "subwindow_max")
#: largest ``window_size``: the window is a (window_size, layers, slots) int64 tensor per
#: model, so 100k passes of a 58-layer, 288-slot model already take 13 GB
MAX_WINDOW_SIZE = 100_000


@dataclass(frozen=True)
class EplbConfig:
    """Settings of one balancer (one per engine; every rank must use equal values).

    Counts are in engine steps. ``step_interval`` steps separate rearrangements (the
    first one comes after ``step_interval // 4``); ``window_size`` non-dummy passes
    make up the load window the policy sees. ``extra`` holds the host's own settings
    (JSON values, string keys: the header of every rank's trace carries them, and replay
    compares them).
    """

    window_size: int = 1000
    step_interval: int = 3000
    num_redundant_experts: int = 0
    use_async: bool = False
    policy: str = "default"
    log_balancedness: bool = False
    log_balancedness_interval: int = 1
    enable_migration_batching: bool = False
    # skip a rearrangement whose predicted balancedness gain is below this (0: any gain)
    min_balancedness_gain: float = 0.0
    # seconds any wait on other ranks may take before it becomes a `fault` event
    collective_timeout_s: float = 60.0
    # seconds a state may go without progress before the watchdog logs `stuck` (0: off)
    watchdog_deadline_s: float = 0.0
    # how the window becomes the load the policy plans on
    load_estimator: str = "window_sum"
    load_decay: float = 0.9
    # movement-aware policy: target fraction of the default policy's balancedness
    movement_balancedness_target: float = 0.99
    # EP layout used by the default (hierarchical) policy
    num_nodes: int = 1
    # async mode: the nice increment the background worker thread gives itself at start, and
    # the threads of the transfer group get (0-19; Linux, per thread): the engine wins the CPU
    async_worker_nice: int = 0
    # async mode: at most this many bytes of expert rows moved per engine step (0: no limit);
    # the worker waits for the next step between chunks, so its CPU per step is bounded
    async_max_bytes_per_step: int = 0
    # async mode: post each step's ready-flag all-reduce and read it on the next step, so the
    # engine never waits on it (a layer commits one step later); False: wait within the step
    async_overlap_poll: bool = True
    # async mode: transfer the next changed layer into a second buffer while the current one
    # waits for its agreement and commit (one more layer buffer per model; a layer's wait
    # for its agreement then overlaps the next layer's transfer)
    async_prefetch: bool = False
    # reorder each rank's slots in a new placement so an expert that stays on its rank keeps
    # its row: the same rank sets and balance, and no copy for a row that keeps its expert
    align_slots: bool = True
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_int(self, "window_size", minimum=1, maximum=MAX_WINDOW_SIZE)
        _check_int(self, "step_interval", minimum=1)
        _check_int(self, "num_redundant_experts", minimum=0)
        _check_int(self, "log_balancedness_interval", minimum=1)
        _check_int(self, "num_nodes", minimum=1)
        _check_int(self, "async_worker_nice", minimum=0, maximum=19)
        _check_int(self, "async_max_bytes_per_step", minimum=0)
        for name in ("use_async", "log_balancedness", "enable_migration_batching", "async_overlap_poll",
                     "async_prefetch", "align_slots"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.policy, str) or not self.policy:
            raise ValueError(f"policy must be a non-empty policy name, got {self.policy!r}")
        # only names are read, but the import runs eplb_fsm.policy's __init__, which imports the
        # built-in policy modules; a policy registered by path from elsewhere is not imported
        from eplb_fsm.policy.registry import available_policies

        if self.policy not in available_policies():
            raise ValueError(f"policy must be one of {', '.join(available_policies())}, got {self.policy!r}")
        _check_float(self, "min_balancedness_gain", lo=0.0, hi=1.0)
        _check_float(self, "collective_timeout_s", lo=0.0, hi=MAX_SECONDS, lo_open=True)
        _check_float(self, "watchdog_deadline_s", lo=0.0, hi=MAX_SECONDS)
        _check_float(self, "load_decay", lo=0.0, hi=1.0, lo_open=True)
        _check_float(
            self, "movement_balancedness_target", lo=0.0, hi=1.0, lo_open=True
        )
        if self.load_estimator not in LOAD_ESTIMATORS:
            raise ValueError(
                f"load_estimator must be one of {', '.join(LOAD_ESTIMATORS)}, got {self.load_estimator!r}"
            )
        if not isinstance(self.extra, Mapping):
            raise ValueError(f"extra must be a mapping, got {type(self.extra).__name__}")
        _check_string_keys(self.extra, "extra")
        try:  # it goes into every rank's trace header, where the ranks' configs are compared
            text = json.dumps(dict(self.extra), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"extra must hold JSON values (it is written to every rank's trace header): {exc}") \
                from None
        # held as its JSON form, a copy: a later change to the caller's dict can't reach the header unchecked
        object.__setattr__(self, "extra", json.loads(text))

    def check_replacement(self, new: Any) -> "EplbConfig":
        """``new`` if it may replace this config on a running controller, else ``ValueError``.

        Only ``num_redundant_experts`` may differ (elastic EP sets it after a resize): the other
        fields were read into the controller's parts when it was built, so a new value would
        not take effect.
        """
        if not isinstance(new, EplbConfig):
            raise ValueError(f"config must be an EplbConfig, got {type(new).__name__}")
        changed = [f.name for f in fields(self) if f.name != "num_redundant_experts"
                   and getattr(self, f.name) != getattr(new, f.name)]
        if changed:
            raise ValueError(f"a running controller's config may change only num_redundant_experts, not "
                             f"{', '.join(changed)}; build a new controller for those")
        return new

    @property
    def first_rearrangement_step(self) -> int:
        """Steps after start before the first rearrangement (a quarter interval, at least 1)."""
        return max(1, self.step_interval // 4)

    # -- construction ----------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "EplbConfig":
        """Build from a mapping; unknown keys are an error (a typo must not pass silently)."""
        if not isinstance(data, Mapping):
            raise ValueError(f"config must be a mapping of field names to values, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted((repr(key) if not isinstance(key, str) else key) for key in data if key not in known)
        if unknown:
            raise ValueError(f"unknown config field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**dict(data))

    @classmethod
    def from_json(cls, text: str) -> "EplbConfig":
        """Build from JSON *text* holding one object (for a file, use :meth:`from_file`)."""
        try:
            data = json.loads(text, object_pairs_hook=_unique_keys)
        except json.JSONDecodeError as exc:
            hint = ""
            if isinstance(text, str) and "\n" not in text and os.path.isfile(text):
                hint = f" ({text!r} is a file: use EplbConfig.from_file)"
            raise ValueError(f"config JSON is not valid: {exc}{hint}") from exc
        return cls.from_dict(data)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "EplbConfig":
        """Build from a JSON file holding one object; ``ValueError`` naming the file when it cannot be read."""
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"config file {os.fspath(path)}: cannot read: {exc}") from None
        try:
            return cls.from_json(text)
        except ValueError as exc:
            raise ValueError(f"config file {os.fspath(path)}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["extra"] = dict(self.extra)
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def replace(self, **changes: Any) -> "EplbConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def _reject_unknown_fields(init):
    """Wrap the dataclass ``__init__`` so an unknown keyword is a ValueError (like from_dict), not a TypeError."""

    @functools.wraps(init)
    def checked_init(self, *args: Any, **kwargs: Any) -> None:
        known = {f.name for f in fields(type(self))}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown config field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        init(self, *args, **kwargs)

    return checked_init


EplbConfig.__init__ = _reject_unknown_fields(EplbConfig.__init__)  # type: ignore[method-assign]


def _check_string_keys(value: Any, where: str, path: tuple = ()) -> None:
    """Every mapping in ``value`` (nested in mappings, lists, tuples) has string keys: JSON would
    turn 1 into "1", and of keys 1 and "1" keep one value silently. (A container holding itself
    is left to json.dumps, which refuses it.)"""
    if id(value) in path:
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"extra must have string keys (JSON object keys), got key {key!r} in {where}")
            _check_string_keys(item, f"{where}[{key!r}]", path + (id(value),))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_string_keys(item, f"{where}[{i}]", path + (id(value),))


def _check_int(config: EplbConfig, name: str, minimum: int, maximum: int | None = None) -> None:
    value = getattr(config, name)
    # numpy's integers count (a value read from an array); bools do not
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    object.__setattr__(config, name, value)  # a plain int, so to_json and the trace header can hold it
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")


def _check_float(
    config: EplbConfig, name: str, lo: float | None = None, hi: float | None = None, lo_open: bool = False
) -> None:
    # always a plain float, whatever was given (60, np.float64(60), 60.0): to_dict must write
    # the same text for equal values, since replay compares the ranks' headers as JSON
    value = as_finite_float(getattr(config, name), name)
    object.__setattr__(config, name, value)
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise ValueError(f"{name} must be {'>' if lo_open else '>='} {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object as a dict; ``ValueError`` naming a key given twice (json keeps the last one silently, so a
    hand-edited file with a field twice would run with the value the reader did not look at)."""
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            raise ValueError(f"config JSON gives {key!r} twice: each field may appear once")
        data[key] = value
    return data
