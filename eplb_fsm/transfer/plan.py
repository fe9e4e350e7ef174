"""Pure per-layer transfer planning: numpy in, numpy out, no process groups.

Vocabulary (docs/design.md §2, §6.1-§6.2). A layer has P physical slots spread over G ranks, S = P / G
slots per rank; global slot p lives on rank p // S at row p % S. ``old`` and ``new`` are
the layer's ``phy2log`` rows before and after, int64, -1 for an empty slot.

For one rank, every row falls in exactly one class:

- *empty*: the new map leaves the slot empty (-1); its weights are left as they are;
- *unchanged*: it keeps its expert;
- *local*: its new expert is already on this rank in the old map; it is filled from the
  first old row of this rank holding that expert. The executor copies it weights to
  weights at commit, in an order that reads each row before overwriting it; only one row
  per in-rank cycle has its source staged in the buffer (:mod:`.local_copies`);
- *primary*: the first row of this rank needing an expert this rank does not hold; it
  receives that expert from one peer;
- *duplicate*: a further row needing the same remote expert; it is copied from the
  primary after the transfer.

Pairing (docs/design.md §6.2): an expert held by S_e ranks (senders) in the old map and needed by R_e
ranks that do not hold it (receivers), both ascending, with k = R_e // S_e: sender i
serves receivers i·k … i·k+k−1, plus receiver S_e·k+i if it exists. A sender sends
from its first old row holding the expert; a receiver receives into its primary row.
Every rank derives the same pairs from the replicated maps.

Within a (src, dst) pair transfers are ordered by expert id; both ends post their
messages in that order, which is what lets point-to-point messages match.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from eplb_fsm.maps import as_count, host_array

__all__ = [
    "LayerTransfers",
    "LayerPlan",
    "layer_transfers",
    "plan_layer",
    "plan_layer_all_ranks",
    "plan_from_transfers",
    "moved_slots",
    "check_layer_maps",
]

_EMPTY = np.zeros(0, dtype=np.int64)


def read_only(a: np.ndarray) -> np.ndarray:
    """A contiguous int64 copy (or view) of ``a`` (any shape) that refuses writes: plans are shared."""
    if not (a.dtype == np.int64 and a.flags.c_contiguous):
        a = np.ascontiguousarray(a, dtype=np.int64)
    a.flags.writeable = False
    return a


@dataclass(frozen=True)
class LayerTransfers:
    """Every point-to-point transfer of one layer, all ranks, sorted by (src, dst, expert)."""

    world_size: int
    slots_per_rank: int
    src: np.ndarray  # (T,) sending rank
    dst: np.ndarray  # (T,) receiving rank
    expert: np.ndarray  # (T,) logical expert
    src_row: np.ndarray  # (T,) row on the sender (its first old row holding the expert)
    dst_row: np.ndarray  # (T,) row on the receiver (its primary row for the expert)

    def __len__(self) -> int:
        return int(self.src.shape[0])

    def pairs(self) -> dict[tuple[int, int], np.ndarray]:
        """Indices of the transfers of each (src, dst) pair, in the stored order."""
        out: dict[tuple[int, int], np.ndarray] = {}
        n = len(self)
        if n == 0:
            return out
        # transfers are sorted by (src, dst, expert): equal pairs are contiguous. A layer
        # holds few transfers, so one pass over Python ints beats a chain of numpy calls.
        src, dst = self.src.tolist(), self.dst.tolist()
        idx = np.arange(n)
        a = 0
        for b in range(1, n + 1):
            if b == n or src[b] != src[a] or dst[b] != dst[a]:
                out[(src[a], dst[a])] = idx[a:b]
                a = b
        return out


@dataclass(frozen=True)
class LayerPlan:
    """What one rank does for one layer. All fields are read-only int64 arrays of rows."""

    rank: int
    world_size: int
    slots_per_rank: int
    empty_rows: np.ndarray
    unchanged_rows: np.ndarray
    local_rows: np.ndarray  # rows filled from this rank's own old rows
    local_src_rows: np.ndarray  # the old row each local row copies (same length)
    primary_rows: np.ndarray  # ascending; one per remote expert needed
    primary_experts: np.ndarray  # the expert each primary row receives
    duplicate_rows: np.ndarray
    duplicate_src_rows: np.ndarray  # the primary row each duplicate copies
    send_peers: np.ndarray  # sends, ordered by (peer, expert)
    send_experts: np.ndarray
    send_rows: np.ndarray  # the old row each send reads
    recv_peers: np.ndarray  # receives, ordered by (peer, expert)
    recv_experts: np.ndarray
    recv_rows: np.ndarray  # the buffer row (= primary row) each receive fills

    @property
    def num_sends(self) -> int:
        return int(self.send_peers.shape[0])

    @property
    def num_recvs(self) -> int:
        return int(self.recv_peers.shape[0])

    @property
    def is_noop(self) -> bool:
        """True when this rank neither copies, sends nor receives anything."""
        return (
            self.local_rows.size == 0
            and self.primary_rows.size == 0
            and self.duplicate_rows.size == 0
            and self.send_peers.size == 0
        )


# ---------------------------------------------------------------------------------------
# validation


def _as_row(name: str, row: Any) -> np.ndarray:
    arr = host_array(row, name)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{name}: must be an integer array (int64 phy2log), got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name}: must be one layer's phy2log row of shape (P,), got shape {arr.shape}")
    return as_int64(name, arr)


def as_int64(name: str, arr: np.ndarray) -> np.ndarray:
    """An integer map as int64; ``ValueError`` naming ``name`` for an unsigned value int64 cannot hold,
    which the cast would wrap to a negative id (2**64 - 1 would read as -1, an empty slot)."""
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{name}: entries must be in [-1, P), got {int(arr.max())}")
    return arr.astype(np.int64, copy=False)


def check_layer_maps(old: Any, new: Any, world_size: int, what: str = "") -> tuple[np.ndarray, np.ndarray]:
    """Validate one layer's (old, new) rows for ``world_size``; return them as int64 arrays.

    Rules: same shape (P,), integer dtype, P % world_size == 0, values in [-1, P), and every
    expert of the new row is held by some rank in the old row. Raises ``ValueError``
    naming the field and the rule.
    """
    old = _as_row(f"old_phy2log{what}", old)
    new = _as_row(f"new_phy2log{what}", new)
    if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)) or world_size < 1:
        raise ValueError(f"world_size: must be a positive int, got {world_size!r}")
    if old.shape != new.shape:
        raise ValueError(
            f"new_phy2log{what}: shape {new.shape} must equal old_phy2log's {old.shape}"
        )
    p = old.shape[0]
    if p % world_size != 0:
        raise ValueError(f"phy2log{what}: P={p} slots must divide by world_size={world_size} (P % G == 0)")
    for name, row in (("old_phy2log", old), ("new_phy2log", new)):
        if row.size and (row.min() < -1 or row.max() >= p):
            bad = row[(row < -1) | (row >= p)][0]
            raise ValueError(f"{name}{what}: expert ids must be -1 (empty) or in [0, P={p}), found {int(bad)}")
    missing = np.setdiff1d(new[new >= 0], old[old >= 0])
    if missing.size:
        raise ValueError(
            f"new_phy2log{what}: expert {int(missing[0])} is needed but held by no rank in old_phy2log"
            " (every needed expert must have a sender)"
        )
    return old, new


# ---------------------------------------------------------------------------------------
# planning


def _first_rows(m: np.ndarray, num_experts: int) -> np.ndarray:
    """(G, E): the first row of each rank holding each expert in ``m`` (G, S); -1 if none."""
    g, s = m.shape
    first = np.full((g, num_experts), -1, dtype=np.int64)
    ranks = np.arange(g)
    for row in range(s - 1, -1, -1):  # later rows first: earlier rows overwrite them
        col = m[:, row]
        ok = col >= 0
        first[ranks[ok], col[ok]] = row
    return first


def layer_transfers(old: Any, new: Any, world_size: int, *, validate: bool = True) -> LayerTransfers:
    """All point-to-point transfers of one layer (every rank's), by the pairing rule of docs/design.md §6.2."""
    if validate:
        old, new = check_layer_maps(old, new, world_size)
    else:
        old = np.asarray(old, dtype=np.int64)
        new = np.asarray(new, dtype=np.int64)
    g = int(world_size)
    s = old.shape[0] // g
    num_experts = int(max(old.max(initial=-1), new.max(initial=-1))) + 1
    if num_experts == 0:
        return LayerTransfers(g, s, _EMPTY, _EMPTY, _EMPTY, _EMPTY, _EMPTY)
    old2 = old.reshape(g, s)
    new2 = new.reshape(g, s)
    old_first = _first_rows(old2, num_experts)  # (G, E) sender's source row
    new_first = _first_rows(new2, num_experts)  # (G, E) receiver's primary row
    held = old_first >= 0
    recv = (new_first >= 0) & ~held  # (G, E) rank needs expert remotely
    if not recv.any():
        return LayerTransfers(g, s, _EMPTY, _EMPTY, _EMPTY, _EMPTY, _EMPTY)
    n_send = held.sum(axis=0)  # (E,)
    n_recv = recv.sum(axis=0)
    # i-th sender of each expert: stable argsort puts holders first in rank order
    senders = np.argsort(~held, axis=0, kind="stable")  # (G, E)
    recv_index = np.cumsum(recv, axis=0) - 1  # position of a receiver among its expert's
    dst, expert = np.nonzero(recv)  # (T,)
    j = recv_index[dst, expert]
    s_e = n_send[expert]
    k = n_recv[expert] // s_e
    # receivers below S_e·k go in blocks of k; the remainder one per sender
    in_block = j < s_e * k
    i = np.where(in_block, j // np.maximum(k, 1), j - s_e * k)
    src = senders[i, expert]
    order = np.lexsort((expert, dst, src))
    src, dst, expert = src[order], dst[order], expert[order]
    return LayerTransfers(
        world_size=g,
        slots_per_rank=s,
        src=read_only(src),
        dst=read_only(dst),
        expert=read_only(expert),
        src_row=read_only(old_first[src, expert]),
        dst_row=read_only(new_first[dst, expert]),
    )


def plan_from_transfers(old: np.ndarray, new: np.ndarray, transfers: LayerTransfers, rank: int) -> LayerPlan:
    """One rank's plan from the layer's rows and its (already computed) transfer list."""
    g, s = transfers.world_size, transfers.slots_per_rank
    if not 0 <= rank < g:
        raise ValueError(f"rank: must be in [0, {g}), got {rank}")
    o = np.asarray(old[rank * s : (rank + 1) * s], dtype=np.int64)
    n = np.asarray(new[rank * s : (rank + 1) * s], dtype=np.int64)
    rows = np.arange(s, dtype=np.int64)
    empty = n < 0
    unchanged = ~empty & (n == o)
    changed = ~empty & ~unchanged
    # first old row of this rank holding each value of n (-1 if none)
    if s:
        match = o[None, :] == n[:, None]  # (S new rows, S old rows)
        has = match.any(axis=1)
        first_old = np.where(has, match.argmax(axis=1), -1)
    else:
        has = np.zeros(0, dtype=bool)
        first_old = _EMPTY
    local = changed & has
    remote = changed & ~has
    remote_rows = rows[remote]
    remote_experts = n[remote]
    # the first row needing each remote expert is its primary (rows are ascending)
    uniq, first_idx, inverse = np.unique(remote_experts, return_index=True, return_inverse=True)
    is_primary = np.zeros(remote_rows.shape[0], dtype=bool)
    is_primary[first_idx] = True
    primary_of_expert = remote_rows[first_idx]  # aligned with uniq
    sends = transfers.src == rank
    recvs = transfers.dst == rank
    return LayerPlan(
        rank=int(rank),
        world_size=g,
        slots_per_rank=s,
        empty_rows=read_only(rows[empty]),
        unchanged_rows=read_only(rows[unchanged]),
        local_rows=read_only(rows[local]),
        local_src_rows=read_only(first_old[local]),
        primary_rows=read_only(remote_rows[is_primary]),
        primary_experts=read_only(remote_experts[is_primary]),
        duplicate_rows=read_only(remote_rows[~is_primary]),
        duplicate_src_rows=read_only(primary_of_expert[inverse[~is_primary]]),
        send_peers=read_only(transfers.dst[sends]),
        send_experts=read_only(transfers.expert[sends]),
        send_rows=read_only(transfers.src_row[sends]),
        recv_peers=read_only(transfers.src[recvs]),
        recv_experts=read_only(transfers.expert[recvs]),
        recv_rows=read_only(transfers.dst_row[recvs]),
    )


def plan_layer(old: Any, new: Any, world_size: int, rank: int) -> LayerPlan:
    """The plan of ``rank`` for one layer (validates the rows first)."""
    old, new = check_layer_maps(old, new, world_size)
    return plan_from_transfers(old, new, layer_transfers(old, new, world_size, validate=False), rank)


def plan_layer_all_ranks(old: Any, new: Any, world_size: int) -> list[LayerPlan]:
    """The plans of every rank of one layer, computed from one shared transfer list."""
    old, new = check_layer_maps(old, new, world_size)
    t = layer_transfers(old, new, world_size, validate=False)
    return [plan_from_transfers(old, new, t, r) for r in range(world_size)]


def moved_slots(old: Any, new: Any, world_size: int) -> int:
    """Slots whose new expert was not on that slot's rank before.

    ``old``/``new``: one layer (P,) or all layers (L, P); the count is summed over layers.
    Empty new slots (-1) never count. A rank that gains two slots of one expert counts two
    here but receives one row (the second is a local copy): :func:`received_rows` counts those.
    """
    return slot_moves(old, new, world_size)[0]


def received_rows(old: Any, new: Any, world_size: int) -> int:
    """Rows that cross ranks: per layer and rank, each expert the rank holds after but not
    before, once however many of its slots hold it (what the executor sends). Same inputs
    and checks as :func:`moved_slots`."""
    return slot_moves(old, new, world_size)[1]


def slot_moves(old: Any, new: Any, world_size: int) -> tuple[int, int]:
    """(:func:`moved_slots`, :func:`received_rows`) from one pass over the maps."""
    o, n = _rank_blocks(old, new, world_size)
    arriving = (n >= 0) & ~_present(o, n)
    wanted = np.sort(np.where(arriving, n, -1), axis=1)   # (L*G, S), -1 first
    firsts = (wanted[:, 1:] != wanted[:, :-1]) & (wanted[:, 1:] >= 0)
    return int(arriving.sum()), int((wanted[:, :1] >= 0).sum() + firsts.sum())


def _present(o: np.ndarray, n: np.ndarray) -> np.ndarray:
    """(L*G, S): whether each new slot's expert was anywhere in its rank's old slots."""
    return (n[:, :, None] == o[:, None, :]).any(axis=2)


def _rank_blocks(old: Any, new: Any, world_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The validated maps as (L*G, S) int64 blocks, one row per (layer, rank)."""
    world_size = as_count(world_size, "world_size")
    old = host_array(old, "old_phy2log")
    new = host_array(new, "new_phy2log")
    if old.shape != new.shape or old.ndim not in (1, 2):
        raise ValueError(f"new_phy2log: shape {new.shape} must equal old_phy2log's {old.shape}, (P,) or (L, P)")
    for name, m in (("old_phy2log", old), ("new_phy2log", new)):
        if not np.issubdtype(m.dtype, np.integer):
            raise ValueError(f"{name}: must hold integer expert ids, got dtype {m.dtype}")
        if m.size and (m.min() < -1 or m.max() >= m.shape[-1]):
            raise ValueError(f"{name}: expert ids must be in [-1, P={m.shape[-1]}), got {m.min()}..{m.max()}")
    old2 = old.reshape(-1, old.shape[-1]).astype(np.int64)
    new2 = new.reshape(-1, new.shape[-1]).astype(np.int64)
    p = old2.shape[1]
    if p % world_size:
        raise ValueError(f"phy2log: P={p} slots must divide by world_size={world_size} (P % G == 0)")
    s = p // world_size
    lg = old2.shape[0] * world_size
    return old2.reshape(lg, s), new2.reshape(lg, s)
