"""ExpertMaps: which logical expert each physical slot holds, and the inverse maps.

Shapes (L layers, N logical experts, P physical slots, K = max replicas per expert):

- ``phy2log``        (L, P) int64: logical expert in each slot, -1 = empty slot
  (only while ranks join in elastic scale-up).
- ``log2phy``        (L, N, K) int64: the slots of each expert, ascending, -1 padded.
- ``replica_count``  (L, N) int64: number of non -1 entries per ``log2phy`` row.

``phy2log`` is the source of truth; the other two are derived from it, so the three
can never disagree. All arrays are numpy; ``as_torch`` gives tensors for the router.
"""

from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass

import numpy as np

EMPTY = -1
#: largest timeout or deadline in seconds (about 11.6 days): beyond it a value would overflow
#: the timedelta of gloo and the stores, or ``threading``'s ``TIMEOUT_MAX`` (about 9.2e9 s)
MAX_SECONDS = 1e6


def as_count(value, name: str, minimum: int | None = 1) -> int:
    """``value`` as an int of at least ``minimum`` (None: any); ``ValueError`` naming ``name`` otherwise.

    Python and numpy integers pass; floats (even 16.0), bools and strings do not, so that
    16.5 experts is an error rather than 16.
    """
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        count = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if minimum is not None and count < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {count}")
    return count


def _shown(value) -> str:
    """``repr(value)`` for an error message; an integer past float's range as its size (its repr
    could run to thousands of digits, and past 4300 digits repr itself raises)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and abs(int(value)) >= 2**1024:
        return f"an integer of {int(value).bit_length()} bits (too large for a float)"
    return repr(value)


def as_finite_float(value, name: str, rule: str = "a finite number") -> float:
    """``value`` as a Python float; ``ValueError`` "``name`` must be ``rule``, got ..." for a bool,
    a non-number, NaN, an infinity, or an integer too large for a float (10**400: ``float()``
    and ``math.isfinite`` raise OverflowError on it, which is no error a caller expects)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be {rule}, got {value!r}")
    try:
        number = float(value)
    except OverflowError:
        raise ValueError(f"{name} must be {rule}, got {_shown(value)}") from None
    if not math.isfinite(number):
        raise ValueError(f"{name} must be {rule}, got {value!r}")
    return number


def check_seconds(value, name: str) -> float:
    """``value`` as a float of seconds; ``ValueError`` naming ``name`` unless it is a real
    number in (0, ``MAX_SECONDS``]. Bools and strings are refused: ``True`` would mean
    one second, and a huge or infinite timeout overflows the stores' and gloo's timedelta."""
    rule = f"a finite number > 0 and <= {MAX_SECONDS:g} (seconds)"
    seconds = as_finite_float(value, name, rule)
    if not 0 < seconds <= MAX_SECONDS:
        raise ValueError(f"{name} must be {rule}, got {_shown(value)}")
    return seconds


def host_array(value, name: str) -> np.ndarray:
    """``value`` (a torch tensor on any device, a numpy array, nested lists) as a numpy array.

    A tensor is copied to the host; a dtype numpy lacks (bfloat16, float8) comes back as
    float32, which holds it exactly. A tensor on the ``meta`` device has no data to read,
    so it is refused with a ``ValueError`` naming ``name``.
    """
    if hasattr(value, "detach"):  # torch tensor
        if value.is_meta:
            raise ValueError(f"{name} must hold data: a tensor on the 'meta' device has none")
        value = value.detach().cpu()
        try:
            return value.numpy()
        except TypeError:
            return (value.cfloat() if value.is_complex() else value.float()).numpy()
    return np.asarray(value)


def _entry(name: str, index) -> str:
    """``name[i, j]`` (or ``name[j]`` for a row) for an index from ``np.argwhere``."""
    return f"{name}[{', '.join(str(int(i)) for i in index)}]"


def _as_int64(arr: np.ndarray, name: str) -> np.ndarray:
    """An int64 copy of an integer array of any shape; ``ValueError`` naming ``name`` (and an entry) otherwise."""
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.dtype == np.uint64 and arr.size and arr.max() > np.iinfo(np.int64).max:
        # checked before the cast, which would wrap 2**64 - 1 to -1 (an empty slot)
        bad = np.argwhere(arr > np.iinfo(np.int64).max)[0]
        raise ValueError(f"{_entry(name, bad)} = {arr[tuple(bad)]} is not an expert index (-1 marks an empty "
                         f"slot; entries must fit int64)")
    return arr.astype(np.int64, copy=True)


def checked_int64(value, name: str) -> np.ndarray:
    """``value`` (a torch tensor, numpy array or nested lists of integers, any shape) as an int64 numpy copy.

    ``ValueError`` naming ``name`` for a non-integer dtype, or for a uint64 entry past
    2**63 - 1, which a plain ``astype(np.int64)`` would wrap (2**64 - 1 to -1, an empty slot).
    """
    return _as_int64(host_array(value, name), name)


def _as_int64_2d(value, name: str) -> np.ndarray:
    arr = host_array(value, name)
    if arr.ndim != 2:
        raise ValueError(f"{name} must be 2-D (layers, slots), got shape {arr.shape}")
    return _as_int64(arr, name)


def initial_phy2log(num_layers: int, num_logical: int, num_physical: int) -> np.ndarray:
    """The placement before any rebalancing: slot i < N holds expert i, slot N+j holds j mod N.

    Returns (L, P) int64.
    """
    num_layers = as_count(num_layers, "num_layers")
    num_logical = as_count(num_logical, "num_logical")
    num_physical = as_count(num_physical, "num_physical")
    if num_physical < num_logical:
        raise ValueError(f"num_physical ({num_physical}) must be >= num_logical ({num_logical})")
    row = np.arange(num_physical, dtype=np.int64) % num_logical
    return np.tile(row, (num_layers, 1))


def derive_log2phy(phy2log: np.ndarray, num_logical: int, max_replicas: int | None = None):
    """From (L, P) ``phy2log`` build (log2phy (L, N, K), replica_count (L, N)).

    K is ``max_replicas`` if given (it must fit), else the largest count present.
    Slots come out ascending because slots are visited in index order.
    """
    num_layers, num_slots = phy2log.shape
    valid = phy2log >= 0
    layer_idx, slot_idx = np.nonzero(valid)  # row-major: ascending slot within a layer
    experts = phy2log[layer_idx, slot_idx]
    replica_count = np.zeros((num_layers, num_logical), dtype=np.int64)
    np.add.at(replica_count, (layer_idx, experts), 1)
    needed = int(replica_count.max()) if replica_count.size else 0
    width = needed if max_replicas is None else int(max_replicas)
    if width < needed:
        raise ValueError(f"max_replicas ({width}) is smaller than the largest replica count ({needed})")
    width = max(width, 1)
    log2phy = np.full((num_layers, num_logical, width), EMPTY, dtype=np.int64)
    # position of each slot among its expert's replicas = how many earlier slots hold it
    key = layer_idx * num_logical + experts
    order = np.argsort(key, kind="stable")
    sorted_key = key[order]
    starts = np.searchsorted(sorted_key, sorted_key, side="left")
    position = np.empty_like(order)
    position[order] = np.arange(order.size) - starts
    log2phy[layer_idx, experts, position] = slot_idx
    return log2phy, replica_count


@dataclass
class ExpertMaps:
    """The three maps of all layers, kept consistent (``phy2log`` is authoritative).

    ``allow_empty``: slots may be empty (-1), as mid scale-up or after a salvage (elastic EP); the
    maps keep the rule they were built under, so ``replace_layer`` and ``validate`` apply it.
    """

    phy2log: np.ndarray
    log2phy: np.ndarray
    replica_count: np.ndarray
    num_logical: int
    allow_empty: bool = False

    # -- construction ----------------------------------------------------
    @classmethod
    def from_phy2log(cls, phy2log, num_logical: int, max_replicas: int | None = None,
                     allow_empty: bool = False) -> "ExpertMaps":
        """Build and validate maps from an (L, P) placement."""
        p2l = _as_int64_2d(phy2log, "phy2log")
        num_logical = as_count(num_logical, "num_logical")
        if max_replicas is None:
            max_replicas = p2l.shape[1] - num_logical + 1
        else:
            max_replicas = as_count(max_replicas, "max_replicas")
        _check_range(p2l, num_logical, allow_empty)
        _check_every_expert_placed(p2l, num_logical)
        log2phy, counts = derive_log2phy(p2l, num_logical, max(max_replicas, 1))
        maps = cls(p2l, log2phy, counts, int(num_logical), bool(allow_empty))
        maps.validate()
        return maps

    @classmethod
    def initial(cls, num_layers: int, num_logical: int, num_physical: int) -> "ExpertMaps":
        """The contiguous starting placement (see ``initial_phy2log``)."""
        return cls.from_phy2log(initial_phy2log(num_layers, num_logical, num_physical), num_logical)

    # -- shape -----------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.phy2log.shape[0]

    @property
    def num_physical(self) -> int:
        return self.phy2log.shape[1]

    @property
    def max_replicas(self) -> int:
        return self.log2phy.shape[2]

    def copy(self) -> "ExpertMaps":
        return ExpertMaps(self.phy2log.copy(), self.log2phy.copy(), self.replica_count.copy(), self.num_logical,
                          self.allow_empty)

    # -- invariants ------------------------------------------------------
    def validate(self, allow_empty: bool | None = None) -> None:
        """Raise ValueError naming the broken invariant, if any (``allow_empty``: None, the maps' own rule)."""
        allow_empty = self.allow_empty if allow_empty is None else allow_empty
        L, P = self.phy2log.shape
        N = self.num_logical
        if self.log2phy.ndim != 3 or self.log2phy.shape[:2] != (L, N):
            raise ValueError(f"log2phy must have shape ({L}, {N}, K), got {self.log2phy.shape}")
        if self.replica_count.shape != (L, N):
            raise ValueError(f"replica_count must have shape ({L}, {N}), got {self.replica_count.shape}")
        _check_range(self.phy2log, N, allow_empty)
        empty = self.phy2log < 0
        if not empty.any() and P < N:
            raise ValueError(f"phy2log has {P} slots for {N} experts: every expert needs a slot")
        expect_log2phy, expect_counts = derive_log2phy(self.phy2log, N, self.max_replicas)
        if not np.array_equal(expect_counts, self.replica_count):
            bad = np.argwhere(expect_counts != self.replica_count)[0]
            raise ValueError(
                f"replica_count[{bad[0]}, {bad[1]}] = {self.replica_count[tuple(bad)]} but phy2log has "
                f"{expect_counts[tuple(bad)]} slots holding that expert"
            )
        if not np.array_equal(expect_log2phy, self.log2phy):
            bad = np.argwhere((expect_log2phy != self.log2phy).any(-1))[0]
            raise ValueError(
                f"log2phy[{bad[0]}, {bad[1]}] must list the expert's slots ascending, -1 padded: "
                f"expected {expect_log2phy[bad[0], bad[1]].tolist()}, got {self.log2phy[bad[0], bad[1]].tolist()}"
            )
        missing = self.replica_count == 0
        # an expert may be absent only in a layer that has empty slots (mid scale-up)
        layer_has_empty = empty.any(axis=1)
        if (missing & ~layer_has_empty[:, None]).any():
            bad = np.argwhere(missing & ~layer_has_empty[:, None])[0]
            raise ValueError(f"logical expert {bad[1]} has no replica in layer {bad[0]}")

    # -- updates ---------------------------------------------------------
    def replace_layer(self, layer: int, phy2log_row, allow_empty: bool | None = None) -> None:
        """Replace one layer's maps (validated first; nothing changes on error).

        ``allow_empty``: whether the row may hold empty slots (-1); None, the maps' own rule. The
        controller's commits pass True (a scale's plan empties the leaving ranks' slots); maps that take
        a row with an empty slot so allow them from then on.
        """
        allow_empty = self.allow_empty if allow_empty is None else bool(allow_empty)
        layer = as_count(layer, "layer", minimum=0)
        if layer >= self.num_layers:
            raise ValueError(f"layer must be in [0, {self.num_layers}), got {layer}")
        values = host_array(phy2log_row, "phy2log_row")
        if values.ndim != 1:  # a (2, 2) or (1, 1, P) array is some other shape, not a row to flatten
            raise ValueError(f"phy2log_row must be one row (P,), got shape {values.shape}")
        row = _as_int64(values, "phy2log_row")
        if row.shape[0] != self.num_physical:
            raise ValueError(f"phy2log_row must have {self.num_physical} slots, got {row.shape[0]}")
        # checked as the 1-D row it is, so an error names phy2log_row[j] and the layer being replaced
        _check_range(row, self.num_logical, allow_empty=allow_empty, name="phy2log_row", layer=layer)
        _check_every_expert_placed(row[None], self.num_logical, name="phy2log_row", first_layer=layer)
        log2phy, counts = derive_log2phy(row[None], self.num_logical, self.max_replicas)
        self.phy2log[layer] = row
        self.log2phy[layer] = log2phy[0]
        self.replica_count[layer] = counts[0]
        self.allow_empty = self.allow_empty or bool((row < 0).any())

    def as_torch(self, device=None):
        """(phy2log, log2phy, replica_count) as int64 torch tensors."""
        import torch

        return tuple(torch.as_tensor(a, dtype=torch.int64, device=device) for a in
                     (self.phy2log, self.log2phy, self.replica_count))

    def slots_of_rank(self, rank: int, world_size: int) -> slice:
        """The global slot range of ``rank`` (S = P / G consecutive slots)."""
        world_size = as_count(world_size, "world_size")
        if self.num_physical % world_size:
            raise ValueError(f"num_physical ({self.num_physical}) must be divisible by world_size ({world_size})")
        if as_count(rank, "rank", minimum=0) >= world_size:
            raise ValueError(f"rank must be < world_size ({world_size}), got {rank}")
        per_rank = self.num_physical // world_size
        return slice(rank * per_rank, (rank + 1) * per_rank)


def _check_every_expert_placed(phy2log: np.ndarray, num_logical: int, name: str = "phy2log",
                               first_layer: int = 0) -> None:
    """Each expert needs a slot in every layer that has no empty slot (empty = mid scale-up).

    ``phy2log`` (L, P) holds layers ``first_layer`` on (errors name those numbers).
    """
    for layer, row in enumerate(phy2log, start=first_layer):
        if (row < 0).any():
            continue
        if row.size < num_logical:
            raise ValueError(f"{name} has {row.size} slots for {num_logical} experts: every expert needs a slot")
        counts = np.bincount(row, minlength=num_logical)
        if (counts == 0).any():
            raise ValueError(
                f"{name} leaves logical expert {int(np.argmax(counts == 0))} without a replica in layer {layer}"
            )


def _check_range(phy2log: np.ndarray, num_logical: int, allow_empty: bool, name: str = "phy2log",
                 layer: int | None = None) -> None:
    """Entries in [-1, N) (``allow_empty``) or [0, N); ``phy2log`` is (L, P), or one (P,) row of ``layer``."""
    low = EMPTY if allow_empty else 0
    if phy2log.size and (phy2log.min() < low or phy2log.max() >= num_logical):
        bad = np.argwhere((phy2log < low) | (phy2log >= num_logical))[0]
        rule = f"[-1, {num_logical})" if allow_empty else f"[0, {num_logical}) (empty slots not allowed here)"
        where = "" if layer is None else f" (layer {layer})"
        raise ValueError(f"{_entry(name, bad)} = {phy2log[tuple(bad)]} is outside {rule}{where}")
