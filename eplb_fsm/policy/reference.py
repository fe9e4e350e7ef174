"""The slow baseline: design section 5 written one layer and one item at a time.

:func:`reference_rebalance_experts` is what the fast :class:`~eplb_fsm.policy.default.DefaultEplbPolicy`
is checked against (tests) and timed against (``eplb-fsm bench policy``). It is written
for obviousness, not speed: plain Python loops over layers, nodes, items and packs, with
numpy float32 scalars for every load so the arithmetic is the float32 arithmetic that
section 5 prescribes:

- loads are cast to float32 first; group loads are torch's float32 sum over the group;
- per-replica load = float32 load / float32 replica count;
- pack totals are float32, accumulated one item at a time in visiting order;
- items are visited by descending weight with Python's stable sort (equal weights:
  lowest index first); ties between packs go to the lowest pack index, ties between
  experts during replication to the lowest expert index.

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
    num_items = len(weights)
    capacity = num_items // num_packs
    if capacity == 1:
        return list(range(num_items)), [0] * num_items
    visit = sorted(range(num_items), key=lambda i: -weights[i])  # stable: ties keep index order
    totals = [np.float32(0.0)] * num_packs
    counts = [0] * num_packs
    pack_index = [0] * num_items
    rank_in_pack = [0] * num_items
    for item in visit:
        best = -1
        for pack in range(num_packs):
            if counts[pack] < capacity and (best < 0 or totals[pack] < totals[best]):
                best = pack
        pack_index[item] = best
        rank_in_pack[item] = counts[best]
        counts[best] += 1
        totals[best] = totals[best] + weights[item]
    return pack_index, rank_in_pack


def reference_replicate_experts(weights: list, num_slots: int) -> tuple[list[int], list[int], list[int]]:
    """Replicate one row of experts (float32 loads) into ``num_slots`` slots.

    Returns ``(phy2log, replica_rank, replica_count)`` as lists.
    """
    num_experts = len(weights)
    phy2log = list(range(num_experts))
    replica_rank = [0] * num_experts
    count = [1] * num_experts
    per_replica = list(weights)  # load / count of every expert
    for _ in range(num_experts, num_slots):
        best = max(range(num_experts), key=per_replica.__getitem__)  # first maximum: lowest index
        phy2log.append(best)
        replica_rank.append(count[best])
        count[best] += 1
        per_replica[best] = weights[best] / np.float32(count[best])
    return phy2log, replica_rank, count


def reference_rebalance_experts(
    weight: "torch.Tensor",
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_ranks: int,
    old_phy2log: "torch.Tensor | None" = None,
) -> tuple["torch.Tensor", "torch.Tensor", "torch.Tensor"]:
    """Slow per-item baseline with the same contract as ``DefaultEplbPolicy.rebalance_experts``.

    Returns ``(phy2log (L, P), log2phy (L, N, P-N+1), replica_count (L, N))`` int64 tensors;
    ``log2phy`` lists each expert's slots in ascending order, -1 padded.
    """
    import torch

    weight32, num_replicas, groups, nodes, num_ranks = check_rebalance_args(
        weight, num_replicas, num_groups, num_nodes, num_ranks, old_phy2log
    )
    num_layers, num_experts = weight32.shape
    group_size = num_experts // groups
    slots_per_node = num_replicas // nodes
    ranks_per_node = num_ranks // nodes
    slots_per_rank = num_replicas // num_ranks
    max_replicas = num_replicas - num_experts + 1
    group_load = weight32.reshape(num_layers, groups, group_size).sum(-1).numpy()  # torch float32 sum

    out_phy2log = np.full((num_layers, num_replicas), -1, dtype=np.int64)
    out_log2phy = np.full((num_layers, num_experts, max_replicas), -1, dtype=np.int64)
    out_count = np.zeros((num_layers, num_experts), dtype=np.int64)
    for layer in range(num_layers):
        loads = [np.float32(x) for x in weight32[layer].numpy()]

        # 1. groups onto nodes; a node's experts follow its groups' arrival order.
        group_pack, group_rank = reference_balanced_packing(
            [np.float32(x) for x in group_load[layer]], nodes
        )
        node_experts: list[list[int]] = []
        for node in range(nodes):
            node_groups = sorted((group_rank[g], g) for g in range(groups) if group_pack[g] == node)
            node_experts.append([g * group_size + j for _, g in node_groups for j in range(group_size)])

        for node, experts in enumerate(node_experts):
            node_loads = [loads[e] for e in experts]
            # 2. replicate the node's experts into its slots.
            local_phy2log, _, local_count = reference_replicate_experts(node_loads, slots_per_node)
            for j, e in enumerate(experts):
                out_count[layer, e] = local_count[j]
            # 3. pack the replicas onto the node's ranks.
            replica_loads = [node_loads[j] / np.float32(local_count[j]) for j in local_phy2log]
            pack, rank_in_pack = reference_balanced_packing(replica_loads, ranks_per_node)
            for i, j in enumerate(local_phy2log):
                slot = node * slots_per_node + pack[i] * slots_per_rank + rank_in_pack[i]
                out_phy2log[layer, slot] = experts[j]

        # 4. each expert's slots, ascending.
        filled = [0] * num_experts
        for slot in range(num_replicas):
            e = int(out_phy2log[layer, slot])
            out_log2phy[layer, e, filled[e]] = slot
            filled[e] += 1

    return torch.from_numpy(out_phy2log), torch.from_numpy(out_log2phy), torch.from_numpy(out_count)
