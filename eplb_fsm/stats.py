"""Load statistics: the per-pass load, the sliding window, logical aggregation.

Shapes: L layers, P physical slots, N logical experts, W window passes, G ranks.

- ``load_pass``   (L, P) int64 tensor: tokens per slot in the current forward pass;
  the model adds into it, ``record_pass`` moves it into the window and zeroes it.
- ``window``      (W, L, P) int64 tensor: ring buffer of the last W counted passes.
- logical load    (L, N): the window estimate scattered from slots to their experts
  (the controller all-reduces it over ranks).
- rank load       (L, G): the load of every rank (:func:`rank_loads_physical`);
  :func:`balancedness` scores it (the one definition of balancedness in the package).

Everything here is local to one rank; nothing talks to other ranks.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import torch

from eplb_fsm.maps import as_count, as_finite_float, checked_int64, host_array

__all__ = ["ESTIMATORS", "LoadWindow", "RemapPlan", "aggregate_logical", "balancedness", "checked_loads64",
           "load_fault", "rank_loads_physical"]

ESTIMATORS = ("window_sum", "decayed_sum", "subwindow_max")


class LoadWindow:
    """The per-pass load and the ring buffer of the last ``window_size`` counted passes."""

    def __init__(self, num_layers: int, num_physical: int, window_size: int, device=None) -> None:
        self.num_layers = num_layers = as_count(num_layers, "num_layers")
        self.num_physical = num_physical = as_count(num_physical, "num_physical")
        self.window_size = window_size = as_count(window_size, "window_size")
        self.load_pass = torch.zeros((num_layers, num_physical), dtype=torch.int64, device=device)
        self.window = torch.zeros((window_size, num_layers, num_physical), dtype=torch.int64, device=device)
        self.next_index = 0  # ring position the next counted pass goes to
        self.filled = 0      # counted passes held, <= window_size
        # True from a rearrangement started outside a step (``rearrange()``, after a forward)
        # until the pass is recorded: ``load_pass`` may then hold counts in the placement a
        # commit replaces, so each commit carries them over too (:meth:`remap_layer`)
        self.pass_open = False

    def record_pass(self, is_dummy: bool = False) -> None:
        """Move this pass's load into the window (unless dummy) and zero ``load_pass``.

        Dummy passes (padding steps with no real tokens) never enter the window, but
        ``load_pass`` is still cleared so their counts can't leak into the next pass.
        """
        if is_dummy is not False and is_dummy is not True and not isinstance(is_dummy, np.bool_):
            # as controller.step refuses it: "no" or None read by truth would record or drop a pass silently
            raise ValueError(f"is_dummy must be a bool, got {type(is_dummy).__name__} {is_dummy!r}")
        if not is_dummy:
            self.window[self.next_index].copy_(self.load_pass)
            self.next_index = (self.next_index + 1) % self.window_size
            if self.filled < self.window_size:
                self.filled += 1
        self.load_pass.zero_()
        self.pass_open = False

    def reset(self) -> None:
        """Forget every recorded pass."""
        self.window.zero_()
        self.load_pass.zero_()
        self.next_index = 0
        self.filled = 0
        self.pass_open = False

    def passes_oldest_first(self) -> torch.Tensor:
        """The held passes in arrival order: (filled, L, P)."""
        if self.filled < self.window_size:
            return self.window[: self.filled]
        return torch.roll(self.window, shifts=-self.next_index, dims=0)

    def physical_load(self) -> torch.Tensor:
        """Window sum per slot: (L, P) int64."""
        return self.window.sum(dim=0)

    def estimate(self, estimator: str = "window_sum", decay: float = 0.9, subwindows: int = 4) -> torch.Tensor:
        """Per-slot planning load (L, P) float64 from the window.

        ``window_sum`` sums the window; ``decayed_sum`` weighs a pass of age a (0 =
        newest) by decay**a; ``subwindow_max`` splits the window into ``subwindows``
        consecutive parts and takes, per slot, the largest part's mean per pass times the
        passes held (so its scale matches the plain sum, also when the parts' lengths
        differ by one); it plans for the worst recent burst.
        """
        if estimator not in ESTIMATORS:
            raise ValueError(f"estimator must be one of {', '.join(ESTIMATORS)}, got {estimator!r}")
        rule = "a number in (0, 1] (config.load_decay's rule)"
        # as the config reads it: numpy floats pass, a bool or 10**400 is a ValueError, not a TypeError
        decay = as_finite_float(decay, "decay", rule)
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be {rule}, got {decay!r}")
        subwindows = as_count(subwindows, "subwindows")
        passes = self.passes_oldest_first().to(torch.float64)
        if passes.shape[0] == 0:
            return torch.zeros((self.num_layers, self.num_physical), dtype=torch.float64, device=self.window.device)
        if estimator == "window_sum":
            return passes.sum(0)
        if estimator == "decayed_sum":
            ages = torch.arange(passes.shape[0] - 1, -1, -1, dtype=torch.float64, device=passes.device)
            return torch.einsum("w,wlp->lp", decay ** ages, passes)
        parts = torch.tensor_split(passes, min(subwindows, passes.shape[0]), dim=0)
        held = passes.shape[0]
        # per-pass means scaled to the window: a short part's burst counts as much as a long one's
        return torch.stack([part.sum(0) * (held / part.shape[0]) for part in parts]).max(0).values

    def remap_layer(self, layer: int, old_row: np.ndarray, new_row: np.ndarray, num_logical: int) -> None:
        """Re-express one layer's held passes in a new placement, keeping each expert's total.

        Called when a layer's maps change so the window keeps describing expert load:
        each pass's per-expert count is spread over the expert's new slots (the
        remainder goes to its first slot), so logical sums are unchanged exactly.
        ``layer`` in [0, L); both rows (P,) with entries in [-1, ``num_logical``) (``RemapPlan.of``); a
        ``ValueError`` naming the argument otherwise, before anything changes.
        """
        layer = as_count(layer, "layer", minimum=0)
        if layer >= self.num_layers:
            raise ValueError(f"layer must be in [0, {self.num_layers}), got {layer}")
        plan = RemapPlan.of(old_row, new_row, num_logical, self.window.device, num_slots=self.num_physical)
        pass_row = self.remapped_pass(layer, plan, num_logical)  # checked first: nothing changes if it raises
        self.window[:, layer, :] = plan.apply(self.window[:, layer, :], num_logical)
        if pass_row is not None:
            self.load_pass[layer] = pass_row

    def remapped_pass(self, layer: int, plan: "RemapPlan", num_logical: int) -> torch.Tensor | None:
        """``load_pass[layer]`` (P,) in ``plan``'s new placement while :attr:`pass_open`, else None
        (the pass was recorded and zeroed); changes nothing."""
        if not self.pass_open:
            return None
        return plan.apply(self.load_pass[layer].unsqueeze(0), num_logical)[0]


class RemapPlan(NamedTuple):
    """How one layer's per-slot counts move from an old placement to a new one; tensors on one device.

    Depends on the two (P,) rows alone, so it can be built ahead (on the async worker) and
    applied to the window later (:meth:`apply`). Each pass's count of an expert (the sum
    over its old slots) is split over its new slots: count // replicas each, the
    remainder to its first new slot; an empty slot gets 0. :meth:`apply` works with slots
    along rows (the window's (W, P) transposed), so every gather copies whole rows, and
    divides only the experts that have more than one new slot (index vectors below).
    """

    base: torch.Tensor           # (N + 1,) per expert, its first old slot (P: none); last entry P
    extra_slots: torch.Tensor    # (X,) old slots after their expert's first
    extra_experts: torch.Tensor  # (X,) their experts
    gather: torch.Tensor         # (P,) each new slot's expert (N: an empty slot, the zero row)
    multi_slots: torch.Tensor    # (M,) new slots whose expert has several
    multi_experts: torch.Tensor  # (M,) their experts
    multi_divisor: torch.Tensor  # (M, 1) that expert's new replica count
    multi_first: torch.Tensor    # (M, 1) 1 where the slot is its expert's first (it takes the remainder)
    dropped: torch.Tensor        # (D,) experts with no slot in the new row

    @classmethod
    def of(cls, old_row: Any, new_row: Any, num_logical: int, device: Any = None,
           num_slots: int | None = None) -> "RemapPlan":
        """The plan from ``old_row`` to ``new_row`` (P,) integer placements, -1 for an empty slot.

        ``ValueError`` naming the row unless both are 1-D integer rows of one length (``num_slots`` when
        given) with entries in [-1, ``num_logical``): a short row would drop its missing slots' counts.
        """
        n = as_count(num_logical, "num_logical")
        old, new = (_checked_row(row, name, n) for row, name in ((old_row, "old_row"), (new_row, "new_row")))
        if num_slots is not None and new.size != num_slots:
            raise ValueError(f"new_row must have {num_slots} slots (the window's), got {new.size}")
        if old.size != new.size:
            raise ValueError(f"old_row and new_row must have one length, got {old.size} and {new.size}")
        p = new.size
        slots = np.arange(old.size)
        old_valid = old >= 0
        first_old = np.full(n + 1, old.size, dtype=np.int64)   # row old.size is apply's zero row
        np.minimum.at(first_old, old[old_valid], slots[old_valid])
        extra = old_valid & (slots != first_old[np.where(old_valid, old, n)])
        valid = new >= 0
        counts = np.bincount(new[valid], minlength=n)[:n]
        first_new = np.full(n, p, dtype=np.int64)
        np.minimum.at(first_new, new[valid], np.arange(p)[valid])
        multi = valid & (counts[np.where(valid, new, 0)] > 1)
        multi_experts = new[multi]
        as_t = lambda a: torch.as_tensor(np.ascontiguousarray(a), dtype=torch.int64, device=device)  # noqa: E731
        return cls(as_t(first_old), as_t(slots[extra]), as_t(old[extra]), as_t(np.where(valid, new, n)),
                   as_t(np.flatnonzero(multi)), as_t(multi_experts), as_t(counts[multi_experts].reshape(-1, 1)),
                   as_t((np.flatnonzero(multi) == first_new[multi_experts]).reshape(-1, 1)),
                   as_t(np.flatnonzero(counts == 0)))

    def apply(self, counts: torch.Tensor, num_logical: int) -> torch.Tensor:
        """``counts`` (W, P) in the old placement -> (W, P) in the new one; changes nothing.

        Returns a transposed view of a new (P, W) tensor. Raises ``ValueError`` if the new
        row leaves out an expert that has counts. ``num_logical`` is N, which the plan
        already holds (``base`` has N + 1 entries); callers pass it as they always have.
        """
        num_slots, width = counts.shape[1], counts.shape[0]
        by_slot = torch.empty((num_slots + 1, width), dtype=counts.dtype, device=counts.device)
        by_slot[:num_slots].copy_(counts.t())
        by_slot[num_slots].zero_()
        logical = by_slot.index_select(0, self.base)                           # (N + 1, W), last row 0
        if self.extra_slots.numel():
            logical.index_add_(0, self.extra_experts, by_slot.index_select(0, self.extra_slots))
        if self.dropped.numel() and bool(logical.index_select(0, self.dropped).any()):
            raise ValueError("new_row drops an expert that has recorded load")
        out = logical.index_select(0, self.gather)                             # (P, W)
        if self.multi_slots.numel():
            held = logical.index_select(0, self.multi_experts)
            share = torch.div(held, self.multi_divisor, rounding_mode="floor")
            out.index_copy_(0, self.multi_slots, share + (held - share * self.multi_divisor) * self.multi_first)
        return out.t()


def _checked_row(row: Any, name: str, num_logical: int) -> np.ndarray:
    """One placement row (P,) as int64, entries in [-1, ``num_logical``); ``ValueError`` naming ``name``."""
    values = host_array(row, name)
    if values.ndim != 1:
        raise ValueError(f"{name} must be one row (P,), got shape {values.shape}")
    values = checked_int64(values, name)
    if values.size and (values.min() < -1 or values.max() >= num_logical):
        j = int(np.flatnonzero((values < -1) | (values >= num_logical))[0])
        raise ValueError(f"{name}[{j}] = {values[j]} is outside [-1, {num_logical}) (-1: an empty slot)")
    return values


def aggregate_logical(physical: torch.Tensor, phy2log: torch.Tensor, num_logical: int) -> torch.Tensor:
    """Scatter a per-slot load (L, P) to its logical experts: (L, N), same dtype.

    Empty slots (-1) carry no load. A ``phy2log`` that is not integer, or names an expert
    outside [-1, ``num_logical``), is refused (``ValueError``) rather than cast or skipped; so is a
    ``physical`` that is no (L, P) tensor of numbers, and an integer sum that its dtype cannot hold.
    """
    num_logical = as_count(num_logical, "num_logical")
    if not isinstance(physical, torch.Tensor):
        raise ValueError(f"physical must be a torch.Tensor (L, P), got {type(physical).__name__}")
    if physical.is_meta or physical.dtype == torch.bool or physical.is_complex() or physical.ndim != 2:
        got = "a meta tensor" if physical.is_meta else f"dtype {physical.dtype}, shape {tuple(physical.shape)}"
        raise ValueError(f"physical must be a 2-D (L, P) tensor of real numbers with data, got {got}")
    phy2log = torch.as_tensor(phy2log)
    if phy2log.is_floating_point() or phy2log.is_complex() or phy2log.dtype == torch.bool:
        raise ValueError(f"phy2log must hold integers, got dtype {phy2log.dtype}")
    if phy2log.is_meta:
        raise ValueError("phy2log must hold data: a tensor on the 'meta' device has none")
    if phy2log.dtype == torch.uint64:   # .to(int64) would wrap 2**64 - 1 to -1, an empty slot
        phy2log = torch.from_numpy(checked_int64(phy2log, "phy2log")).to(physical.device)
    phy2log = phy2log.to(torch.int64)
    if physical.shape != phy2log.shape:
        raise ValueError(f"load shape {tuple(physical.shape)} does not match phy2log shape {tuple(phy2log.shape)}")
    if phy2log.numel() and (int(phy2log.min()) < -1 or int(phy2log.max()) >= num_logical):
        raise ValueError(f"phy2log entries must be in [-1, {num_logical}) (-1: an empty slot)")
    valid = phy2log >= 0
    narrow = not physical.is_floating_point() and physical.dtype != torch.int64
    wide = physical.to(torch.int64) if narrow else physical   # a narrow integer sum is checked, never wrapped
    out = torch.zeros((physical.shape[0], num_logical), dtype=wide.dtype, device=physical.device)
    out.scatter_add_(1, phy2log.clamp(min=0), torch.where(valid, wide, torch.zeros_like(wide)))
    if narrow:
        info = torch.iinfo(physical.dtype)
        if out.numel() and (int(out.max()) > info.max or int(out.min()) < info.min):
            raise ValueError(f"the logical sums of physical overflow its dtype {physical.dtype} (largest "
                             f"{info.max}); pass a wider integer dtype")
        out = out.to(physical.dtype)
    return out


def rank_loads_physical(physical: torch.Tensor, world_size: int) -> torch.Tensor:
    """Per-rank load (L, G) from a per-slot load (L, P): each rank's S = P / G slots summed.

    ``ValueError`` naming ``world_size`` unless it is an integer >= 1 (not a bool or 2.0) dividing P.
    """
    world_size = as_count(world_size, "world_size")
    L, P = physical.shape
    if world_size < 1 or P % world_size:
        raise ValueError(f"slots ({P}) must be divisible by world_size ({world_size})")
    return physical.reshape(L, world_size, P // world_size).sum(-1)


def balancedness(rank_loads: Any) -> float:
    """How evenly the load spreads over the ranks: sum over layers of the mean rank load
    divided by sum over layers of the max rank load (1.0 = perfect; no load at all = 1.0).

    ``rank_loads``: ``(L, G)`` per-rank loads of L layers, or ``(G,)`` for one layer; a
    numpy array, torch tensor or nested list of real numbers, computed in float64. Means
    and maxima are taken over ranks (the last axis) per layer, then summed over layers, so
    a heavy layer weighs more than a light one. Several models sharing the ranks:
    concatenate their ``(L_m, G)`` loads along the layer axis. ``ValueError`` naming
    ``rank_loads`` for any other shape, and for what :func:`checked_loads64` refuses.
    """
    loads = checked_loads64(rank_loads, "rank_loads")
    if loads.ndim == 1:
        loads = loads[None, :]
    if loads.ndim != 2 or loads.shape[1] < 1:
        raise ValueError(f"rank_loads must be shaped (G,) or (L, G) with G >= 1 ranks, got shape {loads.shape}")
    total_max = float(loads.max(axis=1).sum())
    return float(loads.mean(axis=1).sum() / total_max) if total_max > 0 else 1.0


def checked_loads64(values: Any, name: str) -> np.ndarray:
    """``values`` (a numpy array, torch tensor or nested lists, any shape) as a float64 numpy array of loads.

    ``ValueError`` naming ``name`` unless the dtype is a real number type (not bool, complex,
    strings or objects), every load is finite and >= 0 (:func:`load_fault`), and the total
    of all loads (summed along the last axis, then over the rest) is finite in float64.
    Any sum, mean or maximum over some of the loads is at most that total, so a finite one
    keeps them finite: two loads of 1e308 are each finite but their sum is not, and their
    balancedness would come out inf or NaN.
    """
    arr = host_array(values, name)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.number) or np.iscomplexobj(arr):
        raise ValueError(f"{name} must hold real numbers (not bools), got dtype {arr.dtype}")
    arr = arr.astype(np.float64)
    fault = load_fault(arr)
    if fault is not None:
        raise ValueError(f"{name} must hold finite loads >= 0, got {fault}")
    with np.errstate(over="ignore"):  # an overflow is the error raised below, not a warning
        total = arr.sum(axis=-1).sum() if arr.ndim else arr
    if not np.isfinite(total):
        raise ValueError(f"{name}: the loads of each row, and of all rows together, must sum to a finite "
                         f"float64 (below about 1.8e308)")
    return arr


def load_fault(loads: Any) -> str | None:
    """Why ``loads`` (any shape; a numpy array or torch tensor) are not all finite and >= 0, or None.

    The reason names the first rule broken: ``"NaN in the load"``, ``"infinite load"`` or
    ``"negative load (min <m>)"``. Empty loads break no rule.
    """
    if isinstance(loads, torch.Tensor):
        loads = loads.detach().cpu().numpy()
    arr = np.asarray(loads, dtype=np.float64)
    if arr.size == 0:
        return None
    low, high = float(arr.min()), float(arr.max())   # a NaN anywhere makes both NaN
    if low >= 0 and math.isfinite(high):
        return None
    if math.isnan(low):
        return "NaN in the load"
    if not (math.isfinite(low) and math.isfinite(high)):
        return "infinite load"
    return f"negative load (min {low})"
