"""A torch group over some ranks of the default group, named alike on every one of them.

Building a group without every process of the default group taking part needs
``new_group(..., use_local_synchronization=True)``, and torch names such a group (the key
prefix its members meet under in the store) after its ranks and after how many groups the
building process has registered so far. When the members of an EP group registered different
numbers (one of them also belongs to a group its peers are not in), each builds under a name
of its own, and all wait in the store until the timeout. :func:`pad_registered_groups` makes
the numbers equal first: the members sum a vector of their counts over the EP group, and
each member below the largest registers one-rank groups (built alone, at once) up to it.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["pad_registered_groups", "registered_groups"]


def registered_groups() -> int | None:
    """How many process groups this process has registered with torch.distributed (None: torch keeps no such
    count where this module looks, so there is nothing to pad)."""
    from torch.distributed import distributed_c10d

    names = getattr(getattr(distributed_c10d, "_world", None), "pg_names", None)
    return len(names) if names is not None else None


def pad_registered_groups(all_reduce_sum: Callable[[torch.Tensor], None], index: int, size: int) -> int:
    """Register one-rank groups until this process holds as many groups as the member of the EP group that holds
    the most; returns how many it registered (collective: every member calls it, at the same point).

    ``all_reduce_sum``: a SUM all-reduce over the EP group, in place, on a (size,) float64 tensor (bounded by its
    own timeout); ``index``: this rank's index in the EP group; ``size``: the group's size.
    """
    import torch.distributed as dist

    mine = registered_groups()
    counts = torch.zeros(size, dtype=torch.float64)
    counts[index] = 0 if mine is None else mine
    all_reduce_sum(counts)
    if mine is None:
        return 0
    missing = int(counts.max().item()) - mine
    for _ in range(missing):
        # a group of this rank alone meets nobody: it only moves the count the next group's name is made from
        dist.new_group(ranks=[dist.get_rank()], use_local_synchronization=True)
    return missing
