"""The policy interface and the checks every policy shares.

A policy turns a logical load matrix into a placement:

``rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_ranks, old_phy2log=None)
-> (phy2log, log2phy, replica_count)``

- ``weight`` (L, N): tokens per logical expert per MoE layer, any real dtype, >= 0, finite.
- ``num_replicas`` P (physical slots, N <= P < 2**31, P % num_ranks == 0, and a log2phy of
  at most 2**28 entries), ``num_groups`` (expert groups of N / num_groups contiguous
  experts), ``num_nodes``, ``num_ranks`` G.
- ``old_phy2log`` (L, P_old): the placement in use, for policies that care about moving
  as little as possible; the default policy ignores it.
- ``phy2log`` (L, P) int64: logical expert held by each slot (slot p lives on rank p // (P / G)).
- ``log2phy`` (L, N, P - N + 1) int64: the slots of each expert in ascending order, -1 padded.
- ``replica_count`` (L, N) int64: number of slots holding each expert.

The signature is the one inference engines use for this algorithm, so a policy class can
move between them. Outputs are CPU tensors.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from eplb_fsm.maps import as_count, checked_int64, host_array

if TYPE_CHECKING:  # pragma: no cover
    import torch

# Pack totals are float32; keeping every layer's total below this keeps them finite.
FLOAT32_TOTAL_LIMIT = float(2.0**126)
# num_replicas must stay below this: the C placement kernels hold slot indices below 2**31.
REPLICAS_LIMIT = 2**31
# log2phy (L, N, P - N + 1) int64 may hold at most this many entries (2 GiB): about 500x
# DeepSeek-V3's, and refused before any allocation rather than failing in one (its bound
# also bounds phy2log's L * P, since N * (P - N + 1) >= P).
LOG2PHY_ENTRIES_LIMIT = 2**28


class AbstractEplbPolicy(abc.ABC):
    """Base class of placement policies; subclasses implement :meth:`rebalance_experts`.

    ``rebalance_experts`` is a classmethod, so a policy is used without an instance:
    ``DefaultEplbPolicy.rebalance_experts(weight, P, groups, nodes, G)``.
    """

    #: name under which the policy is registered (informational)
    name: ClassVar[str] = ""

    @classmethod
    @abc.abstractmethod
    def rebalance_experts(
        cls,
        weight: "torch.Tensor",
        num_replicas: int,
        num_groups: int,
        num_nodes: int,
        num_ranks: int,
        old_phy2log: "torch.Tensor | None" = None,
    ) -> tuple["torch.Tensor", "torch.Tensor", "torch.Tensor"]:
        """Return ``(phy2log (L, P), log2phy (L, N, P-N+1), replica_count (L, N))``, int64, CPU."""


def is_hierarchical(num_groups: int, num_nodes: int) -> bool:
    """True when the hierarchical mode applies (``num_groups % num_nodes == 0``)."""
    return num_groups % num_nodes == 0


def _weight_as_numpy(weight: Any) -> np.ndarray:
    """``weight`` (torch tensor, numpy array or nested lists) as a CPU numpy array, not yet checked."""
    import torch

    if isinstance(weight, torch.Tensor):
        if weight.dtype == torch.bool or weight.is_complex():
            raise ValueError(f"weight must hold real numbers, got dtype {weight.dtype}")
        return host_array(weight, "weight")
    try:
        return np.asarray(weight)
    except Exception as exc:  # noqa: BLE001 - any conversion failure is a bad argument
        raise ValueError(f"weight must be a tensor of shape (layers, experts): {exc}") from None


def checked_float32(weight: np.ndarray) -> np.ndarray:
    """A real (L, N) ``weight`` as a contiguous, writable float32 array, checked finite, >= 0
    and with every layer's total below :data:`FLOAT32_TOTAL_LIMIT`; ``ValueError`` otherwise.

    The checks run in numpy, single-threaded: torch's element-wise ops hand inputs past
    ~32K elements to its thread pool, whose dispatch costs more than the work here. The
    common case is two reductions (a min, the row totals) and no temporary array.
    """
    if weight.dtype.kind in "iu":
        # Any integer is finite in float32 (|x| < 2**64 < 3.4e38), and a layer's total stays
        # below N * 2**64 < 2**126: only the sign needs a look, taken on the float32 copy
        # (same signs, half the bytes, a vectorised min).
        weight32 = np.ascontiguousarray(weight, dtype=np.float32)
        if weight.dtype.kind == "i" and weight32.size and weight32.min() < 0:
            raise ValueError("weight must be non-negative, found negative loads")
    else:
        if weight.dtype.itemsize > 4:
            with np.errstate(over="ignore"):  # an overflow to inf is reported below
                weight32 = np.ascontiguousarray(weight, dtype=np.float32)
        else:
            weight32 = np.ascontiguousarray(weight, dtype=np.float32)
        # min >= 0 is False for a NaN or a negative load; with every load >= 0, a total below
        # the limit also rules out an infinite load (before or after the float32 cast).
        if not (weight.min() >= 0 and weight32.sum(axis=-1, dtype=np.float64).max() < FLOAT32_TOTAL_LIMIT):
            _raise_bad_float_weight(weight, weight32)
        # -0.0 passes ">= 0" but keeps its sign bit, and the packing keys are read from the
        # float32 bits of the loads: one int32 min finds it, and only then is the array
        # copied (weight32 may be the caller's own buffer, not ours to rewrite).
        if weight32.view(np.int32).min() < 0:
            weight32 = weight32 + np.float32(0.0)  # -0.0 + 0.0 == +0.0
    if not weight32.flags.writeable:
        weight32 = weight32.copy()  # torch.from_numpy wants a writable buffer
    return weight32


def _raise_bad_float_weight(weight: np.ndarray, weight32: np.ndarray) -> None:
    """Raise the ``ValueError`` that names what is wrong with a float ``weight`` that failed the fast check."""
    if not np.isfinite(weight).all():
        bad = "NaN" if np.isnan(weight).any() else "infinite"
        raise ValueError(f"weight must be finite, found {bad} loads")
    if (weight < 0).any():
        raise ValueError("weight must be non-negative, found negative loads")
    raise ValueError("weight: each layer's total load must fit in float32 (below 2**126)")


def check_rebalance_args(
    weight: Any,
    num_replicas: Any,
    num_groups: Any,
    num_nodes: Any,
    num_ranks: Any,
    old_phy2log: Any = None,
) -> tuple["torch.Tensor", int, int, int, int]:
    """Validate the arguments of ``rebalance_experts`` before any work is done.

    Returns ``(weight32, P, groups, nodes, G)`` where ``weight32`` is the load cast to a
    contiguous CPU float32 tensor (L, N) and groups/nodes are the effective values
    (1, 1 when the hierarchical mode does not apply). Raises ``ValueError`` naming the
    argument and the rule it breaks.
    """
    import torch

    num_replicas = as_count(num_replicas, "num_replicas", minimum=None)  # its rule (>= N) needs the weight
    if num_replicas >= REPLICAS_LIMIT:
        raise ValueError(f"num_replicas must be below 2**31 (the placement kernels' slot indices), got {num_replicas}")
    num_groups = as_count(num_groups, "num_groups")
    num_nodes = as_count(num_nodes, "num_nodes")
    num_ranks = as_count(num_ranks, "num_ranks")

    weight = _weight_as_numpy(weight)
    if weight.ndim != 2:
        raise ValueError(
            f"weight must be 2-D (layers, experts), got shape {tuple(weight.shape)}"
        )
    num_layers, num_experts = weight.shape
    if num_layers == 0 or num_experts == 0:
        raise ValueError(f"weight must have at least one layer and one expert, got shape {tuple(weight.shape)}")
    if weight.dtype.kind not in "iuf":  # bool, complex, object, str, datetime ...
        raise ValueError(f"weight must hold real numbers, got dtype {weight.dtype}")
    weight32 = torch.from_numpy(checked_float32(weight))

    if num_replicas < num_experts:
        raise ValueError(
            f"num_replicas must be >= the number of experts ({num_experts}), got {num_replicas}"
        )
    entries = num_layers * num_experts * (num_replicas - num_experts + 1)
    if entries > LOG2PHY_ENTRIES_LIMIT:
        raise ValueError(
            f"num_replicas ({num_replicas}) is too large for {num_layers} layers of {num_experts} experts: log2phy "
            f"(layers, experts, num_replicas - experts + 1) would hold {entries} entries, more than 2**28"
        )
    if num_replicas % num_ranks != 0:
        raise ValueError(
            f"num_replicas ({num_replicas}) must be divisible by num_ranks ({num_ranks})"
        )
    if is_hierarchical(num_groups, num_nodes):
        if num_experts % num_groups != 0:
            raise ValueError(
                f"num_groups ({num_groups}) must divide the number of experts ({num_experts}) "
                "in hierarchical mode (num_groups % num_nodes == 0)"
            )
        if num_ranks % num_nodes != 0:
            raise ValueError(
                f"num_ranks ({num_ranks}) must be divisible by num_nodes ({num_nodes}) "
                "in hierarchical mode (num_groups % num_nodes == 0)"
            )
        groups, nodes = num_groups, num_nodes
    else:
        groups, nodes = 1, 1

    if old_phy2log is not None:
        try:  # in numpy: torch has no min() for uint16/32/64, and a ragged list fails in numpy's words
            old = host_array(old_phy2log, "old_phy2log")
        except (TypeError, ValueError) as exc:
            raise ValueError(f"old_phy2log must be a 2-D integer array or tensor: {exc}") from None
        if old.ndim != 2 or old.shape[0] != num_layers:
            raise ValueError(
                f"old_phy2log must be 2-D with {num_layers} rows (layers), got shape {tuple(old.shape)}"
            )
        if old.dtype.kind not in "iu":
            raise ValueError(f"old_phy2log must hold integers, got dtype {old.dtype}")
        if old.size and (int(old.min()) < -1 or int(old.max()) >= num_experts):
            raise ValueError(f"old_phy2log entries must be in [-1, {num_experts}), got out-of-range values")

    return weight32, num_replicas, groups, nodes, num_ranks


def build_log2phy(phy2log: np.ndarray, num_experts: int, max_replicas: int) -> tuple[np.ndarray, np.ndarray]:
    """Invert a placement.

    ``phy2log`` (L, P) int, -1 for an empty slot -> ``(log2phy (L, N, max_replicas),
    replica_count (L, N))`` int64, where ``log2phy[l, e]`` lists the slots holding expert
    ``e`` in ascending order, padded with -1. Raises ``ValueError`` for entries outside
    [-1, N) or an expert with more than ``max_replicas`` slots.
    """
    phy2log = checked_int64(phy2log, "phy2log")  # a uint64 2**64 - 1 must not wrap to -1 (an empty slot)
    num_layers, num_slots = phy2log.shape
    if phy2log.size and (int(phy2log.min()) < -1 or int(phy2log.max()) >= num_experts):
        raise ValueError(f"phy2log entries must be in [-1, {num_experts})")
    # Expert of every slot, with empty slots as a pseudo-expert N that is dropped at the end.
    expert = np.where(phy2log >= 0, phy2log, num_experts)
    width = num_experts + 1
    layer_expert = expert + (np.arange(num_layers, dtype=np.int64) * width)[:, None]
    counts = np.bincount(layer_expert.reshape(-1), minlength=num_layers * width).astype(np.int64)
    replica_count = counts.reshape(num_layers, width)[:, :num_experts]
    if replica_count.size and int(replica_count.max()) > max_replicas:
        raise ValueError(
            f"an expert has {int(replica_count.max())} replicas, more than max_replicas={max_replicas}"
        )
    # Sort (expert, slot) keys per layer: slots come out grouped by expert, ascending.
    key = (expert << 32) | np.arange(num_slots, dtype=np.int64)
    key.sort(axis=1)
    slot = (key & 0xFFFFFFFF).reshape(-1)
    group = ((key >> 32) + (np.arange(num_layers, dtype=np.int64) * width)[:, None]).reshape(-1)
    starts = np.cumsum(counts) - counts  # first sorted position of each (layer, expert)
    position = np.arange(group.size, dtype=np.int64) - starts[group]
    target = (group - group // width) * max_replicas + position  # (layer * N + expert) * K + position
    log2phy = np.full(num_layers * num_experts * max_replicas, -1, dtype=np.int64)
    if counts.reshape(num_layers, width)[:, num_experts].any():
        keep = (group % width) < num_experts
        log2phy[target[keep]] = slot[keep]
    else:
        log2phy[target] = slot
    return log2phy.reshape(num_layers, num_experts, max_replicas), np.ascontiguousarray(replica_count)
