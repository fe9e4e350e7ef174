"""The baseline: docs/design.md §5 with the structure of vLLM 0.12's implementation.

:func:`reference_rebalance_experts` is what the fast :class:`~eplb_fsm.policy.default.DefaultEplbPolicy`
is checked against (tests) and timed against (``eplb-fsm bench policy``). Its structure is
the one the inference engines ship, so the benchmark's ratio is a ratio against them:

- group loads, replication, the index bookkeeping and the inverse map are whole-tensor
  torch operations over all layers (replication: one ``max`` over every row per extra slot);
- packing is the per-item part: for each row, one ``argsort`` of the weights, then a
  Python loop over the items, each going to the lightest pack with room found by ``min``.

The float32 arithmetic is the one docs/design.md §5 prescribes:

- loads are cast to float32 first; group loads are torch's float32 sum over the group;
- per-replica load = float32 load / float32 replica count;
- pack totals are float32, accumulated one item at a time in visiting order (numpy
  float32 scalars: a Python float plus a float32 scalar stays float32);
- items are visited by descending weight in a stable order (equal weights: lowest index
  first); ties between packs go to the lowest pack index (``min`` keeps the first), ties
  between experts during replication to the lowest expert index.

Do not use it on a hot path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from eplb_fsm.policy.base import check_rebalance_args

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["reference_balanced_packing", "reference_rebalance_experts", "reference_replicate_experts"]


def reference_balanced_packing(weights: list, num_packs: int) -> tuple[list[int], list[int]]:
    """Pack one row of items (float32 scalars) into ``num_packs`` packs of equal item count.

    Returns ``(pack_index, rank_in_pack)`` as lists indexed by item.
    """
    pack_index, rank_in_pack = _pack_rows(np.asarray(weights, dtype=np.float32)[None, :], num_packs)
    return pack_index[0].tolist(), rank_in_pack[0].tolist()


def _pack_rows(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Balanced packing of every row of ``weight`` (R, n) float32 -> pack_index, rank_in_pack (R, n)."""
    num_rows, num_items = weight.shape
    capacity = num_items // num_packs
    if capacity == 1:
        identity = np.broadcast_to(np.arange(num_items, dtype=np.int64), (num_rows, num_items))
        return identity.copy(), np.zeros((num_rows, num_items), dtype=np.int64)
    pack_index = np.empty((num_rows, num_items), dtype=np.int64)
    rank_in_pack = np.empty((num_rows, num_items), dtype=np.int64)
    packs = range(num_packs)
    for row in range(num_rows):
        loads = list(weight[row])  # numpy float32 scalars
        visit = np.argsort(-weight[row], kind="stable").tolist()  # ties keep index order
        # float32 totals under numpy 1's promotion rules too (there 0.0 + float32 is float64)
        totals = [np.float32(0.0)] * num_packs
        counts = [0] * num_packs
        row_pack = [0] * num_items
        row_rank = [0] * num_items
        for item in visit:
            # the lightest pack with room; min keeps the first, i.e. the lowest index, on ties
            pack = min((p for p in packs if counts[p] < capacity), key=totals.__getitem__)
            row_pack[item] = pack
            row_rank[item] = counts[pack]
            totals[pack] += loads[item]
            counts[pack] += 1
        pack_index[row] = row_pack
        rank_in_pack[row] = row_rank
    return pack_index, rank_in_pack


def reference_replicate_experts(weights: list, num_slots: int) -> tuple[list[int], list[int], list[int]]:
    """Replicate one row of experts (float32 loads) into ``num_slots`` slots.

    Returns ``(phy2log, replica_rank, replica_count)`` as lists.
    """
    import torch

    phy2log, replica_rank, count = _replicate_rows(torch.tensor([list(weights)], dtype=torch.float32), num_slots)
    return phy2log[0].tolist(), replica_rank[0].tolist(), count[0].tolist()


def _replicate_rows(weight: "torch.Tensor", num_slots: int) -> tuple["torch.Tensor", "torch.Tensor", "torch.Tensor"]:
    """Replicate every row of ``weight`` (R, n) float32 -> phy2log, replica_rank (R, p), replica_count (R, n)."""
    import torch

    num_rows, num_experts = weight.shape
    phy2log = torch.arange(num_slots, dtype=torch.int64).repeat(num_rows, 1)
    replica_rank = torch.zeros(num_rows, num_slots, dtype=torch.int64)
    count = torch.ones(num_rows, num_experts, dtype=torch.int64)
    rows = torch.arange(num_rows, dtype=torch.int64)
    for slot in range(num_experts, num_slots):
        expert = (weight / count).max(dim=-1).indices  # first maximum: lowest expert index
        phy2log[:, slot] = expert
        replica_rank[:, slot] = count[rows, expert]
        count[rows, expert] += 1
    return phy2log, replica_rank, count


def _inverse(perm: "torch.Tensor") -> "torch.Tensor":
    """Row-wise inverse permutation (R, n) -> (R, n)."""
    import torch

    inv = torch.empty_like(perm)
    inv.scatter_(1, perm, torch.arange(perm.size(1), dtype=torch.int64).expand(perm.shape))
    return inv


def reference_rebalance_experts(
    weight: "torch.Tensor",
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_ranks: int,
    old_phy2log: "torch.Tensor | None" = None,
) -> tuple["torch.Tensor", "torch.Tensor", "torch.Tensor"]:
    """Baseline with the same contract as ``DefaultEplbPolicy.rebalance_experts``.

    Returns ``(phy2log (L, P), log2phy (L, N, P-N+1), replica_count (L, N))`` int64 tensors;
    ``log2phy`` lists each expert's slots in ascending order, -1 padded.
    """
    import torch

    weight32, num_replicas, groups, nodes, num_ranks = check_rebalance_args(
        weight, num_replicas, num_groups, num_nodes, num_ranks, old_phy2log
    )
    num_layers, num_experts = weight32.shape
    group_size = num_experts // groups
    experts_per_node = num_experts // nodes
    slots_per_node = num_replicas // nodes
    slots_per_rank = num_replicas // num_ranks
    max_replicas = num_replicas - num_experts + 1

    # 1. groups onto nodes; "mlog" numbers experts node-major in the groups' arrival order.
    group_load = weight32.reshape(num_layers, groups, group_size).sum(-1)  # torch float32 sum
    group_pack, group_rank = (torch.from_numpy(a) for a in _pack_rows(group_load.numpy(), nodes))
    group_pos = group_pack * (groups // nodes) + group_rank
    log2mlog = (group_pos[:, :, None] * group_size + torch.arange(group_size)).flatten(-2)
    mlog2log = _inverse(log2mlog)
    node_load = weight32.gather(-1, mlog2log).reshape(num_layers * nodes, experts_per_node)

    # 2. replicate within each node, 3. pack each node's replicas onto its ranks.
    phy2mlog, phy_rank, mlog_count = _replicate_rows(node_load, slots_per_node)
    replica_load = (node_load / mlog_count).gather(-1, phy2mlog)
    pack, rank_in_pack = (torch.from_numpy(a) for a in _pack_rows(replica_load.numpy(), num_ranks // nodes))

    # 4. slot of every replica -> expert of every slot.
    slot_of = pack * slots_per_rank + rank_in_pack
    replica_at = _inverse(slot_of)  # (L * nodes, slots_per_node)
    node_base = (torch.arange(nodes, dtype=torch.int64) * experts_per_node).reshape(1, nodes, 1)
    mlog_at = (phy2mlog.gather(-1, replica_at).reshape(num_layers, nodes, slots_per_node) + node_base).flatten(-2)
    phy2log = mlog2log.gather(-1, mlog_at)
    replica_count = mlog_count.reshape(num_layers, num_experts).gather(-1, log2mlog)

    # 5. each expert's slots, ascending: a stable sort by expert gives them in slot order.
    expert_sorted, slot_sorted = torch.sort(phy2log, dim=-1, stable=True)
    first = (replica_count.cumsum(-1) - replica_count).gather(-1, expert_sorted)
    position = torch.arange(num_replicas, dtype=torch.int64) - first
    log2phy = torch.full((num_layers, num_experts * max_replicas), -1, dtype=torch.int64)
    log2phy.scatter_(-1, expert_sorted * max_replicas + position, slot_sorted)
    return phy2log, log2phy.reshape(num_layers, num_experts, max_replicas), replica_count
