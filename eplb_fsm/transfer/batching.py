"""Migration batching: coalesce a layer's transfers per (src, dst) pair, split into waves.

In a wave every rank talks to at most one peer (it may both send to and receive from
that peer). Waves are built by a deterministic greedy first fit: pairs are visited by
descending number of transfers, then ascending (src, dst); each goes into the first
wave where neither end already talks to somebody else. Every rank computes the same
waves from the replicated maps and runs every wave, in order, even one it has no part
in, so the per-group collective counters of the trace stay aligned.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eplb_fsm.transfer.plan import LayerTransfers

__all__ = ["Wave", "coalesce", "plan_waves", "single_wave"]


@dataclass(frozen=True)
class Wave:
    """One wave: the directed (src, dst) pairs it carries and their transfer indices."""

    pairs: tuple[tuple[int, int], ...]
    transfers: tuple[np.ndarray, ...]  # indices into the layer's LayerTransfers, per pair

    def peers_of(self, rank: int) -> list[int]:
        """The ranks ``rank`` exchanges with in this wave (ascending)."""
        peers = {d for s, d in self.pairs if s == rank} | {s for s, d in self.pairs if d == rank}
        return sorted(peers)

    def indices(self) -> np.ndarray:
        """All transfer indices of the wave, ascending (the layer's stored order)."""
        if not self.transfers:
            return np.zeros(0, dtype=np.int64)
        return np.sort(np.concatenate(self.transfers))


def coalesce(transfers: LayerTransfers) -> dict[tuple[int, int], np.ndarray]:
    """Transfer indices grouped per directed (src, dst) pair, each group ordered by expert."""
    return transfers.pairs()


def plan_waves(transfers: LayerTransfers) -> list[Wave]:
    """Split the coalesced pairs into waves where each rank talks to at most one peer."""
    groups = coalesce(transfers)
    order = sorted(groups, key=lambda pair: (-groups[pair].shape[0], pair[0], pair[1]))
    partners: list[dict[int, int]] = []  # per wave: rank -> the one peer it talks to
    members: list[list[tuple[int, int]]] = []
    for src, dst in order:
        for w, partner in enumerate(partners):
            if partner.get(src, dst) == dst and partner.get(dst, src) == src:
                break
        else:
            w = len(partners)
            partners.append({})
            members.append([])
        partners[w][src] = dst
        partners[w][dst] = src
        members[w].append((src, dst))
    waves = []
    for pairs in members:
        pairs.sort()
        waves.append(Wave(tuple(pairs), tuple(groups[p] for p in pairs)))
    return waves


def single_wave(transfers: LayerTransfers) -> list[Wave]:
    """Everything in one wave (no batching): the list is empty when nothing moves."""
    groups = coalesce(transfers)
    if not groups:
        return []
    pairs = sorted(groups)
    return [Wave(tuple(pairs), tuple(groups[p] for p in pairs))]
