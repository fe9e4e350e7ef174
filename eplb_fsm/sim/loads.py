"""Logical load matrices (L, N): read from files, built from routing traces, or generated.

Readers
    :func:`load_matrix` reads ``.npy``, ``.npz``, ``.pt``, ``.json`` files and ESFT
    routing-trace directories (or their ``summary.json``) into a float64 (L, N) array;
    ``"example"`` names the bundled example. Bad files raise ``ValueError`` naming the
    file and the problem.
ESFT traces
    Bundled with the package (``data/esft_routing.npz``, MIT, see ``data/ESFT-SOURCE.md``):
    per-sequence token counts of the DeepSeek ESFT routing traces for the tasks
    ``intent`` (26 layers), ``law``, ``summary``, ``translation`` (layers 1, 13, 26),
    named ``"esft:<task>"`` wherever a trace directory is accepted. A trace directory
    holds the original text files ``expert_weights_<layer>.txt``: one line per sequence,
    ``ids<TAB><TAB>gate weights`` with ``ids`` the flat, tab-separated top-k expert ids
    of its tokens; every layer file of a task lists the same sequences in the same
    order. :func:`esft_sequence_loads` gives per-sequence counts (S, L, N);
    :func:`iter_esft_windows` / :func:`esft_load_windows` sum consecutive sequences into
    per-batch windows.
Generators (docs/design.md §9, ``scenarios.json``)
    :func:`zipf_load` (per layer: probabilities 1/i^exponent, shuffled per layer, then
    multinomial draws), :func:`drift` (times lognormal(0, sigma) noise),
    :func:`load_scenarios` and :func:`scenario_load`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from eplb_fsm.maps import host_array
from eplb_fsm.sim.esft import (
    BUNDLED_ESFT,
    ESFT_TASKS,
    MAX_EXPERT_ID,
    bundled_sequence_loads,
    bundled_task,
    esft_layers,
    esft_load_windows,
    esft_sequence_loads,
    esft_token_scores,
    expert_id_rule,
    has_esft_traces,
    iter_esft_windows,
    trace_file_layer,
)

__all__ = [
    "BUNDLED_ESFT",
    "ESFT_TASKS",
    "EXAMPLE_LOAD",
    "SCENARIOS_ENV",
    "drift",
    "esft_layers",
    "esft_load_windows",
    "esft_sequence_loads",
    "esft_token_scores",
    "iter_esft_windows",
    "load_matrix",
    "load_scenarios",
    "scenario_load",
    "zipf_load",
]

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
#: bundled example load: the real ESFT "intent" aggregate, 26 layers x 64 experts (token counts)
EXAMPLE_LOAD = DATA_DIR / "example_load.json"
#: bundled copy of shared/bench/scenarios.json
BUNDLED_SCENARIOS = DATA_DIR / "scenarios.json"
#: environment variable that points load_scenarios() at another scenarios.json
SCENARIOS_ENV = "EPLB_FSM_SCENARIOS"

_SHAPE_KEYS = ("layers", "experts", "replicas", "ranks", "nodes", "groups")


# --------------------------------------------------------------------------- readers


def _checked(matrix: Any, source: str) -> np.ndarray:
    """Validate a load matrix read from ``source``: 2-D, non-empty, finite, non-negative, finite row sums."""
    try:
        arr = np.asarray(matrix)
    except Exception as exc:  # noqa: BLE001 - ragged lists and the like
        raise ValueError(f"{source}: not a rectangular (layers, experts) array: {exc}") from None
    if arr.dtype == object:
        raise ValueError(f"{source}: not a rectangular (layers, experts) array of numbers")
    if arr.ndim != 2:
        raise ValueError(f"{source}: load must be 2-D (layers, experts), got shape {arr.shape}")
    if arr.shape[0] == 0 or arr.shape[1] == 0:
        raise ValueError(f"{source}: load is empty, shape {arr.shape}")
    if arr.dtype.kind not in "iuf":   # bool, complex, timedelta, strings: no token counts
        raise ValueError(f"{source}: load must hold real numbers, got dtype {arr.dtype}")
    with np.errstate(over="ignore", invalid="ignore"):   # a value past float64 (a long double) is named below
        wide = arr.astype(np.float64)
    if np.isinf(wide).any() and not np.isinf(arr).any():
        raise ValueError(f"{source}: load holds values past the largest float64 ({np.finfo(np.float64).max:.4g})")
    arr = wide
    if np.isnan(arr).any():
        raise ValueError(f"{source}: load contains NaN")
    if np.isinf(arr).any():
        raise ValueError(f"{source}: load contains infinite values")
    if (arr < 0).any():
        raise ValueError(f"{source}: load contains negative values")
    with np.errstate(over="ignore"):  # an overflow is reported below, as the file's problem
        sums = arr.sum(axis=1)
    if not np.isfinite(sums).all():  # finite loads that overflow: a layer's shares would be 0/inf, not its load
        layer = int(np.flatnonzero(~np.isfinite(sums))[0])
        raise ValueError(f"{source}: the loads of layer {layer} sum past the largest float ({sums[layer]}); "
                         "each layer's loads must have a finite sum (scale the file down)")
    return arr


def _json_numbers(rows: Any, source: str, what: str = "load") -> Any:
    """``rows`` unchanged when no entry of a row is a JSON string, boolean or null (numpy would read "2" and
    true as numbers); else a ValueError naming the entry. Deeper nesting is left to the shape check."""
    if isinstance(rows, list):
        for i, row in enumerate(rows):
            for j, value in enumerate(row if isinstance(row, list) else [row]):
                if value is None or isinstance(value, (bool, str)):
                    at = f"{what}[{i}][{j}]" if isinstance(row, list) else f"{what}[{i}]"
                    raise ValueError(f"{source}: {at} is {json.dumps(value)}; every load must be a JSON number")
    return rows


def _from_json_object(obj: Any, source: str) -> Any:
    if isinstance(obj, list):
        return _json_numbers(obj, source)
    if isinstance(obj, dict):
        if "load" in obj:
            return _json_numbers(obj["load"], source)
        if "token_scores" in obj:  # ESFT summary.json
            return _summary_scores(obj["token_scores"], source)
        if "load_history" in obj:  # vLLM EPLB workload: sum the windows
            try:
                windows = [np.asarray(_json_numbers(w["logical_expert_load"], source,
                                                    f"load_history[{k}].logical_expert_load"))
                           for k, w in enumerate(obj["load_history"])]
            except (KeyError, TypeError) as exc:
                raise ValueError(f"{source}: bad load_history entry: {exc}") from None
            if not windows:
                raise ValueError(f"{source}: load_history is empty")
            if len({w.shape for w in windows}) != 1:
                raise ValueError(f"{source}: load_history windows have different shapes")
            odd = next((k for k, w in enumerate(windows) if w.dtype.kind not in "iuf"), None)
            if odd is not None:
                raise ValueError(f"{source}: load_history[{odd}].logical_expert_load is not an array of numbers")
            with np.errstate(over="ignore", invalid="ignore"):   # a sum past float64 is the file's problem
                total = np.sum(windows, axis=0, dtype=np.float64)
            if np.isinf(total).any() and all(np.isfinite(w).all() for w in windows):
                raise ValueError(f"{source}: the load_history windows sum past the largest float; scale the file "
                                 "down")
            return total
        raise ValueError(
            f"{source}: JSON object has none of the keys 'load', 'token_scores', 'load_history'"
        )
    raise ValueError(f"{source}: JSON must be a list of lists or an object with a 'load' key")


def _summary_scores(scores: Any, source: str) -> np.ndarray:
    """ESFT ``token_scores`` {layer: {expert: fraction}} -> (L, N), layers and experts in numeric order."""
    try:
        layers = sorted(scores, key=int)
        experts = {int(e) for layer in layers for e in scores[layer]}
        if not layers or not experts:
            raise ValueError("no layers or experts")
        if min(experts) < 0:
            raise ValueError("negative expert id")
        biggest = max(experts)
        if biggest > MAX_EXPERT_ID:  # the largest id sizes the array: refuse it before allocating
            layer = next(lay for lay in layers if any(int(e) == biggest for e in scores[lay]))
            raise ValueError(f"layer {layer}: expert id {biggest} is too large; {expert_id_rule()}")
        out = np.zeros((len(layers), biggest + 1), dtype=np.float64)
        for i, layer in enumerate(layers):
            for expert, value in scores[layer].items():
                if value is None or isinstance(value, (bool, str)):   # float() would read "0.5" and true
                    raise ValueError(f"layer {layer} expert {expert}: {json.dumps(value)} is not a JSON number")
                out[i, int(expert)] = float(value)
    except (TypeError, ValueError, AttributeError, OverflowError) as exc:
        raise ValueError(f"{source}: malformed token_scores: {exc}") from None
    return out


def _read_file(path: Path) -> Any:
    suffix = path.suffix.lower()
    source = str(path)
    if suffix == ".npy":
        try:
            return np.load(path, allow_pickle=False)
        except Exception as exc:  # noqa: BLE001
            raise ValueError(f"{source}: cannot read as .npy: {exc}") from None
    if suffix == ".npz":
        try:
            with np.load(path, allow_pickle=False) as data:
                if "load" in data.files:
                    return data["load"]
                if len(data.files) == 1:
                    return data[data.files[0]]
                raise ValueError(f"expected a 'load' array, found {data.files}")
        except ValueError as exc:
            raise ValueError(f"{source}: cannot read as .npz: {exc}") from None
        except Exception as exc:  # noqa: BLE001
            raise ValueError(f"{source}: cannot read as .npz: {exc}") from None
    if suffix == ".pt":
        import torch

        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001
            raise ValueError(f"{source}: cannot read as a torch file: {exc}") from None
        if isinstance(obj, dict):
            if "load" not in obj:
                raise ValueError(f"{source}: torch file holds a dict without a 'load' entry")
            obj = obj["load"]
        if not isinstance(obj, torch.Tensor):
            raise ValueError(
                f"{source}: torch file must hold a tensor (or {{'load': tensor}}), got {type(obj).__name__}"
            )
        if obj.is_complex() or obj.dtype == torch.bool:
            raise ValueError(f"{source}: load must hold real numbers, got dtype {obj.dtype}")
        kind = ("a nested" if obj.is_nested else "a quantized" if obj.is_quantized else
                f"a {obj.layout}" if obj.layout != torch.strided else "a meta (no data)" if obj.is_meta else None)
        if kind is not None:
            raise ValueError(f"{source}: load must be a dense tensor holding its values, got {kind} tensor")
        try:
            return obj.detach().cpu().double().numpy()
        except (RuntimeError, TypeError, NotImplementedError) as exc:   # a tensor subclass numpy cannot take
            raise ValueError(f"{source}: cannot read the tensor's values: {exc}") from None
    if suffix == ".json":
        try:
            with open(path, encoding="utf-8") as f:
                obj = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{source}: cannot read as JSON: {exc}") from None
        return _from_json_object(obj, source)
    if trace_file_layer(path) is not None:
        return esft_sequence_loads(path.parent, layers=[trace_file_layer(path)]).sum(axis=0)
    raise ValueError(
        f"{source}: unknown load file type {suffix or '(none)'}; use .npy, .npz, .pt, .json or a trace directory"
    )


def load_matrix(path: str | os.PathLike) -> np.ndarray:
    """Read a logical load matrix (L, N) as float64.

    ``path`` may be ``"example"`` (the bundled ESFT intent aggregate), a ``.npy`` /
    ``.npz`` (array, or key ``load``) / ``.pt`` (tensor, or ``{"load": tensor}``) /
    ``.json`` (a list of lists, ``{"load": [[...]]}``, an ESFT ``summary.json`` or a vLLM
    ``{"load_history": [...]}``) file, or an ESFT task directory: its
    ``expert_weights_<l>.txt`` traces summed to token counts per layer (layers in numeric
    order of the files present), else its ``summary.json``; or ``"esft:<task>"``, the
    bundled traces of one ESFT task summed the same way.

    Raises ``ValueError`` naming the file when it cannot be read, is not 2-D, is empty,
    or holds NaN, infinite or negative loads, or a layer whose loads sum past the largest float.
    """
    if str(path) == "example":
        path = EXAMPLE_LOAD
    if bundled_task(path) is not None:
        return _checked(bundled_sequence_loads(bundled_task(path))[0].sum(axis=0), str(path))
    p = Path(path)
    if p.is_dir():
        if has_esft_traces(p):
            data: Any = esft_sequence_loads(p).sum(axis=0)
        elif (p / "summary.json").is_file():
            data = _read_file(p / "summary.json")
        else:
            raise ValueError(f"{p}: directory has neither expert_weights_<layer>.txt files nor summary.json")
    elif p.is_file():
        data = _read_file(p)
    elif p.exists():
        raise ValueError(f"{p}: not a regular file or directory")
    else:
        raise ValueError(f"{p}: no such file or directory")
    return _checked(data, str(p))


# --------------------------------------------------------------------------- generators


def zipf_load(
    layers: int,
    experts: int,
    exponent: float = 1.0,
    tokens_per_layer: int = 524288,
    rng: np.random.Generator | int | None = None,
) -> np.ndarray:
    """Synthetic skewed load ``(layers, experts)`` int64 token counts.

    Per layer: probabilities proportional to 1 / i^exponent (i = 1..experts), shuffled by
    an independent random permutation per layer, then ``tokens_per_layer`` multinomial
    draws. ``rng`` is a numpy Generator or a seed.
    """
    if layers < 1 or experts < 1:
        raise ValueError(f"layers and experts must be >= 1, got {layers}, {experts}")
    if tokens_per_layer < 0:
        raise ValueError(f"tokens_per_layer must be >= 0, got {tokens_per_layer}")
    if not np.isfinite(exponent):
        raise ValueError(f"exponent must be finite, got {exponent}")
    rng = np.random.default_rng(rng)
    base = 1.0 / np.arange(1, experts + 1, dtype=np.float64) ** exponent
    base /= base.sum()
    probs = rng.permuted(np.tile(base, (layers, 1)), axis=1)
    return rng.multinomial(tokens_per_layer, probs).astype(np.int64)


def drift(load: Any, sigma: float, rng: np.random.Generator | int | None = None) -> np.ndarray:
    """Next window's load: ``load`` times independent lognormal(0, sigma) noise per entry (float64)."""
    if not sigma >= 0:
        raise ValueError(f"sigma must be >= 0, got {sigma}")
    load = np.asarray(host_array(load, "load"), dtype=np.float64)
    rng = np.random.default_rng(rng)
    return load * rng.lognormal(0.0, sigma, size=load.shape)


def _default_scenarios_path() -> Path:
    env = os.environ.get(SCENARIOS_ENV)
    return Path(env) if env else BUNDLED_SCENARIOS


def load_scenarios(path: str | os.PathLike | None = None) -> dict:
    """Read ``scenarios.json`` (benchmark shapes, synthetic-load and drift specs).

    Looks at ``path``, else ``$EPLB_FSM_SCENARIOS``, else the copy bundled with the
    package (nothing outside the package is read unless asked). Checks every shape
    has integer layers, experts, replicas, ranks, nodes, groups with replicas % ranks == 0
    and replicas >= experts; raises ``ValueError`` naming the file otherwise.
    """
    p = Path(path) if path is not None else _default_scenarios_path()
    try:
        with open(p, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{p}: cannot read scenarios: {exc}") from None
    shapes = data.get("shapes") if isinstance(data, dict) else None
    if not isinstance(shapes, dict) or not shapes:
        raise ValueError(f"{p}: no 'shapes' object")
    for name, shape in shapes.items():
        if not isinstance(shape, dict):
            raise ValueError(f"{p}: shape {name!r} is not an object")
        for key in _SHAPE_KEYS:
            value = shape.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{p}: shape {name!r} needs a positive integer {key!r}, got {value!r}")
        if shape["replicas"] % shape["ranks"] or shape["replicas"] < shape["experts"]:
            raise ValueError(f"{p}: shape {name!r}: replicas must be >= experts and divisible by ranks")
    data["path"] = str(p)
    return data


def scenario_load(name: str, scenarios: dict | None = None, rng: np.random.Generator | int | None = 0) -> np.ndarray:
    """The synthetic (zipf) load for shape ``name`` of ``scenarios`` (default: :func:`load_scenarios`)."""
    scenarios = load_scenarios() if scenarios is None else scenarios
    shapes = scenarios["shapes"]
    if name not in shapes:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(shapes)}")
    spec = scenarios.get("synthetic_load", {})
    if spec.get("kind", "zipf") != "zipf":
        raise ValueError(f"synthetic_load kind {spec.get('kind')!r} is not supported (only 'zipf')")
    shape = shapes[name]
    return zipf_load(
        shape["layers"],
        shape["experts"],
        exponent=float(spec.get("exponent", 1.0)),
        tokens_per_layer=int(spec.get("tokens_per_layer", 524288)),
        rng=rng,
    )
